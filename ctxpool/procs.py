"""Worker processes as the pool sees them, apart from what the pool (:mod:`ctxpool.pool`) has them do:
lifecycle states, what they start with, stopping in steps, cleanup however the pool ends, and the
weight segments left by a daemon killed outright.
Signals go only to our own unreaped children, whose pids cannot be reused.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing.connection
import os
import re
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Callable, Mapping, Optional

from client_lib import tensors

log = logging.getLogger("ctxpool.pool")

WEIGHTS_PREFIX = "na-w"  # weight segments: na-w-<daemon pid>-<n>-<random>
SHM_DIR = "/dev/shm"


class WorkerState(enum.Enum):
    """Lifecycle of one worker process::

                  spawn      Ready, then every registered model attached
        (new) ─────────► STARTING ───────────────────────────────► IDLE ◄───┐
                            │                                       │       │ its reply
                            │                  a message sent (Run, │       │ (Done, Failed,
                            │                 Prepare, Attach, Drop) ▼       │  Attached, ...)
                            │                                      BUSY ────┘
                            │
        any state ── exit, killed, EOF on its pipe ──► DEAD   (replaced within the restart budget)
        any state ── shutdown() ──► STOPPING ── exited ──► DEAD   (not replaced)
    """

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"
    DEAD = "dead"


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker of one device starts with (asked at every spawn): ``env`` before anything can start
    CUDA (``cuInit`` reads ``CUDA_VISIBLE_DEVICES`` and the MPS variables once), the CUDA ``ordinal`` it
    then uses (0 when ``env`` leaves only its GPU visible), and the bound on what its engine keeps resident."""

    env: Mapping[str, str] = field(default_factory=dict)
    ordinal: int = 0
    memory_budget_bytes: Optional[int] = None


class ShutdownStep(str, enum.Enum):
    """How far a shutdown had to escalate for one worker."""

    NOT_RUNNING = "not-running"
    SHUTDOWN = "shutdown"  # obeyed the Shutdown message
    SIGTERM = "sigterm"
    SIGKILL = "sigkill"


def describe_exit(code: Optional[int]) -> str:
    """``exitcode`` of a multiprocessing process, in words."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (signal {-code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def escalate(processes: dict[int, tuple[BaseProcess, Callable[[], bool]]], timeout_s: float) -> dict[int, ShutdownStep]:
    """Stop ``processes`` (pid -> (process, ask)): ``ask()`` sends the Shutdown message and says whether it
    could (if not: SIGTERM at once); then SIGTERM, then SIGKILL, after half, a third and the rest of
    ``timeout_s`` (the rest 1 s at least), blocking no longer. Returns the step that stopped each one."""
    steps: dict[int, ShutdownStep] = {}
    asked: dict[int, ShutdownStep] = {}  # the step each process was last given
    running: dict[int, BaseProcess] = {}
    for pid, (proc, ask) in processes.items():
        if proc.exitcode is not None:
            steps[pid] = ShutdownStep.NOT_RUNNING
            continue
        running[pid] = proc
        asked[pid] = ShutdownStep.SHUTDOWN
        if not ask():
            asked[pid] = ShutdownStep.SIGTERM
            os.kill(pid, signal.SIGTERM)
    polite_s, term_s = timeout_s / 2, timeout_s / 3
    for step, wait_s in ((None, polite_s), (ShutdownStep.SIGTERM, term_s),
                         (ShutdownStep.SIGKILL, max(timeout_s - polite_s - term_s, 1.0))):
        if step is not None and running:
            log.warning("[ctxpool] shutdown: %s to pids %s", step.value, sorted(running))
            for pid in running:
                asked[pid] = step
                os.kill(pid, signal.SIGTERM if step is ShutdownStep.SIGTERM else signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        while running and time.monotonic() < deadline:
            multiprocessing.connection.wait([proc.sentinel for proc in running.values()],
                                            timeout=max(deadline - time.monotonic(), 0))
            for pid in [pid for pid, proc in running.items() if proc.exitcode is not None]:
                steps[pid] = asked[pid]
                del running[pid]
    for pid in running:
        log.error("[ctxpool] shutdown: pid=%d still runs after SIGKILL", pid)
        steps[pid] = ShutdownStep.SIGKILL
    return steps


class Resources:
    """What must go whatever happens to the pool object: processes, pipes and segments.
    Held by a ``weakref.finalize``, so it must not refer to the pool."""

    def __init__(self) -> None:
        self.processes: dict[int, BaseProcess] = {}
        self.conns: dict[int, multiprocessing.connection.Connection] = {}
        self.segments: set[str] = set()

    def cleanup(self) -> None:
        for pid, proc in list(self.processes.items()):
            if proc.exitcode is None:
                log.warning("[ctxpool] cleanup: SIGKILL worker pid=%d", pid)
                proc.kill()
            proc.join(5.0)
            if proc.exitcode is not None:
                proc.close()
        for conn in self.conns.values():
            conn.close()
        for name in self.segments:
            tensors.unlink_segment(name)
        self.processes.clear(), self.conns.clear(), self.segments.clear()


def sweep_stale_segments(prefix: str = WEIGHTS_PREFIX) -> list[str]:
    """Unlink weight segments that pools of dead processes left behind (a daemon killed
    with SIGKILL cannot clean up). Names carry the creator's pid; a live pid's are kept."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        found = pattern.match(name)
        if found is None or _pid_alive(int(found.group(1))):
            continue
        try:
            if tensors.unlink_segment(name):
                removed.append(name)
        except PermissionError:
            continue  # another user's
    if removed:
        log.warning("[ctxpool] swept %d stale weight segments: %s", len(removed), removed)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's, alive
    return True
