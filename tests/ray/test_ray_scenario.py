"""The end-to-end test of issue 13: examples/ray_colocate.py on a local Ray cluster of three
nodes, each with its own nodeagent daemon. It takes about two minutes on a 2-core machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, wait_for
from tests.ray_background import BACKGROUND

pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_ray_colocate_lends_reclaims_resizes_and_loses_no_work():
    run = BACKGROUND.outcome("full")  # started when collection ended (tests/ray_background.py)
    assert run.error is None, run.error
    stdout, stderr, wall_s = run.stdout, run.stderr, run.wall_s
    try:
        result = json.loads(stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON on stdout (exit {run.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    assert result["ok"], json.dumps(result, indent=1) + stderr[-4000:]
    assert run.returncode == 0 and wall_s < 900, wall_s

    assert result["nodes"] == ["n1", "n2", "n3"]
    assert {lend["node"] for lend in result["lends"]} == {"n2", "n3"}  # n1's inference kept it
    by_then = {r["then"]: r for r in result["reclaims"] if r["reason"] == "inference session"}
    for reclaim in result["reclaims"]:
        assert {"node", "device", "free_ms", "ray_caught_up_ms"} <= set(reclaim)
    released, parked = by_then["release"], by_then["park"]
    assert (released["node"], parked["node"]) == ("n2", "n3")
    assert 0 < released["free_ms"] < 3000 and 0 <= released["ray_caught_up_ms"] < 1000
    assert parked["ray_caught_up_ms"] is None  # kept for the in-process resume
    assert result["train_workers_max"] == 2 and result["train_steps"] > 0
    assert result["train_steps_redone"] == 0 and result["sessions_lost"] == 0
    assert [(r["from"], r["to"]) for r in result["train_resizes"]] == [(1, 2), (2, 1), (1, 2)]
    park = result["park_resume"]
    assert park["same_process"] and park["parked_at_step"] == park["resumed_at_step"]
    assert result["inference_wait_p99_ms"] is not None and result["controller_restarts"] == 1
    cleanup = result["cleanup"]
    assert cleanup["leftover_processes"] == [] and cleanup["shm_left"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_stopped_while_the_job_trains_stops_everything_it_started():
    """The failure path: SIGTERM (a test's timeout, Ctrl-C) while Ray Train is mid-run. Every
    process goes, by pid, and the JSON says so; checked here again from /proc, independently."""
    run = BACKGROUND.outcome("stopped")
    assert run.error is None, run.error
    workdir, lines, stdout, stderr = run.workdir, run.lines, run.stdout, run.stderr
    result = json.loads(stdout)
    assert result.get("interrupted") and not result["ok"], "".join(lines) + stderr[-3000:]
    cleanup = result["cleanup"]
    assert cleanup["fit_driver"] in ("sigterm", "sigkill") and cleanup["loan_nodes"], cleanup
    assert cleanup["leftover_processes"] == [] and cleanup["shm_left"] == [], cleanup
    time.sleep(1.0)  # a straggler the cleanup missed would still be here
    left = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                named = workdir.encode() in f.read()
            fds = f"/proc/{entry}/fd"
            if named or any(os.readlink(f"{fds}/{fd}").startswith(workdir + os.sep) for fd in os.listdir(fds)):
                left.append(int(entry))  # Ray's agents rename themselves, but keep their logs open there
        except OSError:
            pass
    assert left == [], left
    assert not os.path.exists(workdir)


def test_a_workdir_with_something_in_it_is_refused_before_anything_starts(tmp_path):
    """The run removes its directory at the end: one of the user's must not be it."""
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run([sys.executable, "examples/ray_colocate.py", "--json", "--workdir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith(f"--workdir {tmp_path} must be a new or empty directory: the run removes it "
                                        "at the end (unless --keep)")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_supervisor_keeps_track_of_what_outlives_the_driver():
    """What the driver started lives on, re-parented, after the driver exits, and may start
    more (a raylet starting workers): found from what was seen before, by start time. Once a
    process exits it is no longer reported, whatever process may take its pid."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ray_colocate", REPO / "examples" / "ray_colocate.py")
    rc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = rc  # its dataclasses look their module up
    try:
        spec.loader.exec_module(rc)
    finally:
        del sys.modules[spec.name]
    # The driver starts a shell that, a second later, starts a child of its own (the `true` keeps
    # the shell from exec-ing into it).
    driver = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               "p = subprocess.Popen(['sh', '-c', 'sleep 1; sleep 30; true']); "
                               "print(p.pid, flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    shell = int(driver.stdout.readline())
    first = wait_for(lambda: _children(shell), timeout=5)  # sleep 1
    watch = rc.PidWatch(lambda: [driver.pid])
    try:
        driver.stdin.close()
        driver.wait(10)  # the shell is re-parented now
        later = wait_for(lambda: [pid for pid in _children(shell) if pid not in first], timeout=10)  # sleep 30
        watch.sample()
        assert watch.still_running() == sorted([shell, *later])
        for pid in (shell, *later):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: watch.still_running() == [], timeout=5)  # dead at once; a zombie does not count
    finally:
        watch.stop()
        for pid in watch.still_running():
            os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []
