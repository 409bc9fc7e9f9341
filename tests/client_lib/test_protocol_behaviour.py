"""What docs/protocol.md promises a client that writes the wire by hand (issue 14):
errors name the request whenever its id can be read, a wrong key on a live session
is not called a missing session, a token request made while suspended is kept for
the resume, and a session dropped for silence is told so."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

import msgspec
import pytest

from client_lib import protocol as p
from tests.conftest import wait_for
from tests.inproc import InprocDaemon
from tests.rawpeer import RawPeer
from tests.conftest import free_port as _free_port

enc = msgspec.msgpack.encode


@pytest.fixture(scope="module")
def shared_daemon():
    """One daemon, in this process, for the tests that open no session it would keep."""
    workdir = tempfile.mkdtemp(prefix="na-")
    d = InprocDaemon(workdir, []).start()
    try:
        yield d
        code = d.stop()
        assert code == 0, f"in-process daemon failed: {d.failure!r}\n{d.log()}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _deep(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


# ------------------------------------------------------------- error ids


@pytest.mark.parametrize("body", [
    enc({"op": "status", "id": 7}) + b"\x01",                                    # trailing bytes
    enc({"op": "status", "id": 7}) * 2,                                          # two maps in one frame
    enc({"op": "release", "id": 7, "grant": 5})[:-1],                            # cut short
    b"\x83\xa2op\xa7acquire\xa2id\x07\xa5quiet\xc1",                             # a never-used byte later on
    b"\x85\xa2op\xa5hello\xa2id\x07\xa8protocol\x92\x02\x00\xa3pid\x01\xa4name\xa2\xff\xfe",  # name not UTF-8
    enc({"op": "status", "id": 7, "x": _deep(p.MAX_NESTING_DEPTH + 1)}),         # nested too deep
    enc({"op": "status", "x": _deep(p.MAX_NESTING_DEPTH + 1), "id": 7}),         # ... with the id after it
    # An op of 0xC1 (a byte MessagePack never uses) is a validation error to msgspec's typed decoder,
    # and the loose decode of the id salvage fails on it: the id is read by walking the map's keys.
    b"\x82\xa2id\x07\xa2op\xc1",                                                  # the id, then such an op
    b"\x82\xa2op\xc1\xa2id\x07",                                                  # the op first
    b"\x83\xa2op\xc1\xa2id\x07\xa5quiet\xc3",                                     # ... and a field after the id
], ids=["trailing", "two-maps", "cut-short", "bad-byte", "bad-utf8", "too-deep", "too-deep-id-last",
        "id-then-bad-op", "bad-op-then-id", "bad-op-id-field"])
def test_an_error_echoes_the_request_id_whenever_it_can_be_read(shared_daemon, body):
    peer = RawPeer(shared_daemon.endpoint)
    try:
        peer.send(body)
        reply = peer.recv()
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.BAD_REQUEST, reply
        assert reply.id == 7, reply
        assert isinstance(peer.call(p.StatusRequest(id=8)), p.StatusReply)  # the connection serves on
    finally:
        peer.close()


@pytest.mark.parametrize("body", [
    enc([1, 2, 3]),                               # not a map
    enc({"op": "status", "id": -4}),              # an id out of range
    enc({"op": "status", "id": "7"}),             # an id that is not an integer
    b"\xc1",                                      # not MessagePack
])
def test_an_error_carries_id_0_when_the_id_cannot_be_read(shared_daemon, body):
    peer = RawPeer(shared_daemon.endpoint)
    try:
        peer.send(body)
        reply = peer.recv()
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.BAD_REQUEST and reply.id == 0, reply
    finally:
        peer.close()


# ------------------------------------------------------------- heartbeat keys


def test_a_heartbeat_with_a_wrong_key_on_a_live_session_is_forbidden_not_no_session(shared_daemon):
    owner = RawPeer(shared_daemon.endpoint)
    other = RawPeer(shared_daemon.endpoint)
    try:
        welcome = owner.hello("owner")
        wrong = other.call(p.Heartbeat(id=11, session=welcome.session, key="guess"))
        assert isinstance(wrong, p.Error) and wrong.code == p.ErrorCode.FORBIDDEN, wrong
        assert "alive" in wrong.message and wrong.id == 11
        gone = other.call(p.Heartbeat(id=12, session="s-000000000000", key=welcome.key))
        assert isinstance(gone, p.Error) and gone.code == p.ErrorCode.NO_SESSION, gone
        # The wrong key changed nothing: the session lives, and its key still works.
        assert isinstance(other.call(p.Heartbeat(id=13, session=welcome.session, key=welcome.key)), p.HeartbeatAck)
        assert welcome.session in {s.id for s in shared_daemon.status().devices[0].sessions}
    finally:
        owner.close()
        other.close()


# ------------------------------------------------------------- suspension


def _suspend(operator: RawPeer, target: RawPeer, session: str) -> None:
    """Suspend ``target`` the way a client does: notice, then ``suspended``; the operator hears the result."""
    operator.send(p.SuspendSession(id=operator.take_id(), session=session, deadline_ms=5000))
    target.next_notice(p.SuspendNotice)
    target.send(p.Suspended(id=target.take_id(), bytes_parked=0, suspend_ms=0.0))
    result = operator.recv()
    assert isinstance(result, p.SuspendResult) and result.outcome == "suspended", result


def _no_grant_within(peer: RawPeer, seconds: float) -> None:
    """No grant came (the ones a ``call`` put aside included) and none comes within ``seconds``."""
    assert not [n for n in peer.notices if isinstance(n, p.Grant)], peer.notices
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = peer.recv(left)
        except TimeoutError:
            return
        assert not isinstance(msg, p.Grant), f"granted while it should not be: {msg}"
        peer.notices.append(msg)


def test_an_acquire_sent_while_suspended_is_granted_at_resume(inproc_daemon):
    peer, operator = RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint)
    try:
        welcome = peer.hello("parked")
        _suspend(operator, peer, welcome.session)
        assert isinstance(peer.call(p.Acquire(id=peer.take_id())), p.Ok)
        _no_grant_within(peer, 0.3)  # the device is free, but a suspended session is not given it
        assert isinstance(operator.call(p.ResumeSession(id=operator.take_id(), session=welcome.session)), p.Ok)
        peer.next_notice(p.ResumeNotice)
        grant = peer.next_notice(p.Grant, timeout=2)  # no second acquire was sent
        assert grant.device == welcome.device
        assert [n for n in peer.notices if isinstance(n, p.Grant)] == []
    finally:
        peer.close()
        operator.close()


def test_a_session_waiting_when_suspended_is_queued_again_at_resume(inproc_daemon):
    holder, waiter, operator = RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint)
    try:
        holder.hello("holder")
        holder.call(p.Acquire(id=holder.take_id()))
        grant = holder.next_notice(p.Grant)
        welcome = waiter.hello("waiter")
        waiter.call(p.Acquire(id=waiter.take_id()))
        _suspend(operator, waiter, welcome.session)
        holder.call(p.Release(id=holder.take_id(), grant=grant.grant))
        _no_grant_within(waiter, 0.3)
        operator.call(p.ResumeSession(id=operator.take_id(), session=welcome.session))
        waiter.next_notice(p.Grant, timeout=2)
    finally:
        for peer in (holder, waiter, operator):
            peer.close()


def test_a_release_with_requeue_while_suspending_is_kept_for_the_resume(inproc_daemon):
    holder, other, operator = RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint)
    try:
        welcome = holder.hello("holder")
        holder.call(p.Acquire(id=holder.take_id()))
        grant = holder.next_notice(p.Grant)
        operator.send(p.SuspendSession(id=operator.take_id(), session=welcome.session, deadline_ms=5000))
        holder.next_notice(p.SuspendNotice)
        holder.call(p.Release(id=holder.take_id(), grant=grant.grant, requeue=True))
        _no_grant_within(holder, 0.3)  # not queued while suspending: the device is the others' now
        other.hello("other")
        other.call(p.Acquire(id=other.take_id()))
        other_grant = other.next_notice(p.Grant, timeout=2)
        holder.send(p.Suspended(id=holder.take_id(), bytes_parked=0, suspend_ms=0.0))
        assert operator.recv().outcome == "suspended"
        operator.call(p.ResumeSession(id=operator.take_id(), session=welcome.session))
        other.call(p.Release(id=other.take_id(), grant=other_grant.grant))
        holder.next_notice(p.Grant, timeout=2)
    finally:
        for peer in (holder, other, operator):
            peer.close()


def test_an_acquire_from_a_holder_while_suspending_is_the_no_op_it_always_is(inproc_daemon):
    # It holds the token: its acquire asks for nothing, so its release leaves nothing to keep.
    holder, operator = RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint)
    try:
        welcome = holder.hello("holder")
        holder.call(p.Acquire(id=holder.take_id()))
        grant = holder.next_notice(p.Grant)
        operator.send(p.SuspendSession(id=operator.take_id(), session=welcome.session, deadline_ms=5000))
        holder.next_notice(p.SuspendNotice)
        holder.call(p.Acquire(id=holder.take_id()))
        holder.call(p.Release(id=holder.take_id(), grant=grant.grant))
        holder.send(p.Suspended(id=holder.take_id(), bytes_parked=0, suspend_ms=0.0))
        assert operator.recv().outcome == "suspended"
        operator.call(p.ResumeSession(id=operator.take_id(), session=welcome.session))
        holder.next_notice(p.ResumeNotice)
        _no_grant_within(holder, 0.3)
    finally:
        holder.close()
        operator.close()


def test_a_cancel_while_suspended_withdraws_the_kept_request(inproc_daemon):
    peer, operator = RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint)
    try:
        welcome = peer.hello("changed-its-mind")
        _suspend(operator, peer, welcome.session)
        peer.call(p.Acquire(id=peer.take_id()))
        assert isinstance(peer.call(p.Cancel(id=peer.take_id())), p.Ok)
        operator.call(p.ResumeSession(id=operator.take_id(), session=welcome.session))
        peer.next_notice(p.ResumeNotice)
        _no_grant_within(peer, 0.3)
        (row,) = inproc_daemon.status().devices[0].sessions
        assert row.state == "idle"
    finally:
        peer.close()
        operator.close()


# ------------------------------------------------------------- liveness



def test_a_session_dropped_for_missed_heartbeats_is_told(start_inproc_daemon):
    # Over TCP the daemon cannot watch the peer's process: the peer must send heartbeats.
    d = start_inproc_daemon("--heartbeat-ms", "100", endpoint=f"tcp://127.0.0.1:{_free_port()}")
    peer = RawPeer(d.endpoint)
    try:
        welcome = peer.hello("silent")
        assert welcome.heartbeat_ms == 100
        notice = peer.recv(timeout=3)  # 3 missed intervals of 100 ms, then the notice
        assert isinstance(notice, p.Error) and notice.code == p.ErrorCode.NO_SESSION and notice.id == 0, notice
        assert welcome.session in notice.message and "heartbeat" in notice.message
        wait_for(lambda: not d.status().devices[0].sessions)
        # The connection stays usable: a new session may be opened on it.
        assert peer.hello("again").session != welcome.session
    finally:
        peer.close()


# ------------------------------------------------------------- versions


def _raw_frames_until(peer: RawPeer, done, timeout: float = 5.0) -> list[dict]:
    """Decoded maps of every frame from the daemon until ``done(maps)`` holds."""
    maps: list[dict] = []
    deadline = time.monotonic() + timeout
    while not done(maps):
        assert time.monotonic() < deadline, f"the daemon sent only {maps}"
        maps += [msgspec.msgpack.decode(f) for f in peer.recv_frames(0.05)]
    return maps


def test_a_2_6_client_that_asks_for_one_hop_is_served_on_the_one_path(inproc_daemon):
    """2.7 dropped one-hop handoffs. A 2.1-2.6 client that asks (hello.one_hop, release.handed)
    is served as one the daemon gave no wake channel always was: no ``wake`` in its welcome, so
    it never hears of a successor, never writes a FIFO and takes every grant from the daemon.
    Its ``standby_ack`` (sent only to answer a withdrawal that never comes) is a bad request."""
    a, b = RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint)
    try:
        sessions = []
        for peer, name in ((a, "old-a"), (b, "old-b")):
            peer.send(enc({"op": "hello", "id": 1, "protocol": [2, 6], "name": name, "pid": os.getpid(),
                           "one_hop": True}))
            [welcome] = _raw_frames_until(peer, lambda m: m)
            assert welcome["op"] == "welcome" and "wake" not in welcome, welcome
            sessions.append(welcome["session"])
        a.send(enc({"op": "acquire", "id": 2}))
        grant_a = next(m for m in _raw_frames_until(a, lambda m: any(x["op"] == "grant" for x in m))
                       if m["op"] == "grant")["grant"]
        b.send(enc({"op": "acquire", "id": 2}))
        assert _raw_frames_until(b, lambda m: m) == [{"op": "ok", "id": 2}]
        a.send(enc({"op": "release", "id": 3, "grant": grant_a, "handed": grant_a + 1}))  # it claims it woke b
        to_b = _raw_frames_until(b, lambda m: any(x["op"] == "grant" for x in m))
        to_a = _raw_frames_until(a, lambda m: any(x.get("id") == 3 for x in m))
        assert [m["op"] for m in to_a] == ["ok"] and [m["op"] for m in to_b] == ["grant"], (to_a, to_b)
        assert inproc_daemon.status().devices[0].holder == sessions[1]
        b.send(enc({"op": "standby_ack", "id": 4, "grant": 1, "woken": True}))
        [error] = _raw_frames_until(b, lambda m: m)
        assert error["op"] == "error" and error["code"] == p.ErrorCode.BAD_REQUEST and error["id"] == 4, error
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("minor, told", [(2, False), (p.PROTOCOL_VERSION[1], True)])
def test_a_resumed_suspended_session_is_told_so_only_if_its_minor_knows_the_field(inproc_daemon, minor, told):
    """welcome.suspended is 2.3's: a 2.2 client would not stay parked on it, so it is left unset
    for one, and set for a client of this minor (the same session, resumed over a new connection)."""
    peer, operator = RawPeer(inproc_daemon.endpoint), RawPeer(inproc_daemon.endpoint)
    again = None
    try:
        welcome = peer.hello("parked", protocol=(2, minor))
        _suspend(operator, peer, welcome.session)
        again = RawPeer(inproc_daemon.endpoint)
        resumed = again.hello("parked", protocol=(2, minor), resume_session=welcome.session,
                              resume_key=welcome.key)
        assert resumed.resumed and resumed.session == welcome.session
        assert resumed.suspended is told
    finally:
        for each in (peer, operator, again):
            if each is not None:
                each.close()


def test_a_resumed_session_that_is_not_suspended_is_told_it_is_not(inproc_daemon):
    """welcome.suspended says what the suspension component holds for the session, not only
    that it resumed: a running session that reconnects is not told to stay parked."""
    peer, again = RawPeer(inproc_daemon.endpoint), None
    try:
        welcome = peer.hello("running")
        again = RawPeer(inproc_daemon.endpoint)
        resumed = again.hello("running", resume_session=welcome.session, resume_key=welcome.key)
        assert resumed.resumed and resumed.session == welcome.session and resumed.suspended is False
    finally:
        for each in (peer, again):
            if each is not None:
                each.close()
