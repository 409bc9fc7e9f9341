"""Promises kept when clients do not cooperate: stopping verified processes
only, memory admission and over-use, metrics an operator can scrape."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from client_lib import Client, DaemonError, ErrorCode
from nodeagent.config import ServeConfig
from nodeagent.devices import CpuBackend, DeviceProcess
from nodeagent.memory import MiB
from nodeagent.metrics import Metrics
from nodeagent.daemon.server import AgentServer
from tests.conftest import BOTH_MODES, wait_for
from tests.conftest import free_port as _free_port
from tests.proc_tools import proc_state, assert_stopped


def ticks(child) -> int:
    return len(child.events("TICK"))


def assert_frozen(child, seconds: float = 0.3) -> None:
    time.sleep(0.1)  # lines already in the pipe drain first
    before = ticks(child)
    time.sleep(seconds)
    assert ticks(child) == before, "the stopped process kept running"


def session_named(daemon, name: str):
    return next(s for s in daemon.status().devices[0].sessions if s.name == name)


@BOTH_MODES
def test_library_client_that_ignores_yields_is_stopped_then_continued(start_daemon, spawn, sharing):
    """Exclusive: an inference request asks the hog to yield. Co-run, where inference would be
    granted beside it: a second trainer's, at the end of the hog's quantum. Either way it is
    stopped past the grace, and continued when the token comes back to it."""
    # Co-run: the waiter, this process, takes turns with the hog, so its own quantum must outlast
    # what it checks while holding: at its end it would be asked to yield, and stopped in turn.
    quantum_s = 1.0 if sharing == "corun" else 0.2
    d = start_daemon("--grace-ms", "100", "--quantum-ms", f"training={quantum_s * 1000:.0f}")
    hog = spawn(d.endpoint, "stubborn", "--name", "hog")
    hog.expect("TICK", count=3)
    workload = "inference" if sharing == "exclusive" else "training"
    with Client("waiter", workload=workload, endpoint=d.endpoint) as waiter:
        asked = time.monotonic()
        waiter.acquire(timeout=5)
        waited = time.monotonic() - asked
        # The grace, then the stop; under co-run after the rest of the hog's quantum too.
        assert 0.09 < waited < 1.0 + (quantum_s if sharing == "corun" else 0.0), waited
        assert_stopped(hog.proc.pid)
        assert session_named(d, "hog").stopped
        assert_frozen(hog)
        waiter.release()
        wait_for(lambda: proc_state(hog.proc.pid) != "T")
        resumed_from = ticks(hog)
        hog.expect("TICK", count=resumed_from + 3)  # it runs again
        assert not session_named(d, "hog").stopped
    assert "action=stop" in d.log() and "SIGCONT" in d.log()


def test_a_claimed_pid_is_never_signalled(start_daemon, spawn):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        d = start_daemon("--grace-ms", "50")
        liar = spawn(d.endpoint, "spoof", "--name", "liar", "--claim-pid", str(victim.pid))
        liar.expect("TICK", count=2)
        with Client("infer", workload="inference", endpoint=d.endpoint) as infer:
            infer.acquire(timeout=5)
            # The daemon stopped the process it verified (the liar), not the one claimed.
            assert_stopped(liar.proc.pid)
            assert proc_state(victim.pid) != "T"
            assert session_named(d, "liar").pid == liar.proc.pid
    finally:
        victim.kill()
        victim.wait()


def test_an_unverifiable_client_is_revoked_never_signalled(start_daemon, spawn):
    # Over TCP the kernel tells nothing about the peer: no pid is verified.
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        d = start_daemon("--grace-ms", "50", endpoint=f"tcp://127.0.0.1:{_free_port()}")
        liar = spawn(d.endpoint, "spoof", "--name", "liar", "--claim-pid", str(victim.pid))
        liar.expect("TICK", count=2)
        with Client("infer", workload="inference", endpoint=d.endpoint) as infer:
            infer.acquire(timeout=5)
        liar.expect("REVOKE")
        assert proc_state(victim.pid) != "T" and proc_state(liar.proc.pid) != "T"
        assert "action=revoke verified=False" in d.log()
    finally:
        victim.kill()
        victim.wait()


def test_a_stopped_client_is_continued_when_its_session_is_lost(start_daemon, spawn):
    d = start_daemon("--grace-ms", "50")
    hog = spawn(d.endpoint, "stubborn", "--name", "hog")
    hog.expect("TICK", count=2)
    infer = Client("infer", workload="inference", endpoint=d.endpoint)
    infer.acquire(timeout=5)
    assert_stopped(hog.proc.pid)
    d.stop()  # shutdown continues every process it stopped
    wait_for(lambda: proc_state(hog.proc.pid) != "T", timeout=5)
    assert "step=continue stopped=1" in d.log()
    infer.close()


def test_a_restarted_daemon_continues_what_a_killed_one_left_stopped(start_daemon, spawn):
    d = start_daemon("--grace-ms", "50")
    hog = spawn(d.endpoint, "stubborn", "--name", "hog")
    hog.expect("TICK", count=2)
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as infer:
        infer.acquire(timeout=5)
        assert_stopped(hog.proc.pid)
        d.kill()  # SIGKILL: no chance to continue anyone
    assert_stopped(hog.proc.pid)
    start_daemon("--grace-ms", "50")
    wait_for(lambda: proc_state(hog.proc.pid) != "T", timeout=5)


# ------------------------------------------------------------------- memory

def test_memory_admission_refuses_over_commit_naming_what_is_free(start_inproc_daemon):
    d = start_inproc_daemon("--cpu-devices", "2")
    capacity_mb = d.status().devices[0].memory_capacity_mb
    big = int(capacity_mb * 0.6)
    with Client("a", memory_mb=big, endpoint=d.endpoint) as a, Client("b", memory_mb=big, endpoint=d.endpoint) as b:
        assert {a.device, b.device} == {0, 1}  # the second does not fit beside the first
        with pytest.raises(DaemonError) as info:
            Client("c", memory_mb=big, endpoint=d.endpoint)
        assert info.value.code == ErrorCode.NO_MEMORY
        assert f"this session declares {big} MiB" in str(info.value)
        assert f"{capacity_mb - big} MiB free" in str(info.value)
        with pytest.raises(DaemonError) as info:
            Client("d", memory_mb=big, device=0, endpoint=d.endpoint)
        assert info.value.code == ErrorCode.NO_MEMORY
        assert sum(len(dev.sessions) for dev in d.status().devices) == 2  # nothing was registered
    with Client("c", memory_mb=big, endpoint=d.endpoint):  # fits once the others left
        pass


class _MeteredBackend(CpuBackend):
    """The cpu backend, but with per-process device memory scripted by the test
    (what NVML reports on cuda)."""

    measures_process_memory = True

    def __init__(self) -> None:
        super().__init__(1)
        self.used_bytes: dict[int, int] = {}

    def processes(self, index: int) -> list[DeviceProcess]:
        return [DeviceProcess(pid=pid, used_memory_bytes=used) for pid, used in self.used_bytes.items()]


@pytest.fixture
def inproc_server(workdir):
    servers = []

    def start(**settings) -> tuple[AgentServer, _MeteredBackend]:
        config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/mem.sock", state_dir=workdir,
                             memory_watch_ms=20, **settings)
        backend = _MeteredBackend()
        server = AgentServer(config, backend, metrics=Metrics(CollectorRegistry()))
        server.bind()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return server, backend

    yield start
    for server, thread in servers:
        server.request_stop()
        thread.join(timeout=10)


@pytest.mark.parametrize("policy, keeps_token", [("warn", True), ("revoke", False)])
def test_memory_over_declaration_is_flagged_and_policed(inproc_server, policy, keeps_token):
    server, backend = inproc_server(memory_policy=policy)
    with Client("greedy", memory_mb=100, endpoint=server.config.endpoint) as client:
        client.acquire(timeout=5)
        backend.used_bytes[os.getpid()] = 250 * MiB
        registry = server.metrics.registry
        labels = {"device": "0", "policy": policy}
        wait_for(lambda: registry.get_sample_value("nodeagent_memory_violations_total", labels) == 1)
        time.sleep(0.1)  # a revoke notice, if any, is on its way
        assert client.holding is keeps_token
        assert registry.get_sample_value("nodeagent_device_memory_bytes",
                                         {"device": "0", "workload": "training"}) == 250 * MiB
        # Flagged once per episode, not at every reading.
        time.sleep(0.1)
        assert registry.get_sample_value("nodeagent_memory_violations_total", labels) == 1


def test_a_launched_process_group_is_stopped_by_the_daemon_but_continued_only_by_its_launcher():
    import signal
    from types import SimpleNamespace

    from nodeagent import enforce

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    pidfd = os.pidfd_open(child.pid)
    s = SimpleNamespace(id="s-1", managed_cgroup=None, managed_pidfd=pidfd, managed_pgid=child.pid, pidfd=None,
                        pid=child.pid)
    try:
        assert enforce.send(s, signal.SIGSTOP)
        wait_for(lambda: proc_state(child.pid) == "T")
        assert enforce.send(s, signal.SIGCONT)  # one stop for two holders: a SIGCONT would undo the launcher's
        time.sleep(0.1)
        assert proc_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
        os.close(pidfd)
