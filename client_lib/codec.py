"""Encoding and decoding of protocol frames: the only place bytes become types.

MessagePack via msgspec, typed by the Structs in :mod:`client_lib.protocol`.
No pickle, ever. Decoding a request never raises anything but
:class:`BadFrame`, which carries the best request id that could be read from
the frame so that the daemon can still answer the sender. Size and nesting depth
are checked before any decoding: msgspec recurses once per level, and a frame
nested a thousand deep would otherwise raise ``RecursionError``.
"""

from __future__ import annotations

import re
import typing

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
    """True if ``frame`` nests arrays and maps deeper than ``limit``, or is cut
    short inside a container deeper than that.

    Iterative and linear in the frame's size. A frame has at most as many
    levels as it has container-opening bytes, so the common case (a small
    request) is settled by one C-speed count and never walked."""
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
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError):
        return 0
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
    if not frame:
        return 0
    b = frame[0]
    if 0x80 <= b <= 0x8F:
        pairs, pos = b & 0x0F, 1
    elif b in (0xDE, 0xDF):
        width = 2 if b == 0xDE else 4
        pairs, pos = int.from_bytes(frame[1:1 + width], "big"), 1 + width
    else:
        return 0
    found, steps = 0, _SCAN_STEPS
    for _ in range(min(pairs, _SCAN_STEPS)):
        is_id = frame[pos:pos + 3] == b"\xa2id"  # the key "id" as every encoder writes it (fixstr)
        key = _skip(frame, pos, steps)
        if key is None:
            break
        pos, steps = key
        if is_id and pos < len(frame):
            b = frame[pos]
            if b <= 0x7F:
                found = b
            elif b in (0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3):
                width = 1 << ((b - 0xCC) & 3)
                raw = frame[pos + 1:pos + 1 + width]
                value = int.from_bytes(raw, "big", signed=b >= 0xD0)
                if len(raw) == width and 0 <= value < 2**63:
                    found = value  # a later "id" wins, as when decoding
        value = _skip(frame, pos, steps)
        if value is None:
            break
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
        msg = _request_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        msg = _with_integral_floats(frame, exc)
        if isinstance(msg, msgspec.ValidationError):
            raise BadFrame(_invalid_text(msg, frame), _salvage_id(frame)) from None
    except msgspec.DecodeError as exc:
        raise BadFrame(_malformed_text(exc, frame), _scan_id(frame)) from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a str that is not UTF-8
        raise BadFrame(_malformed_text(exc, frame), _scan_id(frame)) from None
    except RecursionError:  # unreachable after the depth check; kept so no frame can raise it
        raise BadFrame(f"frame nests arrays or maps deeper than {p.MAX_NESTING_DEPTH} levels") from None
    return msg


# JavaScript has one number type: its MessagePack encoders write an integer above 2^32 (every
# grant id) as a float64. Where a field wants an integer and gets a float that is one exactly,
# the float is taken as that integer; a fraction, NaN, an infinity or a float past what a
# float64 holds exactly (Number.MAX_SAFE_INTEGER) is still refused, and so is a value outside
# the field's own bounds.
MAX_SAFE_INTEGER = 2**53 - 1
_WANTS_INT = re.compile(r"Expected `(?P<types>[^`]*)`, got `float`")
_PATH_STEP = re.compile(r"\.(?P<field>[A-Za-z_][A-Za-z0-9_]*)|\[(?P<index>\d+)\]")


def _exact_integer(value: object) -> int | None:
    """``value`` as an int if it is a float holding one exactly (JavaScript's safe range), else None."""
    if type(value) is float and value.is_integer() and abs(value) <= MAX_SAFE_INTEGER:
        return int(value)
    return None


def _with_integral_floats(frame: bytes, exc: msgspec.ValidationError) -> p.ClientMessage | msgspec.ValidationError:
    """Decode ``frame`` again with each integral float the decoder refused where an integer
    was wanted taken as that integer; the message, or the error that still stands."""
    try:
        value = _loose_decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError):
        return exc
    for _ in range(64):  # one field per round; a request has fewer integer fields than this
        text = str(exc)
        wanted, at = _WANTS_INT.match(text), _AT_PATH.search(text)
        if wanted is None or at is None or "int" not in (t.strip() for t in wanted.group("types").split("|")):
            return exc
        place = _locate(value, at.group("path"))
        if place is None:
            return exc
        container, key = place
        number = _exact_integer(container[key])
        if number is None:
            return exc
        container[key] = number
        try:
            return msgspec.convert(value, p.ClientMessage)
        except msgspec.ValidationError as again:
            exc = again
    return exc


def _locate(value: object, path: str) -> tuple[dict | list, str | int] | None:
    """The container and key that msgspec's error path (``.field[3].other``) names, or None."""
    steps = [(m.group("field"), m.group("index")) for m in _PATH_STEP.finditer(path)]
    if not steps or "".join(m.group(0) for m in _PATH_STEP.finditer(path)) != path:
        return None
    container, key = None, None
    for field, index in steps:
        if container is not None:
            value = container[key]
        if field is not None and isinstance(value, dict) and field in value:
            container, key = value, field
        elif index is not None and isinstance(value, list) and int(index) < len(value):
            container, key = value, int(index)
        else:
            return None
    return container, key


def decode_reply(frame: bytes) -> p.DaemonMessage:
    """Decode one daemon message (client side). Raises :class:`BadFrame`.

    No depth walk here: a status of thousands of sessions is a large frame with
    many containers, and walking it in Python costs more than decoding it. A
    daemon cannot crash its client either way: msgspec's own recursion guard
    raises RecursionError, caught below."""
    try:
        return _reply_decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise BadFrame(f"invalid message from daemon: {exc}", _salvage_id(frame)) from None


# ------------------------------------------------------------------ error texts
# What a peer is told about a frame it got wrong, in the protocol's words
# (docs/protocol.md: maps, fields, MessagePack types), never msgspec's or Python's.

_TYPE_WORDS = {"object": "map", "array": "array", "int": "integer", "str": "string", "float": "number",
               "bool": "boolean", "null": "nil", "None": "nil", "bytes": "binary", "ext": "extension",
               "datetime": "timestamp"}
_KIND_WORDS = {bool: "boolean", int: "integer", float: "float", str: "string", bytes: "binary", list: "array",
               dict: "map", type(None): "nil"}
_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_TICKED = re.compile(r"`([^`]*)`")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]*)`")
_TRAILING = re.compile(r"trailing characters \(byte (?P<at>\d+)\)")
_OPCODE = re.compile(r"invalid opcode .* \(byte (?P<at>\d+)\)")
_OPS = tuple(cls.__struct_config__.tag for cls in typing.get_args(p.ClientMessage))


def _invalid_text(exc: msgspec.ValidationError, frame: bytes) -> str:
    """A frame the typed decoder refused: which field is wrong and how (or that it is no map at all)."""
    text = str(exc)
    at = _AT_PATH.search(text)
    path = at.group("path").lstrip(".") if at else ""
    if at:
        text = text[:at.start()]
    if not path and text.startswith("Expected `object`"):  # the frame itself is not a map
        try:
            value = _loose_decoder.decode(frame)
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as loose:
            return _malformed_text(loose, frame)  # not one MessagePack value at all (b"hello")
        kind = _KIND_WORDS.get(type(value), "extension")
        return f"invalid request: the frame is a MessagePack {kind}, not a map; a request is a map with 'op' and 'id'"
    missing = _MISSING.fullmatch(text)
    if missing:
        text = f"missing field '{missing.group('field')}'"
    elif path == "op" and text.startswith("Invalid value "):
        return f"invalid request: unknown op {text[len('Invalid value '):]} (ops: {', '.join(_OPS)})"
    elif text.startswith("Invalid enum value "):
        text = f"{text[len('Invalid enum value '):]} is not one of its values"
    else:
        text = _TICKED.sub(lambda m: " or ".join(_TYPE_WORDS.get(t.strip(), t.strip()) for t in m.group(1).split("|")),
                           text)
        text = text[:1].lower() + text[1:]
    return f"invalid request: field '{path}': {text}" if path else f"invalid request: {text}"


def _malformed_text(exc: Exception, frame: bytes) -> str:
    """A frame that is not (one whole value of) MessagePack."""
    if isinstance(exc, UnicodeDecodeError):
        why = "a string in it is not valid UTF-8"
    elif not isinstance(exc, msgspec.DecodeError):
        why = "a value in it cannot be decoded"
    else:
        text = str(exc).removeprefix("MessagePack data is malformed: ")
        trailing, opcode = _TRAILING.fullmatch(text), _OPCODE.fullmatch(text)
        if trailing:
            why = f"more bytes follow its first value, from offset {trailing.group('at')}"
        elif opcode:
            at = int(opcode.group("at"))
            why = f"byte 0x{frame[at]:02x} at offset {at} is not MessagePack" if at < len(frame) else text
        elif "truncated" in text:
            why = "it ends inside a value (cut short)"
        else:
            why = text
    return f"the frame is not a MessagePack map: {why}"
