"""The wire types and the codec, without a daemon."""

import msgspec
import pytest

from client_lib import codec
from client_lib import protocol as p


def test_every_request_round_trips():
    msgs = [
        p.Hello(id=1, protocol=(1, 0), name="n", pid=42, workload="inference", weight=2.5, device=1,
                memory_mb=512, resume_session="s-1", resume_key="k"),
        p.Heartbeat(id=2, session="s-1", key="k"),
        p.Acquire(id=3), p.Release(id=4, grant=7, requeue=True), p.Cancel(id=5),
        p.StatusRequest(id=6), p.Goodbye(id=7),
    ]
    for msg in msgs:
        assert codec.decode_request(codec.encode(msg)) == msg


def test_every_daemon_message_round_trips():
    msgs = [
        p.Ok(id=1), p.Error(id=2, code=p.ErrorCode.NOT_HOLDER, message="m"),
        p.Welcome(id=3, protocol=(1, 0), session="s", key="k", device=0, backend="cpu", slice_ms=50.0,
                  grace_ms=100.0, heartbeat_ms=1000.0),
        p.Grant(grant=1, device=0, slice_ms=200.0), p.YieldRequest(grant=1, deadline_ms=100.0, reason="quantum"),
        p.Revoke(grant=1, reason="overrun"),
    ]
    for msg in msgs:
        assert codec.decode_reply(codec.encode(msg)) == msg


def test_wire_form_is_a_plain_map_with_op_and_id():
    raw = msgspec.msgpack.decode(codec.encode(p.Release(id=9, grant=3)))
    assert raw == {"op": "release", "id": 9, "grant": 3, "requeue": False, "quiet": False,
                   "waiting": None, "oldest_wait_ms": None}


@pytest.mark.parametrize("frame, rid, fragment", [
    (b"\xc1", 0, "not a MessagePack"),                                  # never-used byte
    (msgspec.msgpack.encode([1, 2, 3]), 0, "invalid request"),          # not a map
    (msgspec.msgpack.encode({"op": "nope", "id": 5}), 5, "invalid request"),   # unknown op, id salvaged
    (msgspec.msgpack.encode({"op": "release", "id": 6}), 6, "grant"),   # missing field named
    (msgspec.msgpack.encode({"op": "release", "id": 7, "grant": "x"}), 7, "grant"),  # wrong type
    (msgspec.msgpack.encode({"op": "hello", "id": 8, "protocol": [1, 0], "name": "n", "pid": 1,
                             "workload": "gaming"}), 8, "workload"),    # not a workload class
    (msgspec.msgpack.encode({"op": "acquire", "id": -3}), 0, "id"),     # negative id
    (b"\x80" * 10, 0, ""),                                              # trailing garbage
    (msgspec.msgpack.encode({"op": "suspended", "id": 9, "bytes_parked": 1, "suspend_ms": 1.0,
                             "host_bytes": -1}), 9, "host_bytes"),      # 2.5: host memory kept, >= 0
    (msgspec.msgpack.encode({"op": "resumed", "id": 10, "resume_ms": 1.0,
                             "host_bytes": 2**53 + 2}), 10, "host_bytes"),  # ... and <= 2^53
])
def test_bad_frames_raise_badframe_with_salvaged_id(frame, rid, fragment):
    with pytest.raises(codec.BadFrame) as info:
        codec.decode_request(frame)
    assert info.value.request_id == rid
    assert fragment in str(info.value)


def test_oversized_frame_is_refused_before_decoding():
    big = codec.encode(p.Hello(id=1, protocol=(1, 0), name="x" * (p.MAX_REQUEST_BYTES + 1), pid=1))
    with pytest.raises(codec.BadFrame, match="exceeds"):
        codec.decode_request(big)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    # A newer minor version may add fields at the end; an older peer must accept them.
    frame = msgspec.msgpack.encode({"op": "acquire", "id": 3, "priority_hint": 7})
    assert codec.decode_request(frame) == p.Acquire(id=3)


def test_an_integer_sent_as_an_integral_float_is_that_integer():
    """JavaScript's MessagePack encoders write every number above 2^32 (a grant id is at
    least 2^32) as a float64: where an integer is wanted, an exact one is taken."""
    grant = (3 << 32) + 17
    frame = msgspec.msgpack.encode({"op": "release", "id": 4.0, "grant": float(grant), "requeue": True})
    msg = codec.decode_request(frame)
    assert msg == p.Release(id=4, grant=grant, requeue=True) and type(msg.grant) is int and type(msg.id) is int
    hello = codec.decode_request(msgspec.msgpack.encode({"op": "hello", "id": 1, "protocol": [2.0, 3.0], "name": "js",
                                                         "pid": 4242.0, "memory_mb": 512.0}))
    assert (hello.protocol, hello.pid, hello.memory_mb) == ((2, 3), 4242, 512)


@pytest.mark.parametrize("value", [5.5, float("nan"), float("inf"), -float("inf"), 2.0 ** 60])
def test_a_float_that_is_no_exact_integer_is_still_refused(value):
    frame = msgspec.msgpack.encode({"op": "release", "id": 9, "grant": value})
    with pytest.raises(codec.BadFrame, match="field 'grant': expected integer") as info:
        codec.decode_request(frame)
    assert info.value.request_id == 9


def test_an_integral_float_outside_the_fields_bounds_is_refused():
    with pytest.raises(codec.BadFrame, match="field 'id'") as info:
        codec.decode_request(msgspec.msgpack.encode({"op": "acquire", "id": -3.0}))
    assert info.value.request_id == 0


class _FakeFrame:
    """Stands in for a zmq.Frame's Peer-Address property (libzmq formats it)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def get(self, name: str) -> str:
        assert name == "Peer-Address"
        return self.address


@pytest.mark.parametrize("address, expected", [
    ("localhost:1000:1000:4242", (1000, 1000, 4242)),  # ipc, SO_PEERCRED, as libzmq 4.3 writes it
    (":1000:1000:4242", (1000, 1000, 4242)),
    ("fe80::1:2", None),
    ("a::1:2", None),
    ("fe80::1:2:3", None),  # IPv6 peers must never read as credentials
    ("::1:0:0:7", None),
    ("127.0.0.1", None),
    (":0:0:0", None),  # no pid
])
def test_peer_credentials_only_from_ipc_addresses(address, expected):
    from nodeagent.procwatch import peer_credentials

    creds = peer_credentials(_FakeFrame(address))
    assert (None if creds is None else (creds.uid, creds.gid, creds.pid)) == expected


class _RewordedDecoder:
    """msgspec's decoder, but its errors say something else: as a future release might word them."""

    def __init__(self, real) -> None:
        self.real = real

    def decode(self, frame):
        try:
            return self.real.decode(frame)
        except msgspec.ValidationError:
            raise msgspec.ValidationError("reworded in a later release") from None
        except msgspec.DecodeError:
            raise msgspec.DecodeError("reworded in a later release") from None


@pytest.mark.parametrize("frame, text", [
    (b"\xa3ab\xff", "the frame is not a MessagePack map: the string at offset 0 is not valid UTF-8"),
    (b"\x92\x01", "the frame is not a MessagePack map: it ends inside a value (cut short)"),
    # a whole string is read past its header, fixstr or str8 (whose length byte is no UTF-8)
    (b"\x92\xa1a", "the frame is not a MessagePack map: it ends inside a value (cut short)"),
    (b"\x92\xd9\xa0" + b"a" * 160, "the frame is not a MessagePack map: it ends inside a value (cut short)"),
    (b"\x92\xd9\x02a\xff", "the frame is not a MessagePack map: the string at offset 1 is not valid UTF-8"),
    (b"\x01\x02", "the frame is not a MessagePack map: more bytes follow its first value, from offset 1"),
    (b"\x91\xc1", "the frame is not a MessagePack map: byte 0xc1 at offset 1 is not MessagePack"),
    (msgspec.msgpack.encode({"op": "release", "id": 3, "grant": "x"}),
     "invalid request: field 'grant': expected integer, got string"),
    (msgspec.msgpack.encode({"op": "hello", "id": 1, "protocol": [1, "x"], "name": "n", "pid": 1}),
     "invalid request: field 'protocol[1]': expected integer, got string"),
    (msgspec.msgpack.encode({"op": "acquire", "id": -3}), "invalid request: field 'id': expected a value >= 0"),
    (msgspec.msgpack.encode({"op": "nope", "id": 5}), "invalid request: unknown op 'nope' (ops: hello, "),
    (msgspec.msgpack.encode({"id": 5}), "invalid request: missing field 'op'"),
])
def test_error_texts_come_from_the_wire_types_not_msgspecs_wording(monkeypatch, frame, text):
    monkeypatch.setattr(codec, "_request_decoder", _RewordedDecoder(codec._request_decoder))
    with pytest.raises(codec.BadFrame) as info:
        codec.decode_request(frame)
    assert str(info.value).startswith(text)
    assert "reworded" not in str(info.value)


@pytest.mark.parametrize("fields, named", [
    ({"waiting": -1}, "waiting"),
    ({"waiting": 2**31}, "waiting"),
    ({"waiting": 1, "oldest_wait_ms": -0.5}, "oldest_wait_ms"),
    ({"waiting": 1, "oldest_wait_ms": float("nan")}, "oldest_wait_ms"),
    ({"waiting": 1, "oldest_wait_ms": 1e12}, "oldest_wait_ms"),
])
def test_a_queue_said_out_of_bounds_is_refused_by_the_field_it_names(fields, named):
    """2.7's acquire/release queue fields carry their bounds: a peer's lie is refused at decode."""
    for op in ({"op": "acquire", "id": 4}, {"op": "release", "id": 4, "grant": 1}):
        with pytest.raises(codec.BadFrame) as caught:
            codec.decode_request(msgspec.msgpack.encode({**op, **fields}))
        assert named in str(caught.value) and caught.value.request_id == 4
    ok = codec.decode_request(msgspec.msgpack.encode({"op": "acquire", "id": 5, "waiting": 3, "oldest_wait_ms": 2.5}))
    assert ok == p.Acquire(id=5, waiting=3, oldest_wait_ms=2.5)


_HELLO = {"op": "hello", "id": 7, "protocol": list(p.PROTOCOL_VERSION), "name": "n", "pid": 1}


@pytest.mark.parametrize("frame, field", [
    ({**_HELLO, "weight": 0}, "weight"),
    ({**_HELLO, "weight": 1e7}, "weight"),
    ({**_HELLO, "weight": float("nan")}, "weight"),
    ({**_HELLO, "name": ""}, "name"),
    ({**_HELLO, "name": "x" * 129}, "name"),
    ({**_HELLO, "pid": 0}, "pid"),
    ({**_HELLO, "memory_mb": -1}, "memory_mb"),
    ({**_HELLO, "borrower": "  "}, "borrower"),
    ({**_HELLO, "slo_ms": 0.0}, "slo_ms"),
    ({"op": "suspend_session", "id": 7, "session": "s", "deadline_ms": 4e6}, "deadline_ms"),
    ({"op": "reclaim", "id": 7, "device": 0, "deadline_ms": -1.0}, "deadline_ms"),
    ({"op": "set_weight", "id": 7, "session": "s", "weight": -2.0}, "weight"),
    ({"op": "lend", "id": 7, "device": 0, "borrower": " "}, "borrower"),
    ({"op": "renew", "id": 7, "device": 0, "borrower": "j" * 129, "max_s": 1.0}, "borrower"),
    ({"op": "infer", "id": 7, "model": "m", "inputs": [{"dtype": "f", "shape": []}] * 65}, "inputs"),
    ({"op": "infer", "id": 7, "model": "m", "inputs": [{"dtype": "f", "shape": []}], "timeout_ms": 0}, "timeout_ms"),
    ({"op": "register_model", "id": 7, "name": "-bad", "factory": "a:b"}, "name"),
    ({"op": "register_model", "id": 7, "name": "m", "factory": "a:b",
      "example_input": [{"dtype": "f", "shape": []}] * 65}, "example_input"),
])
def test_a_value_outside_its_wire_bounds_is_invalid_and_names_its_field(frame, field):
    """The bounds live on the wire types (msgspec Meta, numbers from client_lib.limits): a value of
    the right type outside them is E_INVALID naming the field; a wrong type stays E_BAD_REQUEST."""
    with pytest.raises(codec.BadFrame) as caught:
        codec.decode_request(msgspec.msgpack.encode(frame))
    assert caught.value.code == p.ErrorCode.INVALID and caught.value.request_id == 7
    assert str(caught.value).startswith(f"invalid request: field '{field}': expected ")
    with pytest.raises(codec.BadFrame) as wrong_type:
        codec.decode_request(msgspec.msgpack.encode({**frame, field: True}))
    assert wrong_type.value.code == p.ErrorCode.BAD_REQUEST


def test_an_id_out_of_range_stays_a_bad_request():
    with pytest.raises(codec.BadFrame) as caught:
        codec.decode_request(msgspec.msgpack.encode({"op": "acquire", "id": -3}))
    assert caught.value.code == p.ErrorCode.BAD_REQUEST
