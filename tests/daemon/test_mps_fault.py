"""A fault under MPS (issue 21): NVML reports an Xid that ends the context it happened in, on a
device whose sessions share an MPS server. NVIDIA's MPS reaches every client of that server with
the fault and takes no new client until they have all exited, so the daemon revokes their tokens
(``mps_fault``), tells each with an ``E_DEVICE`` notice to start again, gives sessions that join
meanwhile a plain context, and puts new sessions on MPS again once the faulted ones have left.
Sessions outside the MPS server lose nothing (NVML does not say which process faulted). A real
in-process daemon on scripted GPUs whose Xid events the test writes, with the MPS stand-in
(``tests/fake_mps_control.py``). The GPU half (a real faulting kernel beside a healthy client,
fault to the next good request) is ``bench.mps_fault`` in ``scripts/gpu-check.sh``."""

from __future__ import annotations

import os
import threading

import pytest

from client_lib import protocol as p
from nodeagent.config import ServeConfig
from nodeagent.devices import DeviceFault
from tests.conftest import wait_for
from tests.scripted_gpus import ScriptedGpus, scripted_daemon
from tests.mps_stand_in import write_fake_control

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the MPS stand-in's directories need root here")


class FaultingGpus(ScriptedGpus):
    """Scripted GPUs whose Xid events the test writes into ``pending``."""

    def __init__(self, count: int = 1) -> None:
        super().__init__(count)
        self.pending: list[DeviceFault] = []
        self.outsiders: list[int] = []  # pids of compute processes outside MPS
        self.compute_listed: dict[int, int] = {}  # pid -> bytes, listed among the compute processes only
        self._lock = threading.Lock()

    def processes(self, index: int):
        from nodeagent.devices import DeviceProcess
        return super().processes(index) + [DeviceProcess(pid, None, mps_client=False) for pid in self.outsiders] + \
            [DeviceProcess(pid, used, mps_client=False) for pid, used in self.compute_listed.items()]

    def report(self, device: int, xid: int) -> None:
        with self._lock:
            self.pending.append(DeviceFault(device, xid))

    def faults(self) -> list[DeviceFault]:
        with self._lock:
            taken, self.pending = self.pending, []
        return taken


@pytest.fixture
def mps_gpu(workdir):
    """An in-process daemon on one scripted GPU with MPS: (server, backend, events, connect)."""
    saved = dict(os.environ)
    config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/fault.sock", state_dir=workdir,
                         memory_watch_ms=20, ctxpool_enabled="off", heartbeat_ms=5000, enforce="revoke",
                         grace_ms=30_000, mps_devices=[0], mps_control_binary=write_fake_control(workdir))
    backend = FaultingGpus(1)
    try:
        with scripted_daemon(config, backend) as (server, events, connect):
            yield server, backend, events, connect
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _faults(server, domain: str) -> float:
    return server.metrics.registry.get_sample_value("nodeagent_device_faults_total",
                                                    {"device": "0", "domain": domain})


def test_a_context_fault_on_an_mps_device_ends_every_client_of_its_server_and_tells_each(mps_gpu):
    server, backend, events, connect = mps_gpu
    holder, waiter = connect(), connect()
    holder_welcome = holder.hello("service", workload="inference")
    waiter_welcome = waiter.hello("trainer", workload="training")
    assert holder_welcome.env and waiter_welcome.env  # both on the device's MPS server
    holder.call(p.Acquire(id=holder.take_id()))
    grant = holder.next_notice(p.Grant)
    backend.report(0, 31)  # an illegal address in one client's kernel
    revoke = holder.next_notice(p.Revoke, timeout=5)
    assert revoke.grant == grant.grant and revoke.reason == "mps_fault"
    for peer in (holder, waiter):
        notice = peer.next_notice(p.Error, timeout=5)
        assert notice.id == 0 and notice.code == p.ErrorCode.DEVICE
        assert "MPS server had a fatal fault (Xid 31)" in notice.message and "start it again" in notice.message
    assert _faults(server, "mps") == 1.0
    wait_for(lambda: {"device_state": "fault", "xid": 31, "domain": "mps", "sessions": 2} in events.of("health"),
             timeout=5)
    # Until both have left, a new session gets a plain context: the server takes no new client.
    newcomer = connect()
    assert newcomer.hello("newcomer", workload="training").env == {}
    # A faulted session that reattaches (a new connection of the same process) is not sent back to it either.
    again = connect()
    resumed = again.hello("service", workload="inference", resume_session=holder_welcome.session,
                          resume_key=holder_welcome.key)
    assert resumed.resumed and resumed.env == {}
    again.call(p.Goodbye(id=again.take_id()))
    waiter.call(p.Goodbye(id=waiter.take_id()))
    wait_for(lambda: server._mps.recovering(0) == 0, timeout=5)
    assert connect().hello("after", workload="inference").env  # on MPS again


@pytest.mark.parametrize("listed", ["in the MPS list", "among the compute processes only"])
def test_a_fault_is_acted_on_whichever_nvml_list_shows_the_mps_clients(mps_gpu, listed):
    """Issue 33, defect 5: a driver without the MPS list (or one that shows clients among the compute
    processes) had every client counted as "outside MPS", so no fault under MPS was ever acted on. A
    process one of the device's MPS sessions owns is that server's client, whichever list names it."""
    server, backend, _, connect = mps_gpu
    peer = connect()
    assert peer.hello("service", workload="inference").env  # on the device's MPS server
    peer.call(p.Acquire(id=peer.take_id()))
    grant = peer.next_notice(p.Grant)
    me = os.getpid()  # the raw peer's process: the session's verified pid
    if listed == "in the MPS list":
        backend.used_bytes = {me: 3 << 20}
    else:
        backend.compute_listed = {me: 3 << 20}
    session = next(iter(server._sessions.values()))
    wait_for(lambda: session.memory_used_bytes == 3 << 20, timeout=5)  # a pass with the lists was applied
    backend.report(0, 31)
    revoke = peer.next_notice(p.Revoke, timeout=5)
    assert revoke.grant == grant.grant and revoke.reason == "mps_fault"
    assert peer.next_notice(p.Error, timeout=5).code == p.ErrorCode.DEVICE
    assert _faults(server, "mps") == 1.0


def test_a_fault_with_a_process_outside_mps_on_the_device_takes_nothing_from_its_clients(mps_gpu):
    """NVML does not say which process faulted: with a context outside MPS on the device (another
    user's, or a process no session owns), the fault may be that one's, so the MPS clients keep theirs."""
    server, backend, _, connect = mps_gpu
    peer = connect()
    peer.hello("service", workload="inference")
    peer.call(p.Acquire(id=peer.take_id()))
    peer.next_notice(p.Grant)
    backend.outsiders = [4_000_000]  # seen in the pass before the fault; gone (exited) by the fault
    wait_for(lambda: server._memory_policy is not None and _seen_outside(server), timeout=5)
    backend.outsiders = []
    backend.report(0, 31)
    wait_for(lambda: _faults(server, "context") == 1.0, timeout=5)
    with pytest.raises(TimeoutError):
        peer.next_notice(p.Revoke, timeout=0.3)
    assert server._mps.recovering(0) == 0


def _seen_outside(server) -> bool:
    watcher = server._memory_policy._watcher
    return watcher is not None and bool(watcher._outside.get(0))


def test_a_fault_outside_mps_or_not_of_a_context_takes_nothing_from_anyone(mps_gpu):
    server, backend, _, connect = mps_gpu
    peer = connect()
    peer.hello("service", workload="inference")
    peer.call(p.Acquire(id=peer.take_id()))
    peer.next_notice(p.Grant)
    backend.report(0, 79)  # not a context's fault (the GPU fell off the bus shows as a lost device)
    wait_for(lambda: _faults(server, "other") == 1.0, timeout=5)
    assert not any(isinstance(n, (p.Revoke, p.Error)) for n in peer.notices)
    with pytest.raises(TimeoutError):
        peer.next_notice(p.Revoke, timeout=0.3)
    assert server._mps.recovering(0) == 0
