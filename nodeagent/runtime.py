"""The daemon's footprint on the host: socket directory, single-instance lock,
socket permissions, and systemd readiness."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import logging
import os
import socket

from client_lib.endpoint import SOCKET_GROUP, SYSTEM_SOCKET

log = logging.getLogger("nodeagent.runtime")

SOCKET_MODE = 0o660


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
        # The file is removed at a clean stop (release(unlink=True)): a lock taken on a file
        # that was unlinked meanwhile guards nothing, so it is taken again on the new one.
        for _ in range(8):
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
            if _same_file(fd, self.path):
                break
            os.close(fd)
        else:
            raise AlreadyRunningError(f"the {self.what} lock {self.path} keeps being replaced; is another "
                                      "nodeagent starting and stopping there?")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, unlink: bool = False) -> None:
        """Let the lock go; ``unlink``: remove its file first (a clean stop leaves nothing)."""
        if self._fd is not None:
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def prepare_socket_dir(socket_path: str) -> bool:
    """Create the socket's directory if it is missing: 0750 and group nodeagent for
    the system daemon, 0700 for a per-user one; returns whether this call made it.

    A directory that exists is left as it is (whoever made it chose its group and
    mode), unless systemd made it for this daemon (``RuntimeDirectory=``, named in
    ``$RUNTIME_DIRECTORY``): that one gets the group as if the daemon had made it."""
    directory = os.path.dirname(socket_path) or "."
    system = os.geteuid() == 0
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)  # parents made here get the default mode: they are not the daemon's
    try:
        os.mkdir(directory, 0o750 if system else 0o700)
        made = True
    except FileExistsError:
        made = False
        if not _made_by_systemd(directory):
            return False
    gid = socket_gid() if system else None
    try:
        if gid is not None:
            os.chown(directory, 0, gid)
        os.chmod(directory, 0o750 if system else 0o700)  # not what the umask left
    except OSError as exc:
        log.warning("[runtime] cannot give %s group %s: %s", directory, SOCKET_GROUP, exc.strerror)
    log.info("[runtime] %s %s mode %s group %s", "created" if made else "systemd's runtime directory",
             directory, "0750" if system else "0700", group_name(os.stat(directory).st_gid))
    return made


def _made_by_systemd(directory: str) -> bool:
    """Whether ``directory`` is one systemd made for this service (RuntimeDirectory=)."""
    named = os.environ.get("RUNTIME_DIRECTORY", "")
    real = os.path.realpath(directory)
    return any(d and os.path.realpath(d) == real for d in named.split(":"))


def remove_empty_dir(directory: str) -> None:
    """Remove ``directory`` if nothing is left in it (a clean stop); else leave it, logged."""
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.info("[shutdown] %s left in place: %s", directory, exc.strerror)


def remove_stale_socket(socket_path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
        log.info("[runtime] removed stale socket %s", socket_path)


def secure_socket(socket_path: str) -> int:
    """Mode 0660 and, for a root daemon where the group exists, group nodeagent;
    logs who may connect, and returns the socket's gid (what the pace boards get too)."""
    os.chmod(socket_path, SOCKET_MODE)
    if os.geteuid() != 0:
        gid = os.stat(socket_path).st_gid
        log.info("[runtime] socket %s mode 0660 user %d group %s: this user may connect",
                 socket_path, os.geteuid(), group_name(gid))
        return gid
    gid = socket_gid()
    if gid is None:
        gid = os.stat(socket_path).st_gid
        # A warning where clients look for the system daemon; a socket put elsewhere was placed on purpose.
        system_path = os.path.dirname(socket_path) == os.path.dirname(SYSTEM_SOCKET)
        log.log(logging.WARNING if system_path else logging.INFO, "[runtime] group %s does not exist: socket %s keeps group %s, so only root%s can use it "
                    "(create the group with systemd-sysusers or groupadd, add client users to it, and restart "
                    "the daemon)", SOCKET_GROUP, socket_path, group_name(gid),
                    "" if gid == 0 else f" and group {group_name(gid)}")
        return gid
    os.chown(socket_path, 0, gid)
    log.info("[runtime] socket %s mode 0660 group %s: root and members of %s may connect",
             socket_path, group_name(gid), group_name(gid))
    return gid


def group_name(gid: int) -> str:
    """``name`` (gid N), or the number alone for a gid with no name here."""
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


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
