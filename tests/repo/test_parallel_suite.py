"""The suite under pytest-xdist (scripts/test.sh): a ``serial`` test runs while no other test
runs on any worker, the others do run side by side, and the Ray scenario's background runs are
made once for the whole run, whichever worker claims them, and read by any worker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import conftest, ray_background
from tests.conftest import REPO

pytest.importorskip("xdist", reason="pytest-xdist is not installed (it is in the dev extra)")

# Two modules named as two of ONE_WORKER_MODULES, so kept each on one worker: each makes a
# module-scoped fixture (once, in the worker that runs all of the module's tests), has a plain
# test that meets the other module's plain test (each waits for the other to have started: they
# can only pass side by side), then a serial test, then more tests that use the fixture. Each
# test writes when it ran. Without the lock the two serial tests would run at the same moment;
# without the grouping the modules' tests would spread over both workers.
KEPT = """
import os, time, pytest

ME, OTHER = ("a", "b") if __name__.endswith("test_replay") else ("b", "a")
FOLDER = os.path.dirname(os.environ["RAN_LOG"])

def record(kind, start):
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(f"{kind} {os.getpid()} {start} {time.monotonic()}\\n")

@pytest.fixture(scope="module")
def made():
    with open(os.environ["RAN_LOG"] + ".made", "a") as f:
        f.write(f"{ME} {os.getpid()}\\n")
    return os.getpid()

def test_beside(made):
    start = time.monotonic()
    open(os.path.join(FOLDER, "started-" + ME), "w").close()
    while not os.path.exists(os.path.join(FOLDER, "started-" + OTHER)):
        assert time.monotonic() < start + 60, "the other worker's test never ran beside this one"
        time.sleep(0.01)
    time.sleep(0.3)
    record("beside", start)

@pytest.mark.serial
def test_alone(made):
    start = time.monotonic()
    time.sleep(1.0)
    record("alone", start)

@pytest.mark.parametrize("i", range(4))
def test_on_the_same_worker(made, i):
    assert made == os.getpid()
"""
KEPT_AS = ("test_replay.py", "test_replay_log.py")


def test_serial_tests_run_alone_the_others_side_by_side_and_a_kept_module_on_one_worker(tmp_path):
    for name in KEPT_AS:
        assert name in conftest.ONE_WORKER_MODULES
        (tmp_path / name).write_text(KEPT)
    log = tmp_path / "ran.log"
    # tests/conftest.py as a plugin: its hooks, on test files of its own, in two workers.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "-c", os.devnull, "--rootdir", str(tmp_path), "-n", "2", "--dist", "loadgroup",
                          *(str(tmp_path / name) for name in KEPT_AS)],
                         cwd=REPO, capture_output=True, text=True, timeout=180, env=dict(os.environ, RAN_LOG=str(log)))
    assert out.returncode == 0, out.stdout + out.stderr
    made = sorted((tmp_path / "ran.log.made").read_text().splitlines())
    assert [line.split()[0] for line in made] == ["a", "b"]  # each module's fixture made once
    assert len({line.split()[1] for line in made}) == 2  # the two modules on the two workers
    ran = [(kind, int(pid), float(a), float(b)) for kind, pid, a, b in
           (line.split() for line in log.read_text().splitlines())]
    assert sorted(kind for kind, *_ in ran) == ["alone"] * 2 + ["beside"] * 2

    def overlap(x, y):
        return x[2] < y[3] and y[2] < x[3]

    pairs = [(x, y) for i, x in enumerate(ran) for y in ran[i + 1:] if overlap(x, y)]
    assert pairs, ran  # the plain ones ran side by side (they waited for each other)
    assert all(x[0] == y[0] == "beside" for x, y in pairs), pairs  # a serial one never beside another


def test_the_background_runs_are_made_once_for_every_worker_and_read_by_any(tmp_path, monkeypatch):
    made = []
    release = threading.Event()

    def run():
        made.append(1)
        release.wait(10)
        return ray_background.Outcome(stdout='{"ok": true}', returncode=0, wall_s=1.5, lines=["a\n"])

    monkeypatch.setitem(ray_background.RUNS, "full", run)
    share = tmp_path / "share"
    first, second = ray_background.Background(), ray_background.Background()
    first.start(["full"], share)  # claims the run
    second.start(["full"], share)  # another worker: follows
    reader = threading.Thread(target=lambda: results.append(second.outcome("full", timeout=20)))
    results: list = []
    reader.start()
    release.set()
    reader.join(30)
    first.join(10)
    assert made == [1]
    assert results == [ray_background.Outcome(stdout='{"ok": true}', returncode=0, wall_s=1.5, lines=["a\n"])]
    assert first.outcome("full") == results[0]


def test_a_follower_whose_run_never_comes_says_so(tmp_path):
    share = tmp_path / "share"
    share.mkdir()
    (share / "claim").touch()  # another worker claimed it and never wrote the outcome
    follower = ray_background.Background()
    follower.start(["stopped"], share)
    outcome = follower.outcome("stopped", timeout=0.6)
    assert outcome.error == "the background stopped run (another xdist worker's) did not finish within 0.6 s"


def _test_file(name: str) -> Path:
    """The test file conftest names by its base name, in whichever folder of tests/ it is."""
    found = sorted((REPO / "tests").rglob(name))
    assert len(found) == 1, f"tests/conftest.py names {name}: {len(found)} files of that name under tests/"
    return found[0]


def test_every_test_named_serial_or_kept_on_one_worker_exists():
    """A renamed test must not silently lose its place: conftest names them as text."""
    for module, names in conftest.SERIAL.items():
        source = _test_file(module).read_text()
        for name in names:
            assert f"\ndef {name}(" in source, f"tests/conftest.py's SERIAL names {module}::{name}, not found"
    for module in conftest.ONE_WORKER_MODULES:
        assert _test_file(module).is_file(), module


def _test_sh(tmp_path, *args: str) -> list[str]:
    """scripts/test.sh in a copy of the layout whose bootstrap does nothing and whose python
    prints the arguments it was given and whether PYTHONDONTWRITEBYTECODE reached it."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    (tmp_path / "scripts" / "bootstrap.sh").write_text("true\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text('#!/bin/sh\necho "nobytecode=${PYTHONDONTWRITEBYTECODE-unset}"\nprintf "%s\\n" "$@"\n')
    python.chmod(0o755)
    out = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh"), *args], capture_output=True, text=True,
                         timeout=30, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_readmes_command_runs_the_suite_on_every_core_and_no_xdist_runs_it_serially(tmp_path):
    assert _test_sh(tmp_path) == ["nobytecode=unset", "-m", "pytest", "-n", "auto", "--dist", "loadgroup"]
    assert _test_sh(tmp_path, "tests/daemon/test_cli.py") == ["nobytecode=unset", "-m", "pytest", "-n", "auto", "--dist",
                                                       "loadgroup", "tests/daemon/test_cli.py"]
    for serially in (["-p", "no:xdist"], ["-pno:xdist"], ["-n", "0"], ["-n0"], ["--dist=load"]):
        assert _test_sh(tmp_path, *serially) == ["nobytecode=unset", "-m", "pytest", *serially], serially


def test_a_background_run_is_told_to_stop_when_what_started_it_goes():
    """A worker killed mid-run must not leave the run's Ray cluster behind: the run gets SIGTERM
    (PR_SET_PDEATHSIG, set before exec) when the thread that started it ends."""
    child = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (print('stopping', flush=True), " \
            "sys.exit(0))); print('ready', flush=True); time.sleep(60)"
    started: list[tuple[subprocess.Popen, str]] = []

    def start() -> None:  # as Background's thread does, then ends (as a killed worker's threads do)
        proc = subprocess.Popen([sys.executable, "-c", ray_background._DIE_WITH_PARENT, sys.executable, "-c", child],
                                stdout=subprocess.PIPE, text=True)
        started.append((proc, proc.stdout.readline().strip()))

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    proc, said = started[0]
    try:
        assert said == "ready"
        assert proc.wait(timeout=20) == 0 and proc.stdout.read().strip() == "stopping"
    finally:
        proc.kill()
        proc.wait()


def test_the_suite_still_runs_serially_without_xdist():
    """``bash scripts/test.sh -p no:xdist``: conftest's xdist hooks must not stop pytest there."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                          "tests/repo/test_parallel_suite.py", "-k", "every_test_named"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
