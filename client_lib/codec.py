"""Encoding and decoding of protocol frames: the only place bytes become types (msgspec, never
pickle). Decoding a request raises nothing but :class:`BadFrame`. Detail: docs/internals.md.
"""

from __future__ import annotations

import re
import typing
from contextlib import suppress

import msgspec
from msgspec import inspect as mi

from client_lib import protocol as p

encode = msgspec.msgpack.Encoder().encode
_request_decoder = msgspec.msgpack.Decoder(p.ClientMessage)
_reply_decoder = msgspec.msgpack.Decoder(p.DaemonMessage)
_loose_decoder = msgspec.msgpack.Decoder()
_UNDECODABLE = (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError)


class BadFrame(ValueError):
    """A frame that is not a valid message. ``request_id`` is 0 when unknown; ``code`` is what the
    daemon answers: E_INVALID for a value of the right type outside its wire type's bounds."""

    def __init__(self, message: str, request_id: int = 0, code: str = p.ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.request_id, self.code = request_id, code


# Header bytes that open an array or a map: fixmap, fixarray, array16/32, map16/32.
_OPENERS = bytes(range(0x80, 0xA0)) + bytes((0xDC, 0xDD, 0xDE, 0xDF))
_NOT_OPENERS = bytes(b for b in range(256) if b not in _OPENERS)

# Bytes that follow a header byte before the next element, by header (payload
# lengths read from the header are added where they apply).
_FIXED_SIZE = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
               0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_LENGTH_PREFIXED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),   # bin: (length bytes, extra bytes)
                    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),   # ext: + one type byte
                    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}   # str
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # (count bytes, elements per count)


def _header(frame: bytes, pos: int) -> tuple[int, int] | None:
    """Read the MessagePack header byte at ``pos``: (where the next element starts,
    how many elements the container it opens holds, -1 if it opens none); None for
    0xC1, which MessagePack never uses. Payload bytes are skipped unread."""
    b = frame[pos]
    pos += 1
    if b <= 0x7F or b >= 0xE0:
        return pos, -1
    if b <= 0x8F:
        return pos, 2 * (b & 0x0F)
    if b <= 0x9F:
        return pos, b & 0x0F
    if b <= 0xBF:
        return pos + (b & 0x1F), -1
    if b in _FIXED_SIZE:
        return pos + _FIXED_SIZE[b], -1
    if b in _LENGTH_PREFIXED:
        width, extra = _LENGTH_PREFIXED[b]
        return pos + width + extra + int.from_bytes(frame[pos:pos + width], "big"), -1
    if b in _COUNTED:
        width, per = _COUNTED[b]
        return pos + width, per * int.from_bytes(frame[pos:pos + width], "big")
    return None


def nesting_depth_exceeds(frame: bytes, limit: int) -> bool:
    """True if ``frame`` nests arrays and maps deeper than ``limit``, or is cut short inside a
    container deeper than that. Iterative and linear; a frame has at most as many levels as
    container-opening bytes, so a small request is settled by one C-speed count, never walked."""
    if len(frame.translate(None, _NOT_OPENERS)) <= limit:
        return False
    pending: list[int] = []  # elements still to read, per open container
    pos, end = 0, len(frame)
    while pos < end:
        header = _header(frame, pos)
        if header is None:  # not MessagePack; the decoder will say so
            return False
        pos, count = header
        if pending:
            pending[-1] -= 1
        if count >= 0:
            if len(pending) + 1 > limit:
                return True
            pending.append(count)
        while pending and pending[-1] == 0:
            pending.pop()
        if not pending:
            return False  # one complete top-level object; trailing bytes are the decoder's to refuse
    return False


def _salvage_id(frame: bytes) -> int:
    """Best effort: the ``id`` of a frame that failed typed decoding."""
    try:
        loose = _loose_decoder.decode(frame)
    except _UNDECODABLE:
        return _scan_id(frame)  # malformed further on (an `op` of 0xC1): walk the keys for it
    if isinstance(loose, dict):
        rid = loose.get("id")
        rid = _exact_integer(rid) if type(rid) is float else rid
        if type(rid) is int and 0 <= rid < 2**63:
            return rid
    return 0


_SCAN_STEPS = 4096  # elements a scan for the id walks at most: a real request has a few dozen


def _skip(frame: bytes, pos: int, steps: int) -> tuple[int, int] | None:
    """(position after the one object at ``pos``, steps left), iteratively; None if it is
    cut short, not MessagePack, or takes more than ``steps`` elements to walk."""
    end = len(frame)
    remaining = 1  # objects still to skip: a container adds its elements
    while remaining:
        if pos >= end or steps <= 0:
            return None
        header = _header(frame, pos)
        if header is None:
            return None
        pos, count = header
        steps -= 1
        remaining += max(count, 0) - 1  # this object read; a container's elements to come
    return (pos, steps) if pos <= end else None


def _scan_id(frame: bytes) -> int:
    """Best effort, for a frame the decoder refused as malformed (cut short, trailing
    bytes, a bad byte or invalid UTF-8 further on, nested too deep): the ``id`` of its
    top-level map, read by walking the map's keys without decoding anything else, so
    that the error can still name the request. 0 when there is none to read."""
    if not frame or not (0x80 <= frame[0] <= 0x8F or frame[0] in (0xDE, 0xDF)):  # not a map
        return 0
    pos, count = _header(frame, 0)
    found, steps, pairs = 0, _SCAN_STEPS, count // 2
    for _ in range(min(pairs, _SCAN_STEPS)):
        is_id = frame[pos:pos + 3] == b"\xa2id"  # the key "id" as every encoder writes it (fixstr)
        key = _skip(frame, pos, steps)
        if key is None:
            break
        pos, steps = key
        if pos < len(frame) and frame[pos] == 0xC1:  # a value MessagePack never uses: one byte, as msgspec reads it
            pos += 1
            continue
        value = _skip(frame, pos, steps)
        if value is None:
            break
        if is_id:
            with suppress(*_UNDECODABLE):
                rid = _loose_decoder.decode(frame[pos:value[0]])
                if type(rid) is int and 0 <= rid < 2**63:
                    found = rid  # a later "id" wins, as when decoding
        pos, steps = value
    return found


def decode_request(frame: bytes, max_bytes: int = p.MAX_REQUEST_BYTES) -> p.ClientMessage:
    """Decode one client request; :class:`BadFrame` says why it is not one."""
    if len(frame) > max_bytes:
        # Too large to be worth decoding even for its id.
        raise BadFrame(f"frame of {len(frame)} bytes exceeds the {max_bytes}-byte request limit")
    if nesting_depth_exceeds(frame, p.MAX_NESTING_DEPTH):
        raise BadFrame(f"frame nests arrays or maps deeper than {p.MAX_NESTING_DEPTH} levels", _scan_id(frame))
    try:
        return _request_decoder.decode(frame)
    except msgspec.ValidationError:
        return _refused(frame)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError):  # ValueError: a str not UTF-8, older msgspec
        raise _malformed(frame) from None
    except RecursionError:  # unreachable after the depth check; kept so no frame can raise it
        raise BadFrame(f"frame nests arrays or maps deeper than {p.MAX_NESTING_DEPTH} levels") from None


# JavaScript has one number type: its MessagePack encoders write an integer above 2^32 (every
# grant id) as a float64. Where a field wants an integer and gets a float that is one exactly,
# the float is taken as that integer; a fraction, NaN, an infinity or a float past what a
# float64 holds exactly (Number.MAX_SAFE_INTEGER) is still refused, and so is a value outside
# the field's own bounds.
MAX_SAFE_INTEGER = 2**53 - 1


def _exact_integer(value: object) -> int | None:
    """``value`` as an int if it is a float holding one exactly (JavaScript's safe range), else None."""
    if type(value) is float and value.is_integer() and abs(value) <= MAX_SAFE_INTEGER:
        return int(value)
    return None


def _refused(frame: bytes) -> p.ClientMessage:
    """A frame the typed decoder refused: the message when taking each integral float where the
    wire type wants an integer as that integer makes it one, else :class:`BadFrame` saying which
    field is wrong and how (or that it is no map at all), with the code to answer it with."""
    bad = p.ErrorCode.BAD_REQUEST
    try:
        value = _loose_decoder.decode(frame)
    except _UNDECODABLE:  # not one MessagePack value at all (b"hello")
        raise _malformed(frame) from None
    if type(value) is not dict:
        raise BadFrame(f"invalid request: the frame is a MessagePack {_kind(value)}, not a map; "
                       "a request is a map with 'op' and 'id'")
    try:
        value = _check(value, _CLIENT_TYPE, "")
    except _Wrong as wrong:
        code = p.ErrorCode.INVALID if wrong.bound and wrong.path != "id" else bad  # an id out of range is unreadable
        if wrong.path == "op" and wrong.text == "unknown tag":
            text, code = f"invalid request: unknown op {value['op']!r} (ops: {', '.join(_OPS)})", bad
        elif wrong.path:
            text = f"invalid request: field '{wrong.path}': {wrong.text}"
        else:
            text = f"invalid request: {wrong.text}"
        raise BadFrame(text, _salvage_id(frame), code) from None
    try:
        return msgspec.convert(value, p.ClientMessage)
    except msgspec.ValidationError:  # a check the wire types do not describe to inspect
        raise BadFrame("invalid request: a field's value is not allowed by the protocol (docs/protocol.md lists "
                       "each field)", _salvage_id(frame)) from None


def decode_reply(frame: bytes) -> p.DaemonMessage:
    """Decode one daemon message (client side); :class:`BadFrame` if it is none. No depth walk: on a
    status of thousands of sessions it costs more than decoding, and msgspec's own recursion guard
    raises RecursionError, caught below, so a daemon cannot crash its client either way."""
    try:
        return _reply_decoder.decode(frame)
    except _UNDECODABLE as exc:
        raise BadFrame(f"invalid message from daemon: {exc}", _salvage_id(frame)) from None


# ------------------------------------------------------------------ error texts
# What a peer is told about a frame it got wrong, in the protocol's words (docs/protocol.md:
# maps, fields, MessagePack types). Built from the wire types themselves (msgspec.inspect) and
# from our own walk of the bytes, never from msgspec's or Python's wording, which changes
# between releases (msgspec 0.23 reworded a bad UTF-8 string's error).

_CLIENT_TYPE = msgspec.inspect.type_info(p.ClientMessage)
_OPS = tuple(cls.__struct_config__.tag for cls in typing.get_args(p.ClientMessage))
_KIND_WORDS = {bool: "boolean", int: "integer", float: "float", str: "string", bytes: "binary", list: "array",
               dict: "map", type(None): "nil"}
# The Python type a loose decode gives a value of these wire types; any other value is of the wrong kind.
_DECODED_AS = {mi.NoneType: type(None), mi.BoolType: bool, mi.StrType: str, mi.BytesType: bytes, mi.ListType: list,
               mi.TupleType: list, mi.DictType: dict}
_TYPE_WORDS = {**{t: _KIND_WORDS[kind] for t, kind in _DECODED_AS.items()}, mi.IntType: "integer",
               mi.FloatType: "number", mi.StructType: "map", mi.LiteralType: "one of its values"}


class _Wrong(Exception):
    """Where a decoded value departs from its wire type (``path``: ``field[3].other``) and how;
    ``bound``: it has the right type but breaks a ``Meta`` constraint."""

    def __init__(self, path: str, text: str, bound: bool = False) -> None:
        super().__init__(path, text)
        self.path, self.text, self.bound = path, text, bound


def _kind(value: object) -> str:
    return _KIND_WORDS.get(type(value), "extension")


def _bounds(value: float, t: mi.IntType | mi.FloatType, path: str) -> None:
    for bound, ok, word in ((t.ge, lambda b: value >= b, ">="), (t.gt, lambda b: value > b, ">"),
                            (t.le, lambda b: value <= b, "<="), (t.lt, lambda b: value < b, "<")):
        if bound is not None and not ok(bound):
            raise _Wrong(path, f"expected a value {word} {bound}", bound=True)
    if t.multiple_of is not None and value % t.multiple_of:
        raise _Wrong(path, f"expected a multiple of {t.multiple_of}", bound=True)


def _lengths(value: typing.Sized, t: typing.Any, path: str, unit: str) -> None:
    if t.min_length is not None and len(value) < t.min_length:
        raise _Wrong(path, f"expected at least {t.min_length} {unit}", bound=True)
    if t.max_length is not None and len(value) > t.max_length:
        raise _Wrong(path, f"expected at most {t.max_length} {unit}", bound=True)


def _at(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)


def _check(value: typing.Any, t: mi.Type, path: str) -> typing.Any:
    """``value`` checked against wire type ``t``: returned with integral floats made integers
    where ``t`` wants an integer, or :class:`_Wrong` naming the first place it departs. Only the
    kinds of type :data:`client_lib.protocol.ClientMessage` holds are walked."""
    kind = type(t)
    if kind in _DECODED_AS and type(value) is not _DECODED_AS[kind]:
        raise _Wrong(path, f"expected {_TYPE_WORDS[kind]}, got {_kind(value)}")
    if kind is mi.IntType:
        number = value if type(value) is int else _exact_integer(value)
        if number is None:
            raise _Wrong(path, f"expected integer, got {_kind(value)}")
        _bounds(number, t, path)
        return number
    if kind is mi.FloatType:
        if type(value) not in (int, float):
            raise _Wrong(path, f"expected number, got {_kind(value)}")
        _bounds(value, t, path)
        return value
    if kind is mi.StrType:
        _lengths(value, t, path, "characters")
        if t.pattern is not None and re.search(t.pattern, value) is None:
            raise _Wrong(path, f"expected a string matching {t.pattern!r}", bound=True)
        return value
    if kind is mi.BytesType:
        _lengths(value, t, path, "bytes")
        return value
    if kind is mi.LiteralType:
        if type(value) not in (str, int) or value not in t.values:
            shown = repr(value) if type(value) in (str, int) else _kind(value)
            raise _Wrong(path, f"{shown} is not one of its values")
        return value
    if kind is mi.ListType:
        _lengths(value, t, path, "items")
        return [_check(item, t.item_type, _at(path, i)) for i, item in enumerate(value)]
    if kind is mi.TupleType:
        if len(value) != len(t.item_types):
            raise _Wrong(path, f"expected an array of {len(t.item_types)} items, got {len(value)}")
        return [_check(item, it, _at(path, i)) for i, (item, it) in enumerate(zip(value, t.item_types))]
    if kind is mi.DictType:
        _lengths(value, t, path, "entries")
        return {_check(k, t.key_type, path): _check(v, t.value_type, _at(path, str(k))) for k, v in value.items()}
    if kind is mi.StructType:
        return _check_struct(value, t, path)
    if kind is mi.UnionType:
        return _check_union(value, t, path)
    return value  # nil and boolean, checked above


def _check_struct(value: typing.Any, t: mi.StructType, path: str) -> dict:
    if type(value) is not dict:
        raise _Wrong(path, f"expected map, got {_kind(value)}")
    out = dict(value)
    for field in t.fields:
        if field.encode_name in value:
            out[field.encode_name] = _check(value[field.encode_name], field.type, _at(path, field.encode_name))
        elif field.required:
            raise _Wrong(path, f"missing field '{field.encode_name}'")
    return out


def _check_union(value: typing.Any, t: mi.UnionType, path: str) -> typing.Any:
    members = t.types
    structs = [m for m in members if type(m) is mi.StructType and m.tag_field is not None]
    if structs and type(value) is dict:  # a tagged union: the tag picks the member
        tag_field = structs[0].tag_field
        if tag_field not in value:
            raise _Wrong(path, f"missing field '{tag_field}'")
        for member in structs:
            if value[tag_field] == member.tag:
                return _check_struct(value, member, path)
        raise _Wrong(_at(path, tag_field), "unknown tag")
    for member in members:
        try:
            return _check(value, member, path)
        except _Wrong as wrong:
            if wrong.path != path or not wrong.text.startswith("expected ") or ", got " not in wrong.text:
                raise  # the value is of this member's kind: its bound, or a part inside it, is wrong
    names = " or ".join(dict.fromkeys(_TYPE_WORDS.get(type(m), "a value") for m in members))
    raise _Wrong(path, f"expected {names}, got {_kind(value)}")


def _malformed(frame: bytes) -> BadFrame:
    """A frame that is not (one whole value of) MessagePack: what our own walk of it finds."""
    return BadFrame(f"the frame is not a MessagePack map: {_malformed_reason(frame)}", _scan_id(frame))


def _malformed_reason(frame: bytes) -> str:
    """Why ``frame`` is not one whole MessagePack value, from a walk of its bytes."""
    pos, end, remaining = 0, len(frame), 1
    while remaining:
        if pos >= end:
            return "it ends inside a value (cut short)"
        b = frame[pos]
        header = _header(frame, pos)
        if header is None:
            return f"byte 0x{b:02x} at offset {pos} is not MessagePack"
        after, count = header
        if 0xA0 <= b <= 0xBF or 0xD9 <= b <= 0xDB:  # a fixstr, or str8/16/32 after its length
            start = pos + 1 + _LENGTH_PREFIXED.get(b, (0, 0))[0]
            if after <= end:
                try:
                    frame[start:after].decode("utf-8")
                except UnicodeDecodeError:
                    return f"the string at offset {pos} is not valid UTF-8"
        pos = after
        remaining += max(count, 0) - 1
    if pos > end:
        return "it ends inside a value (cut short)"
    if pos < end:
        return f"more bytes follow its first value, from offset {pos}"
    return "a value in it cannot be decoded (an extension or timestamp the protocol does not use)"
