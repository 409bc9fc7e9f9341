"""Open a file a peer named with that peer's rights, never the daemon's (:func:`open_as`: a forked
child becomes the peer and passes the descriptor back over SCM_RIGHTS). Why not a mode-bit
check: docs/internals.md.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat

from ctxpool.messages import PeerIdentity

OPEN_TIMEOUT_S = 10.0  # a path on a hung network mount must not hang the worker forever
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


class PeerOpenError(Exception):
    """The file cannot be opened with the peer's rights; ``str()`` is a sentence for the
    peer, ``errno`` what open(2) said to it."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(message)
        self.errno = code


def identity_of(uid: int, gid: int, pid: int | None) -> PeerIdentity:
    """The peer's identity: SO_PEERCRED's uid and gid, and the supplementary groups of
    process ``pid`` from /proc. If the process is gone or no longer that user (pid
    reused), no supplementary groups: fewer rights, never more."""
    groups: list[int] = []
    if pid is not None:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            uids = [int(v) for v in fields["Uid"].split()]
            gids = [int(v) for v in fields["Gid"].split()]
            if uids[0] == uid and uids[1] == uid and gids[1] == gid:
                groups = sorted({int(v) for v in fields.get("Groups", "").split()})
        except (OSError, KeyError, ValueError, IndexError):
            groups = []
    return PeerIdentity(uid=uid, gid=gid, groups=groups)


def open_as(path: str, reader: PeerIdentity | None, timeout_s: float = OPEN_TIMEOUT_S) -> int:
    """A read-only descriptor of the regular file ``path``, opened with ``reader``'s
    rights (None, or uid 0: this process's own). Raises :class:`PeerOpenError`."""
    uid = os.geteuid() if reader is None else reader.uid
    if reader is None or reader.uid == 0 or (reader.uid == os.geteuid() and os.geteuid() != 0):
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise PeerOpenError(exc.errno, _opening_failed(path, uid, exc.errno)) from None
    elif os.geteuid() != 0:
        raise PeerOpenError(errno.EPERM, f"this daemon runs as uid {os.geteuid()} and cannot open files with "
                                         f"the rights of uid {reader.uid}; run it as root, or as that user")
    else:
        fd = _open_in_child(path, reader, timeout_s)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PeerOpenError(errno.EINVAL, f"weights path {path} is not a regular file")
        os.set_blocking(fd, True)
        os.set_inheritable(fd, False)  # one received over SCM_RIGHTS is not close-on-exec
    except BaseException:
        os.close(fd)
        raise
    return fd


def _opening_failed(path: str, uid: int, code: int | None) -> str:
    if code == errno.ENOENT:  # as that user sees it: one it may not search gets EACCES instead
        return f"weights file {path} does not exist"
    return f"weights file {path} cannot be opened with the rights of uid {uid}: {os.strerror(code or 0)}"


def _open_in_child(path: str, reader: PeerIdentity, timeout_s: float) -> int:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.fork()
        if pid == 0:  # the child: become the peer, open, hand the fd over, exit
            _child(theirs, path, reader)
        theirs.close()
        message, fds = b"", []
        try:
            ours.settimeout(timeout_s)
            message, fds, _, _ = socket.recv_fds(ours, 16, 1)
        except OSError:  # socket.timeout included
            pass
        finally:  # one that answered is exiting; one that did not (stuck in open(2) on a hung mount) is killed
            if not message:
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        ours.close()
        theirs.close()
    if message == b"K" and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    if message.startswith(b"E") and message[1:].isdigit():
        raise PeerOpenError(int(message[1:]), _opening_failed(path, reader.uid, int(message[1:])))
    raise PeerOpenError(errno.EIO, f"weights file {path}: the process opening it with the rights of uid "
                                   f"{reader.uid} gave no answer (killed, or stuck over {timeout_s:g} s)")


def _child(sock: socket.socket, path: str, reader: PeerIdentity) -> None:
    code = 0
    try:
        try:
            os.setgroups(list(reader.groups))
            os.setgid(reader.gid)
            os.setuid(reader.uid)  # real, effective and saved: no way back
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            sock.send(b"E%d" % (exc.errno or errno.EIO))
        else:
            socket.send_fds(sock, [b"K"], [fd])
    except BaseException:  # noqa: BLE001 - whatever happens, never return into the parent's code
        code = 1
    finally:
        os._exit(code)
