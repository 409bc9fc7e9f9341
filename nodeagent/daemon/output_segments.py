"""Output segments the daemon's workers made for one client session, until they are gone.

A worker makes each ``infer`` output owned by the client's verified uid (mode 0600), for the
client to read and unlink; what it never unlinks the daemon unlinks when the session ends, and
since unread outputs hold host memory, a session may keep only :data:`MAX_UNREAD` at a time. The
daemon unlinks only names it handed out, and only while they still belong to the uid it made them
for (a name the client unlinked and someone else reused is left alone).
"""

from __future__ import annotations

import os
import re

from client_lib import protocol as p
from client_lib import tensors

MAX_UNREAD = 64  # outputs a session may leave unread before its next infer is refused


class OutputSegments:
    """The output segments handed to one session and not yet seen gone."""

    def __init__(self, uid: int | None) -> None:
        self.uid = uid  # what the worker made them owned by; None: the daemon's own user
        self._names: dict[str, None] = {}  # insertion-ordered set

    def handed(self, refs: list[p.TensorRef]) -> None:
        for name in dict.fromkeys(r.shm for r in refs if r.shm):
            self._names[name] = None

    def unread(self) -> int:
        """How many are still in /dev/shm (forgetting those the client unlinked)."""
        for name in [n for n in self._names if not _exists(n)]:
            del self._names[name]
        return len(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def release(self) -> int:
        """Unlink every one still there (the session ended); returns how many."""
        owners = {self.uid if self.uid is not None else os.geteuid()}
        if os.geteuid() != 0:
            owners.add(os.geteuid())  # a non-root worker could not give them away
        removed = 0
        for name in self._names:
            if any(tensors.unlink_if_owned(name, uid) for uid in owners):
                removed += 1
        self._names.clear()
        return removed


def orphans_of(worker_pid: int, prefix: str, handed: list[OutputSegments]) -> list[str]:
    """Output segments a dead worker made that nobody was handed (it died between
    making one and reporting it): the daemon's to unlink."""
    pattern = re.compile(rf"^{re.escape(prefix)}-{worker_pid}-")
    try:
        names = os.listdir(tensors.SHM_DIR)
    except OSError:
        return []
    return [n for n in names if pattern.match(n) and not any(n in h for h in handed)]


def _exists(name: str) -> bool:
    try:
        os.lstat(os.path.join(tensors.SHM_DIR, name))
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True
