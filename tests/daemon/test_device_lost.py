"""A GPU that NVML reports lost takes no new session and grants nothing until it
answers again (issue 10 follow-up): the holder's revoke passes the token to nobody,
a waiter's request is held and granted once the device is back, a new session asking
for it gets E_DEVICE naming it, automatic placement goes elsewhere, and an infer on it
is refused at once. A real in-process daemon whose NVML answers are scripted
(:class:`tests.scripted_gpus.ScriptedGpus`)."""

from __future__ import annotations

import pytest

from client_lib import Client
from client_lib import protocol as p
from nodeagent.config import ServeConfig
from nodeagent.daemon.gate import LostDevices
from tests.conftest import wait_for
from tests.rawpeer import RawPeer
from tests.scripted_gpus import ScriptedGpus, scripted_daemon


@pytest.fixture
def two_gpus(workdir):
    """An in-process daemon on two scripted GPUs: (server, backend, events, connect), where
    ``connect()`` opens a raw peer to it (closed at the end)."""
    config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/lost.sock", state_dir=workdir,
                         memory_watch_ms=20, ctxpool_enabled="off",
                         heartbeat_ms=5000,  # the raw peers here send no heartbeats
                         enforce="revoke", grace_ms=30_000)  # the holder (this process) is asked to yield, never stopped
    backend = ScriptedGpus(2)
    with scripted_daemon(config, backend) as (server, events, connect):
        yield server, backend, events, connect


def _no_grant_within(peer: RawPeer, seconds: float) -> bool:
    try:
        peer.next_notice(p.Grant, timeout=seconds)
    except TimeoutError:
        return True
    return False


def test_a_lost_device_admits_no_session_and_grants_nothing_until_it_answers_again(two_gpus):
    server, backend, events, connect = two_gpus
    other = connect()
    other.hello("on-1", device=1)
    waiter = connect()
    waiter.hello("waiter", device=0)
    with Client("holder", device=0, endpoint=server.config.endpoint) as holder:
        holder.acquire(timeout=5)
        assert isinstance(waiter.call(p.Acquire(id=waiter.take_id())), p.Ok)  # waits behind the holder
        backend.lost.add(0)
        wait_for(lambda: events.of("health"))
        notice = waiter.next_notice(p.Error)
        assert notice.code == p.ErrorCode.DEVICE and "device 0 has failed" in notice.message
        # Before: the holder's revoke granted the token to the waiter, on a dead GPU.
        assert _no_grant_within(waiter, 0.3)
        assert server.status().devices[0].holder is None

    refused = connect()
    reply = refused.call(p.Hello(id=refused.take_id(), name="late", pid=1, workload="training", device=0,
                                 protocol=p.PROTOCOL_VERSION))
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.DEVICE, reply
    assert "device 0 has failed" in reply.message and "GPU-0" in reply.message
    # Placement: device 0 (one session, the waiter) ties with device 1 and would come first.
    placed = connect()
    assert placed.hello("anywhere").device == 1
    infer = waiter.call(p.Infer(id=waiter.take_id(), model="m", inputs=[p.TensorRef(dtype="float32", shape=[1])]))
    assert isinstance(infer, p.Error) and infer.code == p.ErrorCode.DEVICE, infer

    backend.lost.clear()
    wait_for(lambda: len(events.of("health")) == 2)
    grant = waiter.next_notice(p.Grant)  # its request, held while the device was lost
    assert grant.device == 0
    assert connect().hello("after", device=0).device == 0


def test_lost_devices_hold_requests_in_order_and_forget_cancelled_ones():
    lost = LostDevices()
    assert not lost.hold(0, "s-a", 1.0) and lost.refusal(0) is None
    lost.lose(0, "GPU is lost")
    assert lost.is_lost(0) and "GPU is lost" in lost.refusal(0) and not lost.is_lost(1)
    assert lost.hold(0, "s-b", 2.0) and lost.hold(0, "s-a", 3.0) and lost.hold(0, "s-c", 4.0)
    assert lost.hold(0, "s-b", 9.0)  # asked again: keeps its first place and time
    lost.forget("s-c")
    assert list(lost.back(0).items()) == [("s-b", 2.0), ("s-a", 3.0)]
    assert not lost.is_lost(0) and lost.back(0) == {}
