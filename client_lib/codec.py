"""Encoding and decoding of protocol frames: the only place bytes become types.

MessagePack via msgspec, typed by the Structs in :mod:`client_lib.protocol`.
No pickle, ever. Decoding a request never raises anything but
:class:`BadFrame`, which carries the best request id that could be read from
the frame so that the daemon can still answer the sender.
"""

from __future__ import annotations

import msgspec

from client_lib import protocol as p

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(p.ClientMessage)
_reply_decoder = msgspec.msgpack.Decoder(p.DaemonMessage)
_loose_decoder = msgspec.msgpack.Decoder()


class BadFrame(ValueError):
    """A frame that is not a valid message. ``request_id`` is 0 when unknown."""

    def __init__(self, message: str, request_id: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _salvage_id(frame: bytes) -> int:
    """Best effort: the ``id`` of a frame that failed typed decoding."""
    try:
        loose = _loose_decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError):
        return 0
    if isinstance(loose, dict):
        rid = loose.get("id")
        if type(rid) is int and 0 <= rid < 2**63:
            return rid
    return 0


def decode_request(frame: bytes, max_bytes: int = p.MAX_REQUEST_BYTES) -> p.ClientMessage:
    """Decode one client request; :class:`BadFrame` says why it is not one."""
    if len(frame) > max_bytes:
        # Too large to be worth decoding even for its id.
        raise BadFrame(f"frame of {len(frame)} bytes exceeds the {max_bytes}-byte request limit")
    try:
        msg = _request_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise BadFrame(f"invalid request: {exc}", _salvage_id(frame)) from None
    except msgspec.DecodeError as exc:
        raise BadFrame(f"not a MessagePack map: {exc}", 0) from None
    return msg


def decode_reply(frame: bytes) -> p.DaemonMessage:
    """Decode one daemon message (client side). Raises :class:`BadFrame`."""
    try:
        return _reply_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadFrame(f"invalid message from daemon: {exc}", _salvage_id(frame)) from None
