"""The Ray scenario's two runs (tests/ray/test_ray_scenario.py), started when collection ends and
run beside the rest of the suite.

Each run is `examples/ray_colocate.py` in its own process: two to three minutes, most of them
waiting on Ray (nodes starting, Ray Train restarting its worker group), which would otherwise
be minutes of the suite doing nothing else. `tests/conftest.py` starts them in a thread when
the scenario's tests are collected, puts the tests that time nothing first (they share the two
cores with Ray while it starts), and the scenario's tests last, where they read the runs'
outcomes. A scenario test run alone (no background run started) runs its scenario itself.

Under pytest-xdist every worker collects the scenario, but the runs must happen once: the first
worker to create the run's claim file (in a directory named by the test run's id) runs them and
writes each outcome there as JSON; any worker's scenario test reads it from there. The worker
that runs them waits for them at the end of its session, so that it never leaves before them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Outcome:
    """What a run left for its test to judge."""

    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    wall_s: float = 0.0
    lines: list[str] = field(default_factory=list)  # stderr lines read before acting (the stop run)
    workdir: str = ""
    error: str | None = None  # the runner itself failed (not the scenario)


# Runs argv[1:] with PR_SET_PDEATHSIG = SIGTERM: when the thread that started the run goes (its
# pytest worker killed, Ctrl-C), the run is told to stop and stops everything it started, rather
# than leaving a Ray cluster running under the rest of the machine's work.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; "
                    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0); "
                    "os.execv(sys.argv[1], sys.argv[1:])")


def _popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, sys.executable, "examples/ray_colocate.py",
                             "--json", *args], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def full_run() -> Outcome:
    """The whole scenario, SIGTERMed (it stops everything it started, then prints its JSON) past 900 s."""
    started = time.monotonic()
    proc = _popen()
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # never leave it running: a loaded VM once kept its cluster for an hour
            proc.kill()
            stdout, stderr = proc.communicate()
            return Outcome(stdout, stderr, proc.returncode, time.monotonic() - started,
                           error="the full run did not stop within 120 s of SIGTERM past 900 s: SIGKILLed")
    return Outcome(stdout, stderr, proc.returncode, time.monotonic() - started)


def stopped_run() -> Outcome:
    """SIGTERM once the job trains (its driver, Ray Train and loan nodes are all up)."""
    workdir = tempfile.mkdtemp(prefix="rc-stop-", dir="/tmp")
    started = time.monotonic()
    proc = _popen("--workdir", workdir)
    lines: list[str] = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "1. job trains with one worker" in line or "FAILED" in line:
                break
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Outcome(stdout, stderr, proc.returncode, time.monotonic() - started, lines, workdir)


RUNS: dict[str, Callable[[], Outcome]] = {"full": full_run, "stopped": stopped_run}


class Background:
    """The runs asked for, one after the other (two Ray clusters at once would share two cores
    four ways), in one daemon thread; each outcome is waited for by name."""

    def __init__(self) -> None:
        self._done: dict[str, threading.Event] = {}
        self._outcomes: dict[str, Outcome] = {}
        self._thread: threading.Thread | None = None
        self._share: Path | None = None
        self._followed: list[str] = []

    def start(self, names: list[str], share: Path | None = None) -> None:
        """Run ``names`` in the background; with ``share`` (a directory of this test run shared by
        the xdist workers), only if this process is the first to claim them, else read there."""
        self._share = share
        if share is not None:
            share.mkdir(parents=True, exist_ok=True)
            try:
                os.close(os.open(share / "claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                self._followed = list(names)  # another worker runs them: outcome() reads its files
                return
        self._done = {name: threading.Event() for name in names}
        self._thread = threading.Thread(target=self._run, args=(names,), name="ray-scenario", daemon=True)
        self._thread.start()

    def _run(self, names: list[str]) -> None:
        for name in names:
            try:
                self._outcomes[name] = RUNS[name]()
            except Exception as exc:  # told to the test, which fails with it
                self._outcomes[name] = Outcome(error=f"{type(exc).__name__}: {exc}")
            finally:
                if self._share is not None:
                    self._publish(name, self._outcomes[name])
                self._done[name].set()

    def _publish(self, name: str, outcome: Outcome) -> None:
        part = self._share / f"{name}.json.part"
        part.write_text(json.dumps(dataclasses.asdict(outcome)))
        os.replace(part, self._share / f"{name}.json")  # whole or absent to a reader

    def join(self, timeout: float = 1300.0) -> None:
        """Wait for the runs this process started (the end of an xdist worker's session)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def outcome(self, name: str, timeout: float = 900.0) -> Outcome:
        """The run's outcome: the background one if it was started (here or, under xdist, by
        another worker), else a run made now."""
        if name in self._followed:
            path = self._share / f"{name}.json"
            deadline = time.monotonic() + timeout
            while not path.exists():
                if time.monotonic() > deadline:
                    return Outcome(error=f"the background {name} run (another xdist worker's) "
                                         f"did not finish within {timeout:g} s")
                time.sleep(0.5)  # written once, by another process: no cue to wait on here
            return Outcome(**json.loads(path.read_text()))
        done = self._done.get(name)
        if done is None:
            return RUNS[name]()
        if not done.wait(timeout):
            return Outcome(error=f"the background {name} run did not finish within {timeout:g} s")
        return self._outcomes[name]


BACKGROUND = Background()
