"""The shipped systemd unit, and a reader of unit files (a key may come more than once)."""

from __future__ import annotations

from tests.conftest import REPO


UNIT = REPO / "systemd" / "nodeagent.service"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}``; systemd allows a key more than once."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if not sep or current is None:
            raise ValueError(f"not a unit file line: {raw!r}")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections
