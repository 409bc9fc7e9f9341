"""bench.reclaim runs end to end (short settings) and reports what it promises."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_reclaim_bench_reports_cooperative_and_enforced_reclaims(tmp_path):
    pytest.importorskip("torch")
    out_file = tmp_path / "reclaim.json"
    out = subprocess.run([sys.executable, "-m", "bench.reclaim", "--json", "--repeats", "2", "--state-mb", "16",
                          "--deadline-ms", "150", "--out", str(out_file)],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert json.loads(out_file.read_text()) == r
    assert (r["deadline_ms"], r["repeats"], r["state_mb"]) == (150.0, 2, 16)
    assert r["outcomes"] == {"cooperative": {"suspended": 2}, "enforced": {"stopped": 2}}
    assert len(r["reclaim_cooperative_samples_ms"]) == len(r["reclaim_enforced_samples_ms"]) == 2
    assert r["bytes_parked"] >= 16 << 20  # the trainer really parked its state
    # cooperative: at least its own park, and far below the deadline it was given (30 s)
    assert 0 < r["park_ms"] and all(v > 0 for v in r["reclaim_cooperative_samples_ms"])
    assert r["reclaim_cooperative_ms"] < 5000
    # enforced: the deadline, then the stop: never earlier, and not much later
    assert all(150 <= v < 1000 for v in r["reclaim_enforced_samples_ms"])
    assert r["enforced_minus_deadline_ms"] == pytest.approx(r["reclaim_enforced_ms"] - 150, abs=0.002)
    assert r["cooperative_minus_park_ms"] == pytest.approx(r["reclaim_cooperative_ms"] - r["park_ms"], abs=0.002)
    assert 0 < r["rtt_ms"] < r["cooperative_call_ms"]
