"""The Ray scenario's two runs (tests/test_ray_scenario.py), started when collection ends and
run beside the rest of the suite.

Each run is `examples/ray_colocate.py` in its own process: two to three minutes, most of them
waiting on Ray (nodes starting, Ray Train restarting its worker group), which would otherwise
be minutes of the suite doing nothing else. `tests/conftest.py` starts them in a thread when
the scenario's tests are collected, puts the tests that time nothing first (they share the two
cores with Ray while it starts), and the scenario's tests last, where they read the runs'
outcomes. A scenario test run alone (no background run started) runs its scenario itself.
"""

from __future__ import annotations

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


def _popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "examples/ray_colocate.py", "--json", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def full_run() -> Outcome:
    """The whole scenario, SIGTERMed (it stops everything it started, then prints its JSON) past 900 s."""
    started = time.monotonic()
    proc = _popen()
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=50)
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

    def start(self, names: list[str]) -> None:
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
                self._done[name].set()

    def outcome(self, name: str, timeout: float = 900.0) -> Outcome:
        """The run's outcome: the background one if it was started, else a run made now."""
        done = self._done.get(name)
        if done is None:
            return RUNS[name]()
        if not done.wait(timeout):
            return Outcome(error=f"the background {name} run did not finish within {timeout:g} s")
        return self._outcomes[name]


BACKGROUND = Background()
