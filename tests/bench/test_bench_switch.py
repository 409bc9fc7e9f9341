"""bench.switch runs end to end on cpu with a tiny model and prints the keys it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("torch")


@pytest.mark.slow
def test_switch_bench_reports_six_ways_per_model(tmp_path):
    out_file = tmp_path / "switch.json"
    plot = tmp_path / "switch.png"
    run = subprocess.run(
        [sys.executable, "-m", "bench.switch", "--backend", "cpu", "--models", "tiny-cnn", "--batch", "2",
         "--input-size", "32", "--repeats", "2", "--cold-repeats", "1", "--json", "--out", str(out_file),
         *(["--plot", str(plot)] if _has_matplotlib() else [])],
        check=False, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)
    assert json.loads(out_file.read_text()) == r
    assert r["benchmark"] == "switch" and r["backend"] == "cpu" and r["batch"] == 2 and r["input_size"] == 32
    m = r["models"]["tiny-cnn"]
    assert m["after"] == "filler:tiny-cnn"  # one model given: a filler is "A"
    for key in ("ready_ms", "pipelined_ms", "sequential_ms", "warm_pageable_ms", "pinned_sync_ms", "cold_ms"):
        assert m[key] > 0, key
    assert len(m["ready_samples_ms"]) == len(m["pipelined_samples_ms"]) == len(m["sequential_samples_ms"]) == 2
    assert len(m["warm_pageable_samples_ms"]) == len(m["pinned_sync_samples_ms"]) == 2
    assert m["overhead_ratio"] == pytest.approx((m["pipelined_ms"] - m["ready_ms"]) / (m["cold_ms"] - m["ready_ms"]),
                                                rel=0.01, abs=1e-4)
    assert r["max_overhead_ratio"] == m["overhead_ratio"]
    assert len(m["cold_samples_ms"]) == 1
    assert m["model_bytes"] > 0 and m["groups"] >= 1
    assert m["cold_over_pipelined"] == pytest.approx(m["cold_ms"] / m["pipelined_ms"], rel=0.01)
    assert m["pipelined_over_sequential"] == pytest.approx(m["pipelined_ms"] / m["sequential_ms"], rel=0.01)
    assert m["pipelined_over_ready"] == pytest.approx(m["pipelined_ms"] / m["ready_ms"], rel=0.01)
    assert m["cold_ms"] > m["ready_ms"]  # a new process importing torch cannot beat a warm resident model
    assert m["outputs_equal"] and m["cold_output_matches"] and r["all_outputs_equal"]
    assert m["outputs_close"] and r["all_outputs_close"]
    assert set(m["outputs_equal_by_way"]) == {"ready", "pipelined", "sequential", "warm_pageable", "pinned_sync"}
    # on cpu the 50x goal is not judged, and the result says why
    assert r["goal_cold_over_pipelined"] is None and r["goal_cold_met"] is None
    assert "GPU goal" in r["goal_note"] and "overlap a copy with compute" in r["goal_note"]
    assert "h2d_gbps" not in m and "swap_efficiency" not in m  # cuda only
    assert r["min_cold_over_pipelined"] == m["cold_over_pipelined"]
    if _has_matplotlib():
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_switch_bench_refuses_an_unknown_model():
    run = subprocess.run([sys.executable, "-m", "bench.switch", "--backend", "cpu", "--models", "alexnet"],
                         check=False, capture_output=True, text=True, timeout=60, cwd=REPO,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert run.returncode == 2 and "unknown model 'alexnet'" in run.stderr


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_pack_host_lays_a_model_out_like_the_model_store():
    import torch

    from bench import models
    from bench.switch import pack_host

    model = models.build("tiny-cnn")
    x = models.example_input("tiny-cnn", 2, 32, 8)
    with torch.no_grad():
        expected = model(x)
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    total = pack_host(model)
    base = min(t.data_ptr() for t in tensors)
    assert all((t.data_ptr() - base) % 512 == 0 for t in tensors)  # neighbours 512 bytes apart, or a multiple
    assert total == sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
