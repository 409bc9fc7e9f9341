"""Hostile input that stays in the suite: nesting bombs and a seeded fuzzer on
both endpoints of a real daemon. Each test checks that the daemon answers, keeps
its state and keeps its memory flat; none may stop it.

The fuzzer's counts are printed (run with ``-s``) for the record.
"""

from __future__ import annotations

import os
import random
import threading
import typing

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from client_lib import Client, DaemonError, codec, framing, resume_session
from client_lib import protocol as p
from nodeagent.config import ServeConfig
from nodeagent.devices import CpuBackend
from nodeagent.metrics import Metrics
from nodeagent.daemon.server import AgentServer
from tests.conftest import wait_for
from tests.rawpeer import RawPeer
from tests.proc_tools import assert_stopped, proc_state, rss_kb

DEPTHS = (1_000, 10_000, 100_000)


def nested_array(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]], ``depth`` arrays


def nested_map(depth: int) -> bytes:
    return b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ... nil}}, ``depth`` maps


def state_of(status: p.StatusReply) -> list:
    """What of a status must not change under bad input: sessions, holders, queues."""
    return [(d.index, d.holder, list(d.queue), sorted((s.id, s.state) for s in d.sessions))
            for d in status.devices]


# ------------------------------------------------------------------ codec


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("make", [nested_array, nested_map])
def test_codec_refuses_deep_frames_before_decoding(make, depth):
    frame = make(depth)
    with pytest.raises(codec.BadFrame, match="deeper than"):
        codec.decode_request(frame, max_bytes=len(frame))  # the depth bound, not the size bound, refuses
    with pytest.raises(codec.BadFrame):  # the client relies on msgspec's recursion guard, caught
        codec.decode_reply(frame)


def test_codec_depth_bound_leaves_real_requests_alone():
    # A request at the bound decodes; a frame one deeper does not.
    inner = p.TensorRef(dtype="float32", shape=[1, 2], shm="na-x", nbytes=8)
    msg = p.Infer(id=9, model="m", inputs=[inner])
    assert codec.decode_request(codec.encode(msg)) == msg
    assert not codec.nesting_depth_exceeds(nested_array(p.MAX_NESTING_DEPTH), p.MAX_NESTING_DEPTH)
    assert codec.nesting_depth_exceeds(nested_array(p.MAX_NESTING_DEPTH + 1), p.MAX_NESTING_DEPTH)
    # Strings full of bytes that look like container headers (UTF-8 continuation bytes) are not nesting.
    name = "模型" * 64  # 128 characters (the most a name may have), 384 bytes, 128 of them like openers
    hello = p.Hello(id=1, name=name, pid=1, workload="training", protocol=p.PROTOCOL_VERSION)
    assert codec.decode_request(codec.encode(hello)).name == name


def _depth(obj) -> int:
    if isinstance(obj, list):
        return 1 + max((_depth(x) for x in obj), default=0)
    if isinstance(obj, dict):
        return 1 + max((_depth(v) for v in obj.values()), default=0)
    return 0


_json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.binary(max_size=300),
    lambda children: st.lists(children, max_size=20) | st.dictionaries(st.text(max_size=8), children, max_size=20),
    max_leaves=60)


@settings(max_examples=120, deadline=None)
@given(obj=_json_like, limit=st.integers(0, 8))
def test_depth_scan_agrees_with_the_structure(obj, limit):
    frame = msgspec.msgpack.encode(obj)
    assert codec.nesting_depth_exceeds(frame, limit) == (_depth(obj) > limit)


# ------------------------------------------------------------- the daemon


def _ok_error(reply) -> str:
    assert isinstance(reply, p.Error), reply
    return reply.code


@pytest.mark.parametrize("make", [nested_array, nested_map])
def test_deep_frames_do_not_stop_the_daemon(daemon, make):
    peer = RawPeer(daemon.endpoint)
    try:
        for depth in DEPTHS:
            peer.send(make(depth))  # 100k levels is over the request size: refused for that, unread
            assert _ok_error(peer.recv()) == p.ErrorCode.BAD_REQUEST
        assert daemon.proc.poll() is None
        assert daemon.status().devices
    finally:
        peer.close()


@pytest.mark.parametrize("make", [nested_array, nested_map])
def test_deep_frames_do_not_stop_the_cluster_endpoint(cluster_node, make):
    node = cluster_node()
    peer = node.peer()
    try:
        assert isinstance(peer.call(p.Inventory(id=0)), p.InventoryReply)  # connected, handshake done
        for depth in DEPTHS:
            peer.sock.send(make(depth))
            assert peer.sock.poll(5000), "no answer to a deep frame"
            assert _ok_error(codec.decode_reply(peer.sock.recv())) == p.ErrorCode.BAD_REQUEST
        assert isinstance(peer.call(p.Inventory(id=0)), p.InventoryReply)
        assert node.daemon.proc.poll() is None
    finally:
        peer.close()


# ------------------------------------------------------------------ fuzzer

_OPS = [typing.get_args(p.ClientMessage)[i].__struct_config__.tag for i in range(len(typing.get_args(p.ClientMessage)))]
_FIELDS = sorted({f for t in typing.get_args(p.ClientMessage) for f in t.__struct_fields__} | {"op", "id"})


class Fuzzer:
    """Seeded frames of every kind of wrongness; ``kinds`` counts what was made."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.kinds: dict[str, int] = {}

    def value(self, depth: int = 0):
        r = self.rng
        pick = r.randrange(12 if depth < 4 else 8)
        if pick == 0:
            return None
        if pick == 1:
            return r.choice([True, False])
        if pick == 2:
            return r.choice([0, -1, 1, 2**31, 2**63 - 1, -2**63, 2**64 - 1, r.randrange(-1000, 1000)])
        if pick == 3:
            return r.choice([0.0, -0.0, 1e308, float("inf"), float("-inf"), r.random()])
        if pick == 4:
            return r.choice(_OPS + _FIELDS + ["", "../../etc/shadow", "/dev/shm/x", "\x00", "é" * 50])
        if pick == 5:
            return r.randbytes(r.randrange(0, 64))
        if pick == 6:
            return r.choice(list(p.PROTOCOL_VERSION) + [99])
        if pick == 7:
            return "x" * r.randrange(0, 300)
        if pick in (8, 9):
            return [self.value(depth + 1) for _ in range(r.randrange(0, 6))]
        return {r.choice(_FIELDS): self.value(depth + 1) for _ in range(r.randrange(0, 8))}

    def frame(self) -> tuple[str, list[bytes]]:
        r = self.rng
        kind = r.choices(["random", "shaped", "mutated", "deep", "huge_len", "multipart", "version",
                          "oversize"], weights=[20, 30, 25, 3, 8, 4, 6, 1])[0]
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if kind == "random":
            return kind, [r.randbytes(r.randrange(0, 512))]
        if kind == "shaped":  # a map with a real op and fields of the wrong shapes
            body = {"op": r.choice(_OPS), "id": r.choice([r.randrange(1, 2**31), -5, "7", None, 2**64 - 1])}
            body.update({r.choice(_FIELDS): self.value() for _ in range(r.randrange(0, 6))})
            return kind, [msgspec.msgpack.encode(body)]
        if kind == "mutated":  # a valid request with bytes flipped, cut or appended
            op = r.choice(_MUTABLE)
            frame = bytearray(codec.encode(op))
            for _ in range(r.randrange(1, 4)):
                action = r.randrange(3)
                if action == 0 and frame:
                    frame[r.randrange(len(frame))] = r.randrange(256)
                elif action == 1 and frame:
                    del frame[r.randrange(len(frame)):]
                else:
                    frame += r.randbytes(r.randrange(1, 8))
            return kind, [bytes(frame)]
        if kind == "deep":
            depth = r.choice([p.MAX_NESTING_DEPTH + 1, 200, 1_000, 20_000])
            return kind, [r.choice([nested_array, nested_map])(depth)]
        if kind == "huge_len":  # headers declaring far more than follows
            header = r.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                               b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff"])
            prefix = r.choice([b"", b"\x82\xa2op\xa5hello\xa2id"])
            return kind, [prefix + header + r.randbytes(r.randrange(0, 32))]
        if kind == "multipart":
            return kind, [codec.encode(p.StatusRequest(id=1))] * r.randrange(2, 5)
        if kind == "version":  # a hello from a client of another major, or a malformed version
            version = r.choice([[99, 0], [0, 0], [-1, 1], [2**63 - 1, 0], [1], [], [1, 2, 3], "1.1"])
            body = {"op": "hello", "id": 3, "name": "v", "pid": 1, "workload": "training", "protocol": version}
            return kind, [msgspec.msgpack.encode(body)]
        return kind, [b"\x82\xa2op\xa6status\xa2id\x01" + b"\x00" * (p.MAX_REQUEST_BYTES + 1)]


# Valid requests to mutate: every op a local peer can send (none is a hello: the
# sessionless fuzzer must not open sessions; a mutated one that still decodes as a
# well-formed hello is skipped below).
_MUTABLE = [
    p.Heartbeat(id=4, session="s1", key="k"), p.Acquire(id=5), p.Release(id=6, grant=1), p.Cancel(id=7),
    p.StatusRequest(id=8), p.SuspendSession(id=10, session="s1", deadline_ms=10), p.ResumeSession(id=11, session="s1"),
    p.Partition(id=12, device=0, shares={"s1": 50.0}), p.Suspended(id=13, bytes_parked=1, suspend_ms=1.0),
    p.Resumed(id=14, resume_ms=1.0), p.ModelsRequest(id=15), p.UnregisterModel(id=16, name="m"), p.RegisterModel(id=23, name="m", factory="os:abort"),
    p.Infer(id=17, model="m", inputs=[p.TensorRef(dtype="float32", shape=[2], shm="na-nope", nbytes=8)]),
    p.Inventory(id=18), p.Lend(id=19, device=0, borrower="b"), p.Reclaim(id=20, device=0),
    p.Drain(id=21, device=0), p.SetPolicy(id=22, device=0, grace_ms=5.0),
]


def _opens_a_session(frame: bytes) -> bool:
    try:
        msg = codec.decode_request(frame)
    except codec.BadFrame:
        return False
    return isinstance(msg, p.Hello) and tuple(msg.protocol[:1]) == p.PROTOCOL_VERSION[:1]


def _fuzz(send, recv_all, fuzzer: Fuzzer, frames: int) -> tuple[int, int]:
    """Send ``frames`` frames (skipping any that would open a session); returns (sent, answered)."""
    sent = answered = 0
    while sent < frames:
        kind, parts = fuzzer.frame()
        if len(parts) == 1 and _opens_a_session(parts[0]):
            continue
        send(parts)
        sent += 1
        if sent % 50 == 0:
            answered += recv_all()
    return sent, answered + recv_all(final=True)


def _drain(sock: zmq.Socket):
    """recv_all for a CURVE DEALER: count what arrived, waiting for stragglers at the end."""
    def recv_all(final: bool = False) -> int:
        n = 0
        while sock.poll(500 if final else 0):
            sock.recv()
            n += 1
        return n
    return recv_all


def _drain_local(peer: RawPeer):
    """recv_all for a local connection: count the frames that arrived."""
    def recv_all(final: bool = False) -> int:
        n = 0
        while True:
            frames = peer.recv_frames(0.5 if final else 0)
            if not frames:
                return n
            n += len(frames)
    return recv_all


def _send_local(peer: RawPeer):
    """Each part as its own frame; a "multipart" message arrives split at odd byte
    boundaries, as a stream may deliver it."""
    def send(parts: list[bytes]) -> None:
        if len(parts) == 1:
            peer.send(parts[0])
            return
        stream = b"".join(framing.pack(part) for part in parts)
        for cut in range(0, len(stream), 7):
            peer.send_raw(stream[cut:cut + 7])
    return send


@pytest.mark.slow
def test_fuzzer_on_the_local_endpoint(daemon):
    bystander = Client("bystander", workload="training", endpoint=daemon.endpoint, reconnect=False)
    with bystander.slice():
        pass
    pid = daemon.proc.pid
    before = state_of(daemon.status())
    peer = RawPeer(daemon.endpoint)
    fuzzer = Fuzzer(seed=20261122)
    try:
        # Warm up the daemon's allocator and code paths, then measure from there.
        _fuzz(_send_local(peer), _drain_local(peer), fuzzer, 300)
        rss_before = rss_kb(pid)
        sent, answered = _fuzz(_send_local(peer), _drain_local(peer), fuzzer, 4000)
        rss_after = rss_kb(pid)
    finally:
        peer.close()
    print(f"\n[fuzz local] frames_sent={sent} answered={answered} kinds={fuzzer.kinds} "
          f"rss_kb_before={rss_before} rss_kb_after={rss_after}")
    assert daemon.proc.poll() is None, daemon.log()
    assert answered >= sent * 0.95, (sent, answered)  # only quiet releases/acquires may go unanswered
    assert state_of(daemon.status()) == before
    assert rss_after - rss_before < 8 * 1024, (rss_before, rss_after)
    with bystander.slice():  # the daemon still serves its real clients
        pass
    bystander.close()


@pytest.mark.slow
def test_fuzzer_inside_a_session(daemon):
    """Garbage from a peer that has a session reaches the handlers' deeper paths."""
    peer = RawPeer(daemon.endpoint)
    other = Client("other", workload="training", endpoint=daemon.endpoint, reconnect=False)
    fuzzer = Fuzzer(seed=7)
    try:
        peer.hello(name="fuzzed")
        sent, answered = _fuzz(_send_local(peer), _drain_local(peer), fuzzer, 1500)
        print(f"\n[fuzz session] frames_sent={sent} answered={answered}")
        assert daemon.proc.poll() is None, daemon.log()
        assert answered >= sent * 0.9
        peer.send(p.Goodbye(id=peer.take_id()))
        with other.slice(timeout=5):  # whatever the fuzzed session held, it is free again
            pass
    finally:
        peer.close()
        other.close()
    assert all(s.name != "fuzzed" for d in daemon.status().devices for s in d.sessions)


@pytest.mark.slow
def test_fuzzer_on_the_cluster_endpoint(cluster_node):
    node = cluster_node()
    pid = node.daemon.proc.pid
    peer = node.peer()
    assert isinstance(peer.call(p.Inventory(id=0)), p.InventoryReply)
    before = state_of(node.daemon.status())
    fuzzer = Fuzzer(seed=11)
    try:
        _fuzz(lambda parts: peer.sock.send_multipart(parts), _drain(peer.sock), fuzzer, 200)
        rss_before = rss_kb(pid)
        sent, answered = _fuzz(lambda parts: peer.sock.send_multipart(parts), _drain(peer.sock), fuzzer, 1500)
        rss_after = rss_kb(pid)
        print(f"\n[fuzz cluster] frames_sent={sent} answered={answered} rss_kb_before={rss_before} "
              f"rss_kb_after={rss_after}")
        assert node.daemon.proc.poll() is None, node.daemon.log()
        assert answered >= sent * 0.95, (sent, answered)
        assert isinstance(peer.call(p.Inventory(id=0)), p.InventoryReply)
        assert rss_after - rss_before < 8 * 1024
    finally:
        peer.close()
    # Fuzzed lends or drains may have changed a device's lifecycle (they are allowed ops),
    # but no session appeared or vanished.
    assert [d[3] for d in state_of(node.daemon.status())] == [d[3] for d in before]


class _Bug(Exception):
    pass


def test_bugs_cost_one_request_or_one_step_not_the_daemon(workdir):
    """Containment beyond the codec: a handler that raises answers E_INTERNAL with the
    request's id; a raising loop step (timers) is counted; the loop serves on."""
    config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/bug.sock", state_dir=workdir)
    server = AgentServer(config, CpuBackend(1), metrics=Metrics(CollectorRegistry()))

    def broken_status(route, msg, frame, now):
        raise _Bug("handler bug")

    real_timers = server._on_timers
    timer_bugs = {"left": 3}

    def flaky_timers(now):
        if timer_bugs["left"] > 0:
            timer_bugs["left"] -= 1
            raise _Bug("timer bug")
        real_timers(now)

    server._handlers[p.StatusRequest] = broken_status
    server._on_timers = flaky_timers
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    peer = RawPeer(config.endpoint)
    try:
        for i in range(20):
            reply = peer.call(p.StatusRequest(id=peer.take_id()))
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.INTERNAL
        with Client("still-served", workload="training", endpoint=config.endpoint, reconnect=False) as client:
            with client.slice(timeout=5):
                pass
        registry = server.metrics.registry
        assert registry.get_sample_value("nodeagent_internal_errors_total", {"where": "timers"}) == 3
        assert thread.is_alive()
    finally:
        peer.close()
        server.request_stop()
        thread.join(timeout=10)


# ------------------------------------------------- memory: lower classes

def test_a_best_effort_declaration_of_all_memory_does_not_keep_inference_out(start_daemon, spawn, workdir):
    """Default config (make_room not set): a best-effort session that declares the
    whole device and never yields is suspended (stopped, being verified) so that
    inference is admitted and runs."""
    with open(f"{workdir}/nodeagent.toml", "w") as f:
        f.write('[memory]\nmake_room_deadline_ms = 500\n')  # make_room left at its default
    d = start_daemon()
    capacity = d.status().devices[0].memory_capacity_mb
    hog = spawn(d.endpoint, "stubborn", "--name", "hog", "--workload", "best-effort",
                "--memory-mb", str(capacity))
    hog.expect("GRANT")
    with Client("infer", workload="inference", memory_mb=capacity // 2, endpoint=d.endpoint,
                reconnect=False) as infer:
        infer.acquire(timeout=10)
        hog_info = next(s for dev in d.status().devices for s in dev.sessions if s.name == "hog")
        assert hog_info.suspended == "stopped"
        assert_stopped(hog.proc.pid)
        infer.release()
    # The lower class keeps its session; it is continued when resumed, not lost.
    resume_session(hog_info.id, endpoint=d.endpoint)
    wait_for(lambda: proc_state(hog.proc.pid) != "T", timeout=5)


def test_class_caps_refuse_a_class_past_its_share(start_daemon, workdir):
    with open(f"{workdir}/nodeagent.toml", "w") as f:
        f.write('[memory.class_cap_percent]\nbest-effort = 50\n')
    d = start_daemon()
    capacity = d.status().devices[0].memory_capacity_mb
    with Client("be-1", workload="best-effort", memory_mb=int(capacity * 0.3), endpoint=d.endpoint,
                reconnect=False):
        with pytest.raises(DaemonError) as info:
            Client("be-2", workload="best-effort", memory_mb=int(capacity * 0.3), endpoint=d.endpoint,
                   reconnect=False)
        assert info.value.code == p.ErrorCode.NO_MEMORY
        assert "memory.class_cap_percent.best-effort" in str(info.value)
        # Other classes are not held to best-effort's cap.
        with Client("train", workload="training", memory_mb=int(capacity * 0.6), endpoint=d.endpoint,
                    reconnect=False):
            pass


@pytest.mark.parametrize("field,value", [("name", "ok\n2026-11-23 00:00:00 INFO forged line"),
                                         ("name", "x\x1b]0;owned\x07"), ("borrower", "job\r")])
def test_names_with_control_characters_are_refused_at_hello(inproc_daemon, field, value):
    """Names reach the daemon's log and other users' terminals (status, top): a newline would
    forge a log line, an escape sequence drive a terminal."""
    daemon = inproc_daemon
    peer = RawPeer(daemon.endpoint)
    fields = {"name": "fine", field: value}
    reply = peer.call(p.Hello(id=1, protocol=p.PROTOCOL_VERSION, pid=os.getpid(), **fields))
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.INVALID, reply
    assert "printable" in reply.message
    assert "forged line" not in daemon.log()
    peer.close()
