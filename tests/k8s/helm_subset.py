"""Render a Helm chart's templates without helm, for CI machines that have none: only the
subset of Go template syntax the nodeagent chart uses (value paths, ``include``, ``toYaml``,
``nindent``/``indent``, ``quote``, ``default``, ``if``/``else``/``end``, ``define``,
``range $key, $value := .Values.MAP`` over a map, comments and whitespace trimming), with the
values checked against ``values.schema.json`` as helm checks them. Anything else raises
:class:`Unsupported`, naming the action, so a template that outgrows the subset fails here
rather than rendering wrongly. Where helm can be had (tests/k8s/k8s_tools.py) the tests run
``helm template`` too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_RANGE = re.compile(r"range \$(\w+), \$(\w+) := (\.\S+)$")


class Unsupported(ValueError):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", a), with ``{{-`` / ``-}}`` trimming applied to the text around."""
    out: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(text):
        chunk = text[pos:m.start()]
        if trim_next:
            chunk = chunk.lstrip()
        if m.group(1):
            chunk = chunk.rstrip()
        out.append(("text", chunk))
        out.append(("action", m.group(2)))
        trim_next = bool(m.group(3))
        pos = m.end()
    tail = text[pos:]
    out.append(("text", tail.lstrip() if trim_next else tail))
    return out


def _tree(tokens):
    """Nest if/else/define blocks: a list of str | ("expr", a) | ("if", cond, then, else) | ("define", name, body)."""
    root: list = []
    stack: list[tuple[str, list, object]] = [("root", root, None)]
    for kind, value in tokens:
        body = stack[-1][1]
        if kind == "text":
            body.append(value)
            continue
        word = value.split(None, 1)[0] if value else ""
        if value.startswith("/*"):
            continue
        if word == "if":
            node = ["if", value[3:].strip(), [], []]
            body.append(node)
            stack.append(("if", node[2], node))
        elif word == "else":
            if stack[-1][0] != "if":
                raise Unsupported("else outside an if")
            stack[-1] = ("else", stack[-1][2][3], stack[-1][2])
        elif word == "range":
            m = _RANGE.match(value)
            if m is None:
                raise Unsupported(f"{{{{ {value} }}}} (only range $key, $value := .PATH)")
            node = ["range", m.group(1), m.group(2), m.group(3), []]
            body.append(node)
            stack.append(("range", node[4], node))
        elif word == "define":
            node = ["define", json.loads(value[7:].strip()), []]
            body.append(node)
            stack.append(("define", node[2], node))
        elif word == "end":
            if len(stack) == 1:
                raise Unsupported("end without a block")
            stack.pop()
        elif word in ("with", "template", "block", "tpl"):
            raise Unsupported(f"{{{{ {value} }}}}")
        else:
            body.append(("expr", value))
    if len(stack) != 1:
        raise Unsupported(f"unclosed {stack[-1][0]}")
    return root


def _truthy(value) -> bool:
    return value not in (None, False, 0, "", [], {})


class Chart:
    def __init__(self, path: str | Path, *, release: str = "nodeagent", namespace: str = "nodeagent-system",
                 values: dict | None = None) -> None:
        self.path = Path(path)
        self.meta = yaml.safe_load((self.path / "Chart.yaml").read_text())
        self.values = yaml.safe_load((self.path / "values.yaml").read_text())
        if values:
            self.values = _merge(self.values, values)
        schema = self.path / "values.schema.json"
        if schema.exists():  # as helm does before it renders
            import jsonschema
            jsonschema.validate(self.values, json.loads(schema.read_text()))
        self.variables: dict[str, object] = {}  # $key and $value inside a range
        self.root = {"Values": self.values, "Release": {"Name": release, "Namespace": namespace},
                     "Chart": {"Name": self.meta["name"], "Version": self.meta["version"],
                               "AppVersion": self.meta.get("appVersion", "")}}
        self.defines: dict[str, list] = {}
        self.used: set[str] = set()  # value paths the templates read
        for tpl in sorted((self.path / "templates").glob("_*.tpl")):
            self._collect(_tree(_tokens(tpl.read_text())))

    def _collect(self, nodes) -> None:
        for node in nodes:
            if isinstance(node, list) and node[0] == "define":
                self.defines[node[1]] = node[2]

    def render(self) -> dict[str, str]:
        """Template file name -> rendered text, for every template but the helpers."""
        out = {}
        for tpl in sorted((self.path / "templates").iterdir()):
            if tpl.name.startswith("_"):
                continue
            out[tpl.name] = self._run(_tree(_tokens(tpl.read_text())))
        return out

    def _run(self, nodes) -> str:
        parts = []
        for node in nodes:
            if isinstance(node, str):
                parts.append(node)
            elif node[0] == "expr":
                parts.append(self._pipeline(node[1]))
            elif node[0] == "if":
                parts.append(self._run(node[2] if _truthy(self._value(node[1])) else node[3]))
            elif node[0] == "range":
                mapping = self._value(node[3]) or {}
                if not isinstance(mapping, dict):
                    raise Unsupported(f"range over {node[3]}, which is not a map")
                for key in sorted(mapping):  # Go's templates range over a map in key order
                    self.variables[node[1]], self.variables[node[2]] = key, mapping[key]
                    parts.append(self._run(node[4]))
            elif node[0] == "define":
                self.defines[node[1]] = node[2]
        return "".join(parts)

    def _pipeline(self, text: str) -> str:
        stages = [s.strip() for s in text.split("|")]
        value = self._call(stages[0])
        for stage in stages[1:]:
            name, _, arg = stage.partition(" ")
            if name == "quote":
                value = json.dumps(_scalar(value))
            elif name in ("nindent", "indent"):
                pad = " " * int(arg)
                value = ("\n" if name == "nindent" else "") + "\n".join(
                    pad + line if line else line for line in str(value).splitlines())
            else:
                raise Unsupported(f"function {name!r} in {{{{ {text} }}}}")
        return value if isinstance(value, str) else _scalar(value)

    def _call(self, text: str):
        words = text.split()
        if words[0] == "include":
            return self._run(self.defines[json.loads(words[1])]).strip("\n")
        if words[0] == "toYaml":
            return yaml.safe_dump(self._value(words[1]), default_flow_style=False, sort_keys=False).rstrip("\n")
        if words[0] == "default":
            fallback, value = self._value(words[1]), self._value(words[2])
            return value if _truthy(value) else fallback
        if len(words) == 1:
            return self._value(words[0])
        raise Unsupported(f"{{{{ {text} }}}}")

    def _value(self, ref: str):
        if ref.startswith("$") and ref[1:] in self.variables:
            return self.variables[ref[1:]]
        if not ref.startswith("."):
            raise Unsupported(f"{ref!r} (only .Values, .Release and .Chart paths)")
        node = self.root
        parts = ref[1:].split(".")
        if parts[0] == "Values":
            self.used.add(".".join(parts[1:]))
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                raise KeyError(f"{ref} is not set (values.yaml or Chart.yaml)")
            node = node[part]
        return node


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
