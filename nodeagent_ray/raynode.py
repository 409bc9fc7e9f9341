"""A Ray node as a process we started, and stop by its pid, never with ``ray stop``
(which stops every Ray process of the host, other people's included).

A node is ``ray start --block`` in a session of its own: the CLI stays in the
foreground as the parent of the raylet and its agents, and on SIGTERM takes them
down. :class:`RayNodeProcess` starts one, writes a pidfile (pid and the kernel's
start time, so a recycled pid is never signalled), and stops it in steps: SIGTERM,
then SIGKILL to its process group, recording which step it took.

Every node gets explicit, small resources, because a raylet otherwise assumes the
whole machine: ``--num-cpus``, ``--memory``, ``--object-store-memory``. The object
store goes to ``plasma_dir`` (not ``/dev/shm``: nothing of ours may stay there),
logs and sockets under ``temp_dir``, and ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0``
makes a SIGTERM stop the node at once instead of draining it for 30 s.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from nodeagent.procwatch import process_start_ticks

log = logging.getLogger("nodeagent_ray.raynode")

__all__ = ["RayNodeProcess", "RayNodeSpec", "free_port", "host_start_lock", "node_env", "ray_start_argv",
           "wait_for_head_address"]

MiB = 1 << 20
OBJECT_STORE_MIN_BYTES = 75 * MiB  # Ray refuses less


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RayNodeSpec:
    """What one ``ray start`` gets."""

    temp_dir: str  # Ray's logs, sockets and session files (keep the path short: unix sockets live here)
    plasma_dir: str  # the object store's backing files
    num_cpus: float = 1
    num_gpus: int = 0
    memory_bytes: int = 512 * MiB
    object_store_bytes: int = 80 * MiB
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)  # added to the node's environment; its workers inherit it
    # The address the node binds and announces (--node-ip-address); None: Ray's choice, the
    # machine's interface. A one-host scenario gives 127.0.0.1, so nothing listens beyond the host.
    node_ip: str | None = None

    def __post_init__(self) -> None:
        if self.object_store_bytes < OBJECT_STORE_MIN_BYTES:
            raise ValueError(f"object_store_bytes must be >= {OBJECT_STORE_MIN_BYTES} (Ray's minimum), "
                             f"got {self.object_store_bytes}")
        if self.memory_bytes <= 0 or self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("memory_bytes must be > 0 and num_cpus, num_gpus >= 0")


@contextlib.contextmanager
def host_start_lock(path: str | None):
    """Held while one Ray node of this host starts, by every process that starts one (``path``
    None: no lock). Ray nodes of one host that start together race for the same socket names in
    their shared temp dir, and the loser times out joining; on a cluster each host starts its own,
    so only a one-host run (examples/ray_policies.py lends two devices in one turn) needs it."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ray_executable() -> str:
    """The ``ray`` CLI next to this Python (a venv's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    return beside if os.access(beside, os.X_OK) else (shutil.which("ray") or "ray")


def ray_start_argv(spec: RayNodeSpec, address: str | None) -> list[str]:
    """``ray start`` for a head (``address`` None) or a node joining ``address``."""
    argv = [ray_executable(), "start", "--block", "--disable-usage-stats",
            "--num-cpus", f"{spec.num_cpus:g}", "--num-gpus", str(spec.num_gpus),
            "--memory", str(int(spec.memory_bytes)), "--object-store-memory", str(int(spec.object_store_bytes)),
            "--temp-dir", spec.temp_dir, "--plasma-directory", spec.plasma_dir,
            # Several nodes on one host each need their own agent port; the default is fixed.
            "--dashboard-agent-listen-port", str(free_port())]
    if spec.node_ip is not None:
        argv += ["--node-ip-address", spec.node_ip]
    if address is None:
        argv += ["--head", "--port", "0", "--include-dashboard", "false"]
    else:
        argv += ["--address", address, "--include-log-monitor", "false"]
    if spec.resources:
        argv += ["--resources", json.dumps(dict(spec.resources), sort_keys=True)]
    if spec.labels:
        argv += ["--labels", ",".join(f"{k}={v}" for k, v in sorted(spec.labels.items()))]
    return argv


def node_env(base: Mapping[str, str], extra: Mapping[str, str] = ()) -> dict[str, str]:
    """A node's environment: ``base`` without the variables Ray sets for one worker (a loan
    agent is itself a Ray worker, and its children must not pass for it), then ``extra``."""
    env = {k: v for k, v in base.items() if not k.startswith("RAY_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env.update(extra)
    return env


def wait_for_head_address(temp_dir: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The GCS address a head started with ``temp_dir`` writes to ``ray_current_cluster``."""
    path = os.path.join(temp_dir, "ray_current_cluster")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                address = f.read().strip()
            if address:
                return address
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the Ray head exited with status {proc.returncode} before it was up")
        time.sleep(0.05)
    raise TimeoutError(f"the Ray head did not write {path} within {timeout_s:g} s")


class RayNodeProcess:
    """One ``ray start --block`` we started (or adopted from its pidfile)."""

    def __init__(self, pid: int, start_ticks: int | None, pidfile: str | None = None,
                 proc: subprocess.Popen | None = None, meta: Mapping | None = None) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.pidfile = pidfile
        self.meta = dict(meta or {})
        self._proc = proc
        self.stopped_by: str | None = None  # "exited" | "sigterm" | "sigkill", once stopped

    @classmethod
    def start(cls, spec: RayNodeSpec, address: str | None, *, log_path: str, pidfile: str | None = None,
              base_env: Mapping[str, str] | None = None, meta: Mapping | None = None) -> RayNodeProcess:
        env = node_env(os.environ if base_env is None else base_env, spec.env)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(ray_start_argv(spec, address), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        node = cls(proc.pid, process_start_ticks(proc.pid), pidfile, proc, meta)
        if pidfile is not None:
            node._write_pidfile()
        log.info("[raynode] started pid=%d address=%s resources=%s", proc.pid, address or "(head)",
                 dict(spec.resources))
        return node

    @classmethod
    def from_pidfile(cls, pidfile: str) -> RayNodeProcess | None:
        """The node a pidfile names, if that very process still runs; else None (the file is removed)."""
        try:
            with open(pidfile) as f:
                data = json.load(f)
            pid, ticks = int(data["pid"]), data.get("start_ticks")
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if ticks is None or process_start_ticks(pid) != ticks:
            _unlink(pidfile)
            return None
        return cls(pid, ticks, pidfile, None, data.get("meta"))

    def _write_pidfile(self) -> None:
        tmp = f"{self.pidfile}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": self.pid, "start_ticks": self.start_ticks, "meta": self.meta}, f)
        os.replace(tmp, self.pidfile)

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self.start_ticks is not None and process_start_ticks(self.pid) == self.start_ticks

    def terminate(self) -> bool:
        """SIGTERM, if it is still the process we started; False when it was already gone."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        return True

    def stop(self, term_s: float = 10.0) -> str:
        """SIGTERM, wait ``term_s``, then SIGKILL its process group. Returns the step that ended it."""
        if self.stopped_by is not None:
            return self.stopped_by
        step = "sigterm" if self.terminate() else "exited"
        if step == "sigterm" and not self._wait(term_s):
            step = "sigkill"
            log.warning("[raynode] pid=%d still running %.0f s after SIGTERM: SIGKILL to its group", self.pid, term_s)
            self._kill_group()
            self._wait(5.0)
        self._kill_group(only_leftovers=True)
        self.stopped_by = step
        if self.pidfile is not None:
            _unlink(self.pidfile)
        return step

    def _wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if self._proc is not None:
                try:
                    self._proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return False
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _kill_group(self, only_leftovers: bool = False) -> None:
        """SIGKILL what is left of the session we started (its process group is its pid). With
        ``only_leftovers`` only once the CLI itself is gone: workers the raylet did not reap."""
        if only_leftovers and self.alive():
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
