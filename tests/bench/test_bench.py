"""The benchmarks run end to end (short settings) and print the keys they promise."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run_bench(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", *args, "--json"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_handoff_bench_reports_latency_against_its_baselines():
    r = run_bench("bench.handoff", "--sessions", "2,4", "--handoffs", "300", "--rounds", "3", "--pairs", "1",
                  "--round-trips", "200", "--pipe-round-trips", "100")
    for key in ("handoff_p50_us", "handoff_p99_us", "baseline_rtt_p50_us", "ratio_p50", "pipe_rtt_p50_us",
                "ratio_pipe_p50", "relay_p50_us", "ratio_relay_pipe_p50"):
        assert r[key] > 0, key
    # The ratio is reported to two places: a true 0.415 is written 0.42 (a clean checkout failed on it).
    assert r["ratio_p50"] == pytest.approx(r["handoff_p50_us"] / r["baseline_rtt_p50_us"], rel=0.01, abs=0.0051)
    assert r["session_counts"] == [2, 4] and set(r["by_sessions"]) == {"2", "4"}
    assert r["sessions"] == 4 and r["handoff_p50_us"] == r["by_sessions"]["4"]["handoff_p50_us"]  # the last count
    for n, s in r["by_sessions"].items():
        assert s["sessions"] == int(n) and s["handoffs"] >= 300, n
        assert len(s["ratio_pipe_p50_per_round"]) == len(s["pipe_rtt_p50_us_per_round"]) == 3, n  # paired by round
        assert s["ratio_pipe_p50"] == pytest.approx(statistics.median(s["ratio_pipe_p50_per_round"]), abs=0.011), n
        assert s["pipe_samples"] == 3 * 2 * 100, n  # each round: the pipe blocks before and after it
        assert s["goal_p50_met"] == (s["ratio_pipe_p50"] <= 2.5), n
        assert s["goal_p99_met"] == (s["handoff_p99_us"] < 1000), n
    assert [(g["sessions"], g["value"]) for g in r["goals"]] == [
        (2, r["by_sessions"]["2"]["ratio_pipe_p50"]), (4, r["by_sessions"]["4"]["ratio_pipe_p50"]),
        (4, r["handoff_p99_us"])]
    assert r["all_goals_met"] == all(g["met"] for g in r["goals"])


def test_handoffs_pair_within_a_round_and_drop_its_edges():
    """A release is paired with the next grant's observation only in the same round (between
    rounds the token waited for the baselines), and each round's first and last grants are dropped."""
    from bench.handoff import pair_handoffs, paired_ratio, plan

    # (round, grant, observed, release started, release returned): grants 1-6 in round 1, 7-12 in round 2
    records = [(1 + (g - 1) // 6, g, 1000 * g, 1000 * g + 10, 1000 * g + 20) for g in range(1, 13)]
    per_round, unpaired = pair_handoffs(records, edge=1)
    assert per_round == {1: [990] * 4, 2: [990] * 4}  # kept 2..5 and 8..11, never 6 -> 7
    assert unpaired == 0
    del records[3]  # grant 4 was observed by a client that did not report (another client's grant)
    per_round, unpaired = pair_handoffs(records, edge=1)
    assert per_round[1] == [990, 990] and unpaired == 1  # 3 -> 4 lost, 4 itself no longer kept
    ratio, ratios = paired_ratio([[10, 20, 30], [40], [90]], [[10], [10], [30]])
    assert ratios == [2.0, 4.0, 3.0] and ratio == 3.0  # the median of per-round ratios, not of pooled samples
    warmup, *rounds = plan(sessions=4, handoffs=100, rounds=4)
    assert warmup * 4 >= 200 and rounds == [rounds[0]] * 4
    assert rounds[0] * 4 - 2 * 4 >= 25  # each round still gives its share once the edges are dropped


def test_pipe_ping_pong_blocks_can_be_taken_between_rounds():
    from bench.baselines import PipePingPong

    with PipePingPong() as pipe:
        first, second = pipe.block(50), pipe.block(20, warmup=0)
    assert len(first) == 50 and len(second) == 20
    assert all(0 < rtt < 1_000_000_000 for rtt in first + second)


def _forked_session(ctl, endpoint: str) -> None:
    from client_lib import Client
    from client_lib import liveness

    with Client("forked", endpoint=endpoint) as client:
        grant = client.acquire()
        client.release()
        ctl.ready()
        ctl.result({"session": client.session_id, "grant": grant, "pid": os.getpid(),
                    "liveness_thread_here": liveness.watcher().is_alive() and liveness.watcher()._pid == os.getpid()})


def test_a_forked_bench_worker_gets_its_own_session_while_the_parent_holds_one(daemon):
    """bench/common.py forks its clients. The parent's one-shot status leaves nothing open, and a child
    forked while the parent holds a Client (its socket, its liveness thread) opens its own connection,
    gets its own session and the token, and leaves the parent's session alone when it exits."""
    from bench import common
    from client_lib import Client

    common.daemon_status(daemon.endpoint)
    with Client("parent", endpoint=daemon.endpoint) as parent:
        with common.Workers() as workers:
            workers.start(_forked_session, daemon.endpoint)
            workers.wait_ready(15)
            workers.go()
            (child,) = workers.results(15)
        assert child["session"] != parent.session_id and child["grant"] > 0
        assert child["pid"] != os.getpid() and child["liveness_thread_here"]
        sessions = {s.id: s for d in common.daemon_status(daemon.endpoint).devices for s in d.sessions}
        assert sessions[parent.session_id].attached and sessions[parent.session_id].pid == os.getpid()
        assert child["session"] not in sessions  # the child said goodbye
        assert parent.acquire(timeout=5) > child["grant"]
        parent.release()


@pytest.mark.slow
def test_fairness_bench_reports_shares():
    r = run_bench("bench.fairness", "--seconds", "2")
    assert r["asked_share"] == [0.25, 0.25, 0.5]
    assert sum(r["measured_share"]) == pytest.approx(1.0, abs=0.01)
    assert r["max_error_points"] < 10  # loose here: 2 s on a shared CI box; the 2-point goal is the bench's


@pytest.mark.slow
def test_preempt_bench_reports_inference_waits():
    r = run_bench("bench.preempt", "--seconds", "2")
    assert r["requests"] > 10 and r["training_units"] > 0
    assert 0 < r["inference_wait_p50_ms"] <= r["inference_wait_p99_ms"]


@pytest.mark.slow
def test_enforce_bench_reports_both_hogs():
    r = run_bench("bench.enforce", "--seconds", "2")
    assert r["grace_ms"] == 100
    for name in ("launched", "library"):
        s = r[name]
        assert s["requests"] > 5, name
        assert 0 < s["inference_wait_p50_ms"] <= s["inference_wait_p99_ms"] <= s["inference_wait_max_ms"], name
        assert s["hog_progress"] > 0, name  # the hog ran between requests
        assert s["hog_units_while_inference_held"] == 0, name  # and never while inference held the token
    assert r["inference_wait_p99_ms"] == r["launched"]["inference_wait_p99_ms"]
    assert r["launched"]["inference_wait_p99_ms"] < r["grace_ms"]  # the launcher stops the hog itself
    # The daemon waits out the grace period; a request already due when the one before it ends
    # is served in the token's linger (scheduler.linger_ms), without stopping the hog again.
    assert r["library"]["inference_wait_p99_ms"] >= r["grace_ms"]
    assert r["library"]["requests"] // 2 - 1 <= r["library"]["stops"] <= r["library"]["requests"]
    assert r["library"]["p99_minus_grace_ms"] == pytest.approx(
        r["library"]["inference_wait_p99_ms"] - r["grace_ms"], abs=0.002)
    assert r["idle_wait_p50_ms"] > 0


@pytest.mark.slow
def test_recovery_bench_reattaches_every_session():
    r = run_bench("bench.recovery", "--sessions", "8")
    assert r["sessions"] == r["sessions_kept"] == r["restored"] == 8
    assert r["client_errors"] == 0
    assert 0 < r["ready_s"] <= r["reattach_s"]
    assert r["reattach_after_ready_s"] == pytest.approx(r["reattach_s"] - r["ready_s"], abs=0.001)


@pytest.mark.slow
def test_suspend_bench_reports_park_resume_and_restart_per_size():
    pytest.importorskip("torch")
    r = run_bench("bench.suspend", "--state-mb", "8,16", "--repeats", "2")
    assert r["backend"] in ("cpu", "cuda") and r["all_verified"]
    for mb in ("8", "16"):
        s = r["sizes"][mb]
        assert s["bytes_copied"] == s["bytes_expected"] >= int(mb) << 20, mb  # params, grads and Adam state
        if r["backend"] == "cpu":  # on cuda: the drop of torch's reserved memory, which may differ
            assert s["bytes_parked"] == s["bytes_copied"], mb
        assert s["checkpoint_bytes"] >= s["bytes_copied"]  # the restart path moves the same state
        assert s["suspend_ms"] > 0 and s["resume_ms"] > 0 and s["restart_ms"] > 0, mb
        assert s["speedup"] == pytest.approx(s["restart_ms"] / (s["suspend_ms"] + s["resume_ms"]), rel=0.01)
    trip = r["daemon_roundtrip"]
    assert trip["outcome"] == "suspended" and trip["parked_while_suspended"]
    assert trip["bytes_parked"] == r["sizes"]["8"]["bytes_parked"]
    assert r["min_speedup"] == min(s["speedup"] for s in r["sizes"].values())


def test_suspend_counts_only_the_storages_on_the_device():
    """On a GPU Adam keeps its step counters in host memory and Yielder parks only device storages, so
    the bytes expected are those on the device ("meta" stands in for the GPU here)."""
    torch = pytest.importorskip("torch")
    from bench.suspend import device_storage_bytes
    on_device = [torch.empty(256, device="meta"), torch.empty(64, device="meta")]
    step = torch.tensor(1.0)  # Adam's step: a host scalar beside parameters on a GPU
    assert device_storage_bytes([*on_device, step], torch.device("meta")) == (256 + 64) * 4
    assert device_storage_bytes([*on_device, step], torch.device("cpu")) == 4
    shared = torch.zeros(100)
    assert device_storage_bytes([shared, shared[10:], shared.view(10, 10)], torch.device("cpu")) == 400  # once


def test_suspend_verifies_the_bytes_copied_not_the_device_memory_released():
    """On cuda a park's ``bytes_parked`` is the drop of torch's reserved memory (cuBLAS workspaces
    and whole cached blocks included), which need not equal the state's bytes; ``bytes_copied`` does."""
    torch = pytest.importorskip("torch")
    from bench.suspend import TrainingState, device_storage_bytes, state_verified
    from client_lib.torch import Yielder

    cpu = torch.device("cpu")
    state = TrainingState(1, cpu)
    yielder = Yielder(modules=(), optimizers=[state.opt])
    expected = device_storage_bytes(state.tensors(), cpu)
    reference = [t.detach().clone() for t in (state.params[0], state.params[-1].grad)]
    yielder.park()
    yielder.unpark()
    after = [state.params[0], state.params[-1].grad]
    assert yielder.bytes_copied == expected
    yielder.bytes_parked = expected + (2 << 20)  # what a cuda park reports when it also frees a workspace
    assert state_verified(yielder, expected, reference, after)
    yielder.bytes_copied = expected - 4  # a storage left behind
    assert not state_verified(yielder, expected, reference, after)
    yielder.bytes_copied = expected
    with torch.no_grad():
        state.params[0][0] += 1
    assert not state_verified(yielder, expected, reference, after)
