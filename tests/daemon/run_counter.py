"""``nodeagent run`` over a busy CMD that counts (COUNTER), and what the tests read of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO, wait_for


# CMD for most tests: busy, writes its pid once and a counter about every 1 ms
# (atomically, so a read never sees half a number). With argv[2], a SIGTERM
# handler writes that marker file and exits 0.
COUNTER = r"""
import os, signal, sys, time
path = sys.argv[1]
if len(sys.argv) > 2:
    def on_term(signum, frame):
        open(sys.argv[2], "w").write("term")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
open(path + ".pid", "w").write(str(os.getpid()))
n, next_write = 0, 0.0
while True:
    n += 1
    now = time.monotonic()
    if now >= next_write:
        with open(path + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(path + ".tmp", path)
        next_write = now + 0.001
"""


class Counter:
    """Reads what the COUNTER program writes under ``workdir``."""

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, "counter")
        self.marker = os.path.join(workdir, "terminated")

    def value(self) -> int:
        try:
            with open(self.path) as f:
                return int(f.read() or 0)
        except FileNotFoundError:
            return 0

    def pid(self) -> int:
        return int(wait_for(lambda: os.path.exists(self.path + ".pid") and open(self.path + ".pid").read()))

    def wait_advancing(self, timeout: float = 5.0) -> int:
        start = self.value()
        return wait_for(lambda: self.value() > start + 20 and self.value(), timeout)

    def frozen_for(self, seconds: float) -> tuple[int, int]:
        before = self.value()
        time.sleep(seconds)
        return before, self.value()

    def assert_frozen(self, seconds: float, settle_s: float = 0.05) -> None:
        """CMD makes no progress for ``seconds`` (after ``settle_s`` for a last write to land)."""
        time.sleep(settle_s)
        before, after = self.frozen_for(seconds)
        assert after == before, f"CMD ran while it should be stopped ({before} -> {after})"


def launched_cmds(workdir):
    """Factory: ``launch(endpoint, *run_flags, cmd=[...])`` -> the ``nodeagent run`` Popen.
    Without ``cmd`` it runs COUNTER. Launchers and their CMDs are killed at the end."""
    procs: list[subprocess.Popen] = []
    counter = Counter(workdir)

    def start(endpoint: str, *flags: str, cmd: list[str] | None = None, term_marker: bool = False):
        if cmd is None:
            cmd = [sys.executable, "-c", COUNTER, counter.path] + ([counter.marker] if term_marker else [])
        proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "run", "--endpoint", endpoint, *flags,
                                 "--", *cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    start.counter = counter
    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if os.path.exists(counter.path + ".pid"):
        try:
            os.killpg(counter.pid(), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
