"""Wake when a name appears in or leaves a directory: inotify(7) through libc.

The plugin watches the kubelet's device-plugins directory: a restarted kubelet removes
the plugins' sockets there and creates ``kubelet.sock`` anew, and the plugin must serve
and register again. Where inotify cannot be had (no such directory yet, no libc symbol,
the watch limit reached), :meth:`DirWatch.fileno` is None and the caller looks by
itself at a bounded interval; the watch is tried again each time.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct

log = logging.getLogger("nodeagent.k8s")

IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_IGNORED = 0x8000
_MASK = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
_READ_BYTES = 64 * 1024


class DirWatch:
    """Names created, deleted or moved in ``path``, read from an inotify descriptor."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._warned = False
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._libc.inotify_init1  # noqa: B018 (a missing symbol raises here)
        except (OSError, AttributeError):
            self._libc = None
        self.ensure()

    def ensure(self) -> bool:
        """Watch the directory if not yet (it may have been created since); True when watching."""
        if self._fd is not None:
            return True
        if self._libc is None:
            return False
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            self._warn(ctypes.get_errno())
            return False
        if self._libc.inotify_add_watch(fd, os.fsencode(self.path), _MASK) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            if err != errno.ENOENT:
                self._warn(err)
            return False
        self._fd = fd
        return True

    def _warn(self, err: int) -> None:
        if not self._warned:
            self._warned = True
            log.warning("[k8s] cannot watch %s with inotify (%s); looking at it every check interval instead",
                        self.path, os.strerror(err))

    def fileno(self) -> int | None:
        return self._fd

    def read(self) -> list[tuple[int, str]]:
        """(mask, name) of what happened since the last read; [] if nothing. A watch that ended
        (the directory removed or moved) is dropped, to be made again by :meth:`ensure`."""
        if self._fd is None:
            return []
        try:
            data = os.read(self._fd, _READ_BYTES)
        except BlockingIOError:
            return []
        events, at = [], 0
        while at + _EVENT.size <= len(data):
            _, mask, _, length = _EVENT.unpack_from(data, at)
            name = data[at + _EVENT.size: at + _EVENT.size + length].split(b"\0", 1)[0]
            at += _EVENT.size + length
            events.append((mask, os.fsdecode(name)))
            if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                self.close()
                break
        return events

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
