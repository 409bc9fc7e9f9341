"""The daemon's footprint on the host: socket directory, single-instance lock,
socket permissions, and systemd readiness."""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import socket

from client_lib.endpoint import SYSTEM_SOCKET

log = logging.getLogger("nodeagent.runtime")

SOCKET_MODE = 0o660
SOCKET_GROUP = "nodeagent"


class AlreadyRunningError(RuntimeError):
    """Another daemon holds the lock of this endpoint."""


class InstanceLock:
    """An flock held for the daemon's lifetime on ``path``.

    On ``<socket>.lock`` it tells a stale socket file (left by a crash: safe to
    remove) from a live one (another daemon serves it: refuse to start); on the
    state dir it keeps two daemons from sharing one journal."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise AlreadyRunningError(
                    f"another nodeagent (pid {holder}) holds the {self.what} lock {self.path}; "
                    "stop it first, or give this one its own --endpoint and --state-dir") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def prepare_socket_dir(socket_path: str) -> None:
    """Create the socket's directory: 0750 (group nodeagent) for the system
    daemon, 0700 for a per-user one."""
    directory = os.path.dirname(socket_path) or "."
    system = os.geteuid() == 0
    os.makedirs(directory, mode=0o750 if system else 0o700, exist_ok=True)
    gid = socket_gid() if system else None
    if gid is not None:
        try:
            os.chown(directory, 0, gid)
        except OSError as exc:
            log.warning("[runtime] cannot chown %s to group %s: %s", directory, SOCKET_GROUP, exc)


def remove_stale_socket(socket_path: str) -> None:
    try:
        os.unlink(socket_path)
        log.info("[runtime] removed stale socket %s", socket_path)
    except FileNotFoundError:
        pass


def secure_socket(socket_path: str) -> None:
    """Mode 0660 and, where the group exists and we may, group nodeagent."""
    os.chmod(socket_path, SOCKET_MODE)
    if os.geteuid() != 0:
        return
    gid = socket_gid()
    if gid is None and os.path.dirname(socket_path) == os.path.dirname(SYSTEM_SOCKET):
        log.warning("[runtime] group %s does not exist: only root can use %s (create it with "
                    "systemd-sysusers or groupadd, and add client users to it)", SOCKET_GROUP, socket_path)
        return
    if gid is not None:
        os.chown(socket_path, 0, gid)


def socket_gid() -> int | None:
    try:
        return grp.getgrnam(SOCKET_GROUP).gr_gid
    except KeyError:
        return None


def notify_systemd(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to systemd when run as Type=notify.

    Like sd_notify(3), a notification that cannot be delivered is logged, not fatal."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("[runtime] cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True
