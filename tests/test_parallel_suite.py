"""The suite under pytest-xdist (scripts/test.sh): a ``serial`` test runs while no other test
runs on any worker, the others do run side by side, and the Ray scenario's background runs are
made once for the whole run, whichever worker claims them, and read by any worker."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from tests import conftest, ray_background
from tests.conftest import REPO

pytest.importorskip("xdist", reason="pytest-xdist is not installed (it is in the dev extra)")

# Two groups, one a worker: in each a plain test that meets the other group's plain test (each
# waits for the other to have started: they can only pass side by side), then a serial test. Each
# test writes when it ran. Without the lock the two serial tests would run at the same moment.
TIMED = """
import os, time, pytest

def record(kind, start):
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(f"{kind} {os.getpid()} {start} {time.monotonic()}\\n")

@pytest.mark.parametrize("me, other", [pytest.param("a", "b", marks=pytest.mark.xdist_group("a")),
                                       pytest.param("b", "a", marks=pytest.mark.xdist_group("b"))])
def test_beside(me, other):
    start = time.monotonic()
    folder = os.path.dirname(os.environ["RAN_LOG"])
    open(os.path.join(folder, "started-" + me), "w").close()
    while not os.path.exists(os.path.join(folder, "started-" + other)):
        assert time.monotonic() < start + 60, "the other worker's test never ran beside this one"
        time.sleep(0.01)
    time.sleep(0.3)
    record("beside", start)

@pytest.mark.serial
@pytest.mark.parametrize("me", [pytest.param("a", marks=pytest.mark.xdist_group("a")),
                                pytest.param("b", marks=pytest.mark.xdist_group("b"))])
def test_alone(me):
    start = time.monotonic()
    time.sleep(1.0)
    record("alone", start)
"""


def test_a_serial_test_runs_while_no_other_test_runs_and_the_others_run_side_by_side(tmp_path):
    (tmp_path / "test_timed.py").write_text(TIMED)
    log = tmp_path / "ran.log"
    # tests/conftest.py as a plugin: its hooks, on a test file of its own, in two workers.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "-c", os.devnull, "--rootdir", str(tmp_path), "-n", "2", "--dist", "loadgroup",
                          str(tmp_path / "test_timed.py")],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, RAN_LOG=str(log)))
    assert out.returncode == 0, out.stdout + out.stderr
    ran = [(kind, int(pid), float(a), float(b)) for kind, pid, a, b in
           (line.split() for line in log.read_text().splitlines())]
    assert sorted(kind for kind, *_ in ran) == ["alone"] * 2 + ["beside"] * 2
    assert len({pid for _, pid, *_ in ran}) == 2  # both workers ran tests

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


def test_every_test_named_serial_or_kept_on_one_worker_exists():
    """A renamed test must not silently lose its place: conftest names them as text."""
    for module, names in conftest.SERIAL.items():
        source = (REPO / "tests" / module).read_text()
        for name in names:
            assert f"\ndef {name}(" in source, f"tests/conftest.py's SERIAL names {module}::{name}, not found"
    for module in conftest.ONE_WORKER_MODULES:
        assert (REPO / "tests" / module).exists(), module
