"""docs/protocol.md against the code: a third party builds a client from the doc
alone (issue 14), so every message, field and error code the daemon knows must be
in it, with the type and default the code gives, and the doc must name nothing
the code does not know.

The daemon's side is read from code, never from a list kept here: every
msgspec ``Struct`` in :mod:`client_lib.protocol` (tagged messages by their ``op``
and direction, nested structs by class name), their fields with types and
defaults, every :class:`~client_lib.protocol.ErrorCode`, and the enums behind
the enumerated values. The doc's side is its sections: a message is documented
by a heading ``### `op` (request)`` (or ``(reply)``, ``(notice)``) and a nested
struct by ``### `Name```, each followed by a field table
``| field | type | default | meaning |`` (none for a message with no field but
``id``). Every failure is one line naming what is missing or wrong.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from client_lib import protocol as p
from sharing import DeviceState, SessionState

ROOT = Path(__file__).resolve().parent.parent.parent
DOC = ROOT / "docs" / "protocol.md"

_MESSAGE_HEADING = re.compile(r"^#{2,4} `([a-z_]+)` \((request|reply|notice)\)\s*$")
_STRUCT_HEADING = re.compile(r"^#{2,4} `([A-Z][A-Za-z]+)`\s*$")
_VALUES_HEADING = re.compile(r"^#{2,4} Values of `([A-Za-z_]+\.[a-z_]+)`")
_ANY_HEADING = re.compile(r"^#{1,6} ")
_CODE = re.compile(r"\bE_[A-Z_]+\b")


# --------------------------------------------------------------------- the code


def _wire_type(t: mi.Type) -> str:
    """A field's type as the doc writes it (MessagePack's view of msgspec's type)."""
    if isinstance(t, mi.IntType):
        return "int"
    if isinstance(t, mi.FloatType):
        return "float"
    if isinstance(t, mi.StrType):
        return "str"
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.BytesType):
        return "bin"
    if isinstance(t, mi.NoneType):
        return "nil"
    if isinstance(t, mi.LiteralType):
        return "str"  # the values are listed in the doc
    if isinstance(t, mi.TupleType):
        return "[" + ", ".join(_wire_type(i) for i in t.item_types) + "]"
    if isinstance(t, mi.ListType):
        return f"[{_wire_type(t.item_type)}, ...]"
    if isinstance(t, mi.DictType):
        return f"{{{_wire_type(t.key_type)}: {_wire_type(t.value_type)}}}"
    if isinstance(t, mi.UnionType):
        return " | ".join(_wire_type(i) for i in t.types)
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    raise AssertionError(f"tests/client_lib/test_protocol_doc.py cannot name the wire type {t!r}: teach _wire_type")


def _wire_default(f: mi.Field) -> str:
    """A field's default as the doc writes it ("required" when it has none)."""
    if f.required:
        return "required"
    value = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    return "`nil`" if value is None else "`" + msgspec.json.encode(value).decode() + "`"


@dataclass(frozen=True)
class Shape:
    """One struct as the code defines it: its fields' wire types and defaults (a message's
    ``id`` left out: the doc gives it once, for every message)."""

    name: str  # "hello (request)", "welcome (reply)" or "SessionInfo"
    fields: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (type, default)


def _shape(name: str, cls: type) -> Shape:
    message = issubclass(cls, (p.Request, p.Reply))
    return Shape(name, {f.encode_name: (_wire_type(f.type), _wire_default(f))
                        for f in mi.type_info(cls).fields if not (message and f.encode_name == "id")})


def _subclasses(base: type) -> list[type]:
    found, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def code_structs() -> dict[tuple[str, str], Shape]:
    """(kind, name) -> Shape for every Struct in client_lib/protocol.py: ("request", op),
    ("daemon", op) for replies and notices, ("struct", class name) for nested ones."""
    structs: dict[tuple[str, str], Shape] = {}
    for cls in _subclasses(p.Request):
        if cls.__module__ == p.__name__:
            structs[("request", cls.__struct_config__.tag)] = _shape(f"`{cls.__struct_config__.tag}` (request)", cls)
    for cls in _subclasses(p.Reply):
        if cls.__module__ == p.__name__:
            tag = cls.__struct_config__.tag
            structs[("daemon", tag)] = _shape(f"`{tag}` (reply or notice)", cls)
    for cls in vars(p).values():
        if (inspect.isclass(cls) and issubclass(cls, msgspec.Struct) and cls.__module__ == p.__name__
                and not issubclass(cls, (p.Request, p.Reply))):
            structs[("struct", cls.__name__)] = _shape(f"`{cls.__name__}`", cls)
    return structs


# The packages whose errors a user can catch: each string constant that is an error code in
# their source (an ErrorCode, a ``code = "E_..."`` of an exception class, placement's own).
_PRODUCT = ("client_lib", "nodeagent", "sharing", "ctxpool", "nodeagent_ray")
_WHOLE_CODE = re.compile(r"E_[A-Z][A-Z_]*")


def scanned_error_codes() -> dict[str, str]:
    """Every string constant in the product's source that is an error code -> a file that has it."""
    import ast
    found: dict[str, str] = {}
    for package in _PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and _WHOLE_CODE.fullmatch(node.value):
                    found.setdefault(node.value, str(path.relative_to(ROOT)))
    return found


def code_errors() -> set[str]:
    declared = {v for k, v in vars(p.ErrorCode).items() if k.isupper() and isinstance(v, str)}
    return declared | set(scanned_error_codes())


def test_the_error_code_scan_finds_codes_outside_error_code():
    found = scanned_error_codes()
    # raised by client_lib (its base error, placement's checks) and the daemon's MPS manager
    assert {"E_CLIENT", "E_BAD_REPLY", "E_NOT_SUSPENDED", "E_MPS"} <= set(found), found
    assert found["E_MPS"] == "nodeagent/mps.py"


# ---------------------------------------------------------------------- the doc


@dataclass
class Section:
    """A heading the checks know, and the first table under it (later ones are prose's)."""

    kind: str  # "request", "daemon", "struct", "values"
    name: str
    line: int
    rows: dict[str, list[str]] = field(default_factory=dict)  # first cell (unquoted) -> the other cells
    header: list[str] = field(default_factory=list)
    closed: bool = False  # its table has ended


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row; ``\\|`` inside a cell is a literal bar."""
    inner = line.strip().strip("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def _unquote(cell: str) -> str:
    return cell[1:-1] if len(cell) >= 2 and cell[0] == cell[-1] == "`" else cell


def doc_sections(text: str) -> list[Section]:
    sections: list[Section] = []
    current: Section | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if _ANY_HEADING.match(line):
            current = None
            if m := _MESSAGE_HEADING.match(line):
                current = Section("request" if m[2] == "request" else "daemon", m[1], number)
            elif m := _STRUCT_HEADING.match(line):
                current = Section("struct", m[1], number)
            elif m := _VALUES_HEADING.match(line):
                current = Section("values", m[1], number)
            if current is not None:
                sections.append(current)
            continue
        if current is None or current.closed:
            continue
        if not line.startswith("|"):
            current.closed = bool(current.header)
            continue
        cells = _cells(line)
        if not current.header:
            current.header = cells
        elif not set(line) <= set("|-: "):
            current.rows[_unquote(cells[0])] = cells[1:]
    return sections


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text()


@pytest.fixture(scope="module")
def sections(text) -> dict[tuple[str, str], Section]:
    found: dict[tuple[str, str], Section] = {}
    for s in doc_sections(text):
        if (s.kind, s.name) in found:
            pytest.fail(f"docs/protocol.md:{s.line}: `{s.name}` has two sections")
        found[(s.kind, s.name)] = s
    return found


def _one_line(problems: list[str], code: str = "client_lib/protocol.py") -> str:
    return f"docs/protocol.md is out of step with {code}: " + "; ".join(problems)


# ------------------------------------------------------------------- the checks


def test_the_title_names_the_protocol_version_the_code_speaks(text):
    title = text.splitlines()[0]
    want = "%d.%d" % p.PROTOCOL_VERSION
    assert title == f"# Wire protocol, version {want}", f"docs/protocol.md title {title!r}: the code speaks {want}"


def test_every_message_and_struct_has_its_section(sections):
    missing = [shape.name for key, shape in code_structs().items() if key not in sections]
    assert not missing, _one_line([f"no section for {', '.join(missing)}"])


def test_every_field_is_in_its_messages_table_with_its_type_and_default(sections):
    problems = []
    for key, shape in code_structs().items():
        section = sections.get(key)
        if section is None:
            continue  # the test above names it
        if shape.fields and section.header[:3] != ["field", "type", "default"]:
            problems.append(f"{shape.name}: no `| field | type | default | meaning |` table")
            continue
        for name, (wire_type, default) in shape.fields.items():
            row = section.rows.get(name)
            if row is None:
                problems.append(f"{shape.name}: field `{name}` missing")
                continue
            if len(row) < 3:
                problems.append(f"{shape.name}: field `{name}` has {len(row) + 1} cells, not 4")
                continue
            if _unquote(row[0]) != wire_type:
                problems.append(f"{shape.name}: field `{name}` has type {row[0]}, the code `{wire_type}`")
            if row[1] != default:
                problems.append(f"{shape.name}: field `{name}` has default {row[1]}, the code {default}")
    assert not problems, _one_line(problems)


def test_the_doc_names_no_message_or_field_the_code_does_not_have(sections):
    code = code_structs()
    problems = []
    for key, section in sections.items():
        if section.kind == "values":
            continue
        shape = code.get(key)
        if shape is None:
            problems.append(f"line {section.line}: `{section.name}` ({section.kind}) is not in the code")
            continue
        stale = sorted(set(section.rows) - set(shape.fields))
        if stale:
            problems.append(f"line {section.line}: {shape.name} has no field {', '.join(stale)}")
    assert not problems, _one_line(problems)


def test_every_error_code_has_a_row_and_the_doc_names_no_other(text):
    rows = set()
    for line in text.splitlines():
        if line.startswith("| `E_"):
            rows.add(_unquote(_cells(line)[0]))
    named = set(_CODE.findall(text))
    problems = []
    missing = sorted(code_errors() - rows)
    if missing:
        problems.append(f"no error table row for {', '.join(missing)}")
    unknown = sorted(named - code_errors())
    if unknown:
        problems.append(f"names error codes the code does not have: {', '.join(unknown)}")
    assert not problems, _one_line(problems)


@pytest.mark.parametrize("where, values", [
    ("hello.workload", set(p.WORKLOADS)),
    ("SessionInfo.state", {s.value for s in SessionState}),
    ("DeviceInventory.state", {s.value for s in DeviceState}),
], ids=["workload", "session-state", "device-state"])
def test_enumerated_values_are_those_of_the_code(sections, where, values):
    section = sections.get(("values", where))
    assert section is not None, _one_line([f"no `### Values of `{where}`` table"])
    listed = set(section.rows)
    assert listed == values, _one_line([f"values of `{where}`: the doc lists {sorted(listed)}, "
                                        f"the code has {sorted(values)}"])


def _read_key_file(path: str) -> tuple[bytes | None, bytes | None]:
    """(public, secret) read by the rule docs/protocol.md gives under "Key files", no more."""
    public = secret = None
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if line.startswith(b"#"):
                continue
            for name in (b"public-key", b"secret-key"):
                if line.startswith(name):
                    key = line.split(b"=", 1)[1].strip(b" \t\"'")
                    if name == b"public-key":
                        public = key
                    else:
                        secret = key
    return public, secret


def test_the_documented_key_file_rule_reads_what_keys_generate_writes(text, tmp_path):
    from nodeagent import keys

    written = keys.generate(str(tmp_path), clients=["ray"])
    files = {written.server_public: "DIR/server.key", written.server_secret: "DIR/server.key_secret",
             written.allowed["ray"]: "DIR/allowed/NAME.key", written.clients["ray"]: "DIR/clients/NAME.key_secret"}
    unlisted = [doc_name for doc_name in files.values() if f"| `{doc_name}` |" not in text]
    assert not unlisted, _one_line([f"the key files table lacks {', '.join(unlisted)}"], "nodeagent/keys.py")
    public, secret = _read_key_file(written.clients["ray"])
    assert (public, secret) == keys.load_client(written.clients["ray"]), \
        _one_line(["the documented rule does not read a client's .key_secret as the daemon does"],
                  "nodeagent/keys.py")
    assert _read_key_file(written.server_public) == (keys.server_public(str(tmp_path)), None), \
        _one_line(["the documented rule does not read server.key as the daemon does"], "nodeagent/keys.py")
    assert len(public) == 40, _one_line([f"keys are said to be 40 Z85 characters; this one has {len(public)}"],
                                        "nodeagent/keys.py")


def test_the_checker_sees_what_it_checks():
    """The parser finds a message section, its rows and their cells, so that the
    checks above cannot pass by reading nothing."""
    sample = ("## Requests\n### `release` (request)\nText.\n\n| field | type | default | meaning |\n"
              "| --- | --- | --- | --- |\n| `grant` | `int` | required | the grant \\| id |\n"
              "### `SessionInfo`\n| field | type | default | meaning |\n|---|---|---|---|\n"
              "| `state` | `str` | required | x |\n")
    parsed = {(s.kind, s.name): s for s in doc_sections(sample)}
    assert parsed[("request", "release")].rows == {"grant": ["`int`", "required", "the grant | id"]}
    assert parsed[("struct", "SessionInfo")].rows["state"][0] == "`str`"
    shapes = code_structs()
    assert shapes[("request", "release")].fields["grant"] == ("int", "required")
    assert shapes[("request", "release")].fields["requeue"] == ("bool", "`false`")
    assert shapes[("daemon", "welcome")].fields["cuda_ordinal"] == ("int | nil", "`nil`")
    assert ("daemon", "drain") in shapes and ("request", "drain") in shapes  # one op, both directions
    assert "E_PARTITION" in code_errors()


# ------------------------------------------------------- the framing example, on the wire

_HEX_LINE = re.compile(r"^\s*((?:[0-9a-f]{2}\s+)*[0-9a-f]{2})\s*$")


def framing_example(text: str) -> tuple[bytes, int, int]:
    """The bytes of the example under "## Framing", as written (header and body), and the
    lengths its caption states: (bytes, the N it names, the body bytes it says it counts)."""
    section = text[text.index("## Framing"):]
    section = section[:section.index("\n## ", 1)]
    block = section[section.index("```") + 3:]
    block = block[block.index("\n") + 1:block.index("```")]
    lines = block.splitlines()
    hex_line = next(line for line in lines if _HEX_LINE.match(line))
    caption = "\n".join(lines[lines.index(hex_line) + 1:])
    n_said = re.search(r"N = (\d+)", caption)
    body_said = re.search(r"(\d+) bytes", caption)
    assert n_said and body_said, f"docs/protocol.md: the framing example's caption names no N or byte count: {caption!r}"
    return bytes.fromhex(hex_line), int(n_said[1]), int(body_said[1])


def test_the_framing_example_is_what_a_daemon_answers_byte_for_byte(text, inproc_daemon):
    """A reader of docs/protocol.md sends the framing example as written: the daemon must
    answer it (status_reply, id 1), and read exactly that frame, so that the same bytes sent
    again are a second whole request rather than a stream two bytes out of step."""
    example, n_said, body_said = framing_example(text)
    d = inproc_daemon
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(d.socket_path)
        for _ in range(2):
            sock.sendall(example)
            got = b""
            while len(got) < 4:
                got += sock.recv(4 - len(got))
            (size,) = struct.unpack(">I", got)
            reply = b""
            while len(reply) < size:
                reply += sock.recv(size - len(reply))
            answer = msgspec.msgpack.decode(reply)
            assert answer.get("op") == "status_reply" and answer.get("id") == 1, (
                f"the daemon answered docs/protocol.md's framing example with {answer.get('op')} "
                f"{answer.get('code', '')}: {answer.get('message', '')}")
    (n,) = struct.unpack(">I", example[:4])
    assert n_said == body_said == n, (f"docs/protocol.md's framing example: the caption says N = {n_said} and "
                                      f"{body_said} bytes; the header says {n}")


def test_the_framing_example_reader_reads_the_doc():
    sample = ("## Framing (local endpoint)\n\n  ```\n  00 00 00 02  81 01\n  \\_ N = 2 _/ \\_ x: 2 bytes _/\n  ```\n"
              "\n## Next\n")
    assert framing_example(sample) == (b"\x00\x00\x00\x02\x81\x01", 2, 2)


def test_both_docs_name_the_socket_type_the_events_are_published_on(text):
    """cluster.md once said PUB and protocol.md XPUB; the code's is the one to name."""
    from nodeagent.daemon.cluster import ClusterEndpoint
    made = re.search(r"self\._events_sock = self\._curve_socket\(zmq\.([A-Z]+)", inspect.getsource(ClusterEndpoint.bind))
    assert made, "ClusterEndpoint.bind no longer makes the events socket as this test reads it"
    kind = made.group(1)
    cluster_doc = (DOC.parent / "cluster.md").read_text()
    row = next(line for line in cluster_doc.splitlines() if line.startswith("| events |"))
    assert re.search(rf"\| {kind}, CURVE", row), row
    assert f"on the {kind} socket" in text
    for doc, words in (("cluster.md", row), ("protocol.md", text)):
        other = {"PUB", "XPUB"} - {kind}
        assert not any(re.search(rf"(?<![A-Z]){o}\b[ ,]", words) for o in other), f"{doc} names another socket type"


def test_the_doc_lists_the_default_endpoints_in_the_order_a_client_picks_them(text, monkeypatch, tmp_path):
    from client_lib import endpoint
    section = text[text.index("**Which endpoint a client uses.**"):]
    items = re.findall(r"^  (\d)\. (.*(?:\n     .*)*)", section, re.M)[:4]
    assert [n for n, _ in items] == ["1", "2", "3", "4"], items
    said = [" ".join(body.split()) for _, body in items]
    assert "NODEAGENT_ENDPOINT" in said[0] and endpoint.SYSTEM_SOCKET in said[1]
    assert "XDG_RUNTIME_DIR" in said[2] and "nodeagent-$UID" in said[3]
    # What client_lib does, in that order: the environment first, then by who and what exists.
    monkeypatch.setenv("NODEAGENT_ENDPOINT", "ipc:///somewhere/else.sock")
    assert endpoint.client_endpoint() == "ipc:///somewhere/else.sock"
    monkeypatch.delenv("NODEAGENT_ENDPOINT")
    if os.geteuid() == 0 or os.path.isdir(os.path.dirname(endpoint.SYSTEM_SOCKET)):
        assert endpoint.client_endpoint() == "ipc://" + endpoint.SYSTEM_SOCKET
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert endpoint.user_socket_path() == str(tmp_path / "nodeagent" / "agent.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert endpoint.user_socket_path().endswith(f"/nodeagent-{os.getuid()}/agent.sock")


def test_the_doc_says_a_requeue_can_get_the_token_straight_back(sections):
    """Fair order decides where a requeued session stands: with less GPU time per weight
    than the one waiting, its release(requeue) grants it the token again at once."""
    from sharing import Grant, TokenScheduler, Workload
    sched = TokenScheduler(0)
    for sid in ("a", "b"):
        sched.add_session(sid, Workload.parse("training"), 1.0, 0.0)
    sched.request("b", 0.0)
    sched.request("a", 0.01)
    (to_a,) = sched.release("b", 1, 0.1)  # b has had 0.1 s
    sched.request("b", 0.11)
    again = sched.release("a", to_a.grant, 0.12, requeue=True)  # a has had 0.02 s: still first
    assert [(g.session, g.grant) for g in again if isinstance(g, Grant)] == [("a", to_a.grant + 1)]
    row = next(line for line in DOC.read_text().splitlines() if line.startswith("| `requeue` |"))
    assert "straight back" in row and "fair order" in row, row
