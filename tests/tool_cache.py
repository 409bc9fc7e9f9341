"""A cache of tools the tests fetch once (tests/k8s/k8s_tools.py, tests/prom_tools.py): a folder
under ``.venv`` (git-ignored with it), a lock so that two test processes do not fetch at once,
and :class:`ToolMissing` for a tool that cannot be had here, whose message the tests skip with."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable


class ToolMissing(RuntimeError):
    """A tool that cannot be had here; the message says why."""


class ToolCache:
    """Binaries ``names`` kept in ``root/bin``, all fetched together by ``fetch`` when one is missing."""

    def __init__(self, root: Path, names: Iterable[str], fetch: Callable[[], None]) -> None:
        self.root = root
        self.binaries = {name: root / "bin" / name for name in names}
        self._fetch = fetch

    @contextmanager
    def locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def tool(self, name: str) -> Path:
        path = self.binaries[name]
        if not path.exists():
            with self.locked():
                if not path.exists():
                    self._fetch()
        return path

    def install(self, name: str, data: bytes) -> None:
        """Write ``name``'s binary whole or not at all: a killed fetch leaves no half binary."""
        path = self.binaries[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(".part")
        staged.write_bytes(data)
        staged.chmod(0o755)
        staged.replace(path)
