"""bench.mps_fault (issue 21's GPU measurement) where it can run here: without CUDA it says why
and prints a result marked skipped, and its figures are computed from what its processes print
(tested on scripted lines, since the real ones need a GPU with MPS)."""

from __future__ import annotations

import json
import subprocess
import sys

from bench import mps_fault
from tests.conftest import REPO


def test_without_a_gpu_it_says_why_and_prints_a_skipped_result():
    run = subprocess.run([sys.executable, "-m", "bench.mps_fault", "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["benchmark"] == "mps_fault" and result["skipped"]
    assert "not run here" in run.stderr and "gpu-check" in run.stderr


def test_the_fault_figures_are_measured_from_the_fault():
    service = [{"event": "ok", "t": 9.0, "ms": 2.0}, {"event": "ok", "t": 9.5, "ms": 4.0},
               {"event": "error", "t": 10.05, "error": "RuntimeError: CUDA error: an illegal memory access"}]
    fresh = [{"event": "session", "t": 10.1, "mps": False}, {"event": "ready", "t": 11.0},
             {"event": "ok", "t": 11.2, "ms": 3.0}]
    got = mps_fault.summarize_fault(10.0, service, False, fresh)
    assert got == {"service_p50_ms_before": 3.0, "service_error": service[-1]["error"],
                   "service_error_after_ms": 50.0, "service_first_error_from_daemon": False,
                   "fresh_service_on_mps": False, "fault_to_next_good_ms": 1200.0}
    assert mps_fault.summarize_fault(10.0, service[:2], False, [])["fault_to_next_good_ms"] is None


def test_the_kill_figures_split_the_requests_at_the_kill():
    service = [{"event": "ok", "t": 1.0 + i / 10, "ms": float(i)} for i in range(20)]
    got = mps_fault.summarize_kill(2.0, service)
    assert got["service_error"] is None and got["service_requests_after"] == 10
    assert got["service_p99_ms_before"] < 10 <= got["service_p99_ms_after"]
