"""The daemon's poller and timers: what the loop waits on and what it wakes for.

:class:`EventLoopPoller` is one epoll set over plain descriptors and ZeroMQ sockets, shaped like
:class:`zmq.Poller`, and the one registry of readable sources (each target with its :class:`Reader`);
:class:`Timers` is the one list of timed components (:class:`Timed`). :class:`LocalEndpoint` is the
loop's own source of requests: a unix stream socket (or TCP, unverified) speaking
:mod:`client_lib.framing`; it owns the listener and connections and bounds what a peer can make the
daemon hold. Its bounds: docs/architecture.md; detail: docs/internals.md.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Protocol, Union

import zmq

from client_lib import codec
from client_lib import framing
from client_lib import protocol as p
from nodeagent import procwatch, runtime

POLLIN = select.EPOLLIN
POLLOUT = select.EPOLLOUT
_HANGUP = select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP

Target = Union[int, zmq.Socket]


@dataclass(frozen=True, slots=True)
class Reader:
    """What the loop runs when a registered target is readable: ``on_ready(target, events)``,
    contained under ``where`` (the ``nodeagent_internal_errors_total`` label of its bugs)."""

    where: str
    on_ready: Callable[[Target, int], None]


class EventLoopPoller:
    """Waits on descriptors (ints) and ZeroMQ sockets, each registered with its :class:`Reader`,
    what the loop runs when it is ready: one lookup per ready target."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._fds: dict[int, int] = {}  # plain fd -> registered events
        self._zmq: dict[int, zmq.Socket] = {}  # zmq FD -> socket (readable interest only)
        self._readers: dict[Target, Reader] = {}  # every registered target -> what runs when it is ready

    def register(self, target: Target, events: int = POLLIN, *, on_ready: Callable[[Target, int], None],
                 where: str) -> None:
        """Watch ``target`` for ``events``; the loop runs ``on_ready(target, events)`` when it is
        ready, a bug in it counted under ``where``. Registering a plain descriptor again changes both."""
        if isinstance(target, zmq.Socket):
            fd = target.getsockopt(zmq.FD)
            self._zmq[fd] = target
            self._epoll.register(fd, select.EPOLLIN)
        else:
            mask = _epoll_mask(events)
            if target in self._fds:
                self._epoll.modify(target, mask)
            else:
                self._epoll.register(target, mask)
            self._fds[target] = events
        self._readers[target] = Reader(where, on_ready)

    def reader(self, target: Target) -> Reader | None:
        """What runs when ``target`` is ready (None: not registered, or unregistered since the wait)."""
        return self._readers.get(target)

    def modify(self, fd: int, events: int) -> None:
        """Change what a plain descriptor is watched for (e.g. add POLLOUT while output is queued)."""
        if self._fds.get(fd) != events:
            self._epoll.modify(fd, _epoll_mask(events))
            self._fds[fd] = events

    def unregister(self, target: Target) -> None:
        """Stop watching ``target``; one not watched (unregistered already) is let be."""
        if self._readers.pop(target, None) is None:
            return
        if isinstance(target, zmq.Socket):
            fd = next(f for f, s in self._zmq.items() if s is target)
            del self._zmq[fd]
        else:
            fd = target
            del self._fds[fd]
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):
            pass  # closed already: the kernel dropped it from the set

    def __contains__(self, target: Target) -> bool:
        return target in self._readers

    def poll(self, timeout_ms: int | None = None) -> list[tuple[Target, int]]:
        """Ready targets: ``(fd, events)`` for descriptors (epoll bits, hang-ups reported as POLLIN so
        the owner reads the EOF), ``(socket, POLLIN)`` for ZeroMQ sockets with a message waiting: their
        ``FD`` only signals that their state may have changed (edge-like), so ``EVENTS`` is read after
        every wait, which also finds a message that arrived while the loop was busy."""
        if self._zmq and any(s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in self._zmq.values()):
            timeout_ms = 0  # a message is already waiting: do not sleep on the edge
        timeout_s = -1 if timeout_ms is None or timeout_ms < 0 else timeout_ms / 1000.0
        out: list[tuple[Target, int]] = []
        for fd, ev in self._epoll.poll(timeout_s):  # EINTR is retried for us (PEP 475)
            if fd in self._zmq:
                continue  # read below, from EVENTS
            if ev & _HANGUP:
                ev |= POLLIN
            out.append((fd, ev))
        for sock in self._zmq.values():
            try:
                if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    out.append((sock, POLLIN))
            except zmq.ZMQError:
                pass  # closed under us; its owner unregisters it
        return out

    def close(self) -> None:
        self._epoll.close()


class Timed(Protocol):
    """A component with timers: when it next has something to do, and doing what is due."""

    def next_deadline(self, now: float) -> float | None:
        """The loop's clock when :meth:`on_timers` next has something to do (None: nothing pending)."""

    def on_timers(self, now: float) -> None:
        """Act on what is due at ``now`` (run after every loop turn, due or not)."""


@dataclass(frozen=True, slots=True)
class Timer:
    """A timed duty of the loop's owner itself, as a :class:`Timed` (the liveness check)."""

    next_deadline: Callable[[float], float | None]
    on_timers: Callable[[float], None]


class Timers(list[tuple[str, Timed]]):
    """The one list of timed components, each with the place a bug in its timers is counted under:
    pairs ``(where, timed)``, whose timers run in the list's order."""

    def next_deadline(self, now: float) -> float | None:
        """The earliest deadline of any of them (None: nothing pending)."""
        due = [timed.next_deadline(now) for _, timed in self]
        return min((at for at in due if at is not None), default=None)


def _epoll_mask(events: int) -> int:
    """epoll's bits for ``events`` (POLLIN and POLLOUT are epoll's own), with the peer's hang-up where POLLIN is."""
    return events & (POLLIN | POLLOUT) | (select.EPOLLRDHUP if events & POLLIN else 0)


# ------------------------------------------------------------------ the local endpoint

log = logging.getLogger("nodeagent.local")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # <asm-generic/socket.h>, Linux 6.5
_READ_CHUNK = 64 * 1024
_READ_BUDGET = 256 * 1024  # per connection per wake-up
_FRAME_BUDGET = 32  # frames handled per connection per loop turn; the rest wait for the next
_ACCEPT_BUDGET = 64  # connections accepted per wake-up


class Peer:
    """One client connection. Its identity (``creds``) is the kernel's word,
    read when it connected; None over TCP."""

    __slots__ = ("sock", "fd", "creds", "frames", "backlog", "out", "closed", "__weakref__")

    def __init__(self, sock: socket.socket, creds: procwatch.PeerCredentials | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.creds = creds
        self.frames = framing.FrameBuffer(p.MAX_REQUEST_BYTES, skip_up_to_bytes=framing.MAX_DAEMON_FRAME_BYTES)
        self.backlog: collections.deque = collections.deque()  # frames read, not yet handled (over a turn's budget)
        self.out = bytearray()  # bytes the kernel has not taken yet
        self.closed = False

    def __repr__(self) -> str:
        who = f"pid={self.creds.pid} uid={self.creds.uid}" if self.creds else "unverified"
        return f"<peer fd={self.fd} {who}>"


class LocalEndpoint:
    """Listens on ``endpoint`` and turns bytes into frames for ``on_frame(peer,
    body)``; ``on_close(peer, reason)`` once a connection is gone (reasons:
    ``closed``, ``not_reading``, ``bad_frame``, ``shutdown``)."""

    def __init__(self, endpoint: str, poller: EventLoopPoller,
                 on_frame: Callable[[Peer, bytes], None], on_close: Callable[[Peer, str], None], *,
                 max_connections: int = 4096, max_connections_per_uid: int = 1024,
                 max_queued_bytes: int = 4 * 1024 * 1024,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.endpoint = endpoint
        self._poller = poller
        self._on_frame = on_frame
        self._on_close = on_close
        self._on_refused = on_refused or (lambda reason: None)
        self.max_connections = max_connections
        self.max_connections_per_uid = max_connections_per_uid
        self.max_queued_bytes = max_queued_bytes
        self._per_uid: dict[int | None, int] = {}  # connections by the peer's uid (None: unverified, over TCP)
        self._listener: socket.socket | None = None
        self._peers: dict[int, Peer] = {}
        self._reserve_fd: int | None = None
        self._rbuf = bytearray(_READ_CHUNK)  # one loop thread: one read buffer for every connection
        self._rview = memoryview(self._rbuf)
        self._backlogged: dict[int, Peer] = {}  # fd -> a connection with frames left for the next turn
        self._more_fd: int | None = None  # eventfd, readable while any connection is backlogged
        self._more_armed = False

    # ------------------------------------------------------------------ life

    def bind(self) -> None:
        """Bind and listen (:func:`listening_socket`); the caller holds the lock."""
        self._listener = sock = listening_socket(*framing.parse_endpoint(self.endpoint))
        self._poller.register(sock.fileno(), POLLIN, on_ready=self.on_ready, where="serve")
        self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._more_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller.register(self._more_fd, POLLIN, on_ready=self.on_ready, where="serve")

    def close(self, flush_s: float = 0.2) -> None:
        """Stop listening; give queued notices ``flush_s`` to leave, then close every connection."""
        if self._listener is not None:
            self._poller.unregister(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for peer in list(self._peers.values()):
            if peer.out:
                try:
                    peer.sock.settimeout(flush_s)
                    peer.sock.sendall(peer.out)
                except OSError:
                    pass
            self._drop(peer, "shutdown", notify=False)
        if self._reserve_fd is not None:
            os.close(self._reserve_fd)
            self._reserve_fd = None
        if self._more_fd is not None:
            self._poller.unregister(self._more_fd)
            os.close(self._more_fd)
            self._more_fd = None

    # ----------------------------------------------------------------- input

    def on_ready(self, fd: int, events: int) -> None:
        """The loop saw ``fd`` (the listener or a connection) ready."""
        if self._listener is not None and fd == self._listener.fileno():
            self._accept()
            return
        if fd == self._more_fd:
            self._serve_backlogs()
            return
        peer = self._peers.get(fd)
        if peer is None:
            return
        if events & POLLOUT:
            self._flush(peer)
        if events & POLLIN and not peer.closed and not peer.backlog:  # a backlogged one: in _serve_backlogs
            self._read(peer, _FRAME_BUDGET)

    def _serve_backlogs(self) -> None:
        """Once a turn while any connection has frames left: a budget of them each. One whose
        frames are all handled is read again when its socket is next ready (level-triggered)."""
        for peer in list(self._backlogged.values()):
            del self._backlogged[peer.fd]
            self._handle(peer, _FRAME_BUDGET)
        if not self._backlogged and self._more_armed:
            try:
                os.eventfd_read(self._more_fd)
            except BlockingIOError:
                pass
            self._more_armed = False

    def _handle(self, peer: Peer, budget: int) -> int:
        """Handle up to ``budget`` of ``peer``'s frames read so far; what is left waits for the
        next turn (remembered, the eventfd made readable). Returns the budget left."""
        backlog = peer.backlog
        try:
            while backlog and budget > 0 and not peer.closed:
                body = backlog.popleft()
                budget -= 1
                if type(body) is framing.Oversized:
                    self.send(peer, codec.encode(p.Error(
                        id=0, code=p.ErrorCode.BAD_REQUEST,
                        message=f"frame of {body.declared} bytes exceeds the {body.limit}-byte request limit")))
                    continue
                self._on_frame(peer, body)
        finally:  # even past a handler's bug: frames left and nobody coming back would be a hang
            if backlog and not peer.closed:
                self._backlogged[peer.fd] = peer
                if not self._more_armed:
                    os.eventfd_write(self._more_fd, 1)
                    self._more_armed = True
        return budget

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BUDGET):
            try:
                conn, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._shed_one(exc)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                raise
            if len(self._peers) >= self.max_connections:
                self._refuse(conn, f"the daemon has {len(self._peers)} connections, its limit "
                                   "(local.max_connections); close idle clients or raise it")
                continue
            creds = _peer_credentials(conn)
            uid = creds.uid if creds is not None else None
            held = self._per_uid.get(uid, 0)
            if held >= self.max_connections_per_uid:
                who = f"uid {uid}" if uid is not None else "unverified (TCP) peers"
                self._refuse(conn, f"{who} already has {held} connections, the limit per user "
                                   "(local.max_connections_per_uid); close idle clients or raise it")
                continue
            conn.setblocking(False)
            peer = Peer(conn, creds)
            self._peers[peer.fd] = peer
            self._per_uid[uid] = held + 1
            self._poller.register(peer.fd, POLLIN, on_ready=self.on_ready, where="serve")

    def _shed_one(self, exc: OSError) -> None:
        """Out of descriptors: free the reserve to accept one connection, tell it
        why, close it, and take the reserve back, so the listener does not stay
        readable with nobody able to take what waits (a busy loop)."""
        if self._reserve_fd is not None:
            os.close(self._reserve_fd)
            self._reserve_fd = None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            self._on_refused("descriptors")
        else:
            self._refuse(conn, "the daemon is out of file descriptors; retry later (raise LimitNOFILE)")
        try:
            self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._reserve_fd = None
        log.warning("[local] out of descriptors (%s); refusing connections until some close", exc)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self._on_refused(why)
        send_and_close(conn, framing.pack(codec.encode(p.Error(id=0, code=p.ErrorCode.UNAVAILABLE, message=why))))

    def _read(self, peer: Peer, frame_budget: int) -> None:
        """Read what ``peer`` sent and handle up to ``frame_budget`` frames of it. Reading stops
        once frames are left over: the kernel keeps the rest (its readiness fires again)."""
        budget = _READ_BUDGET
        while budget > 0 and not peer.closed:
            try:
                n = peer.sock.recv_into(self._rbuf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                n = 0  # reset, or any other error: closed, as an EOF is
            if not n:
                self._drop(peer, "closed")
                return
            budget -= n
            drained = n < _READ_CHUNK  # the kernel had no more: epoll (level-triggered) says when it does
            try:
                frames = peer.frames.feed(self._rview[:n])
            except framing.FrameTooLarge as exc:
                self.send(peer, codec.encode(p.Error(
                    id=0, code=p.ErrorCode.BAD_REQUEST,
                    message=f"{exc}; closing the connection (frames are a 4-byte big-endian length, then that "
                            "many bytes of MessagePack)")))
                self._flush(peer)
                self._drop(peer, "bad_frame")
                return
            peer.backlog.extend(frames)
            frame_budget = self._handle(peer, frame_budget)
            if drained or peer.backlog or not frame_budget:
                return

    # ---------------------------------------------------------------- output

    def send(self, peer: Peer, body: bytes) -> bool:
        """Queue one frame to ``peer`` and write what the kernel takes now. False (and the peer dropped,
        as ``not_reading``) past ``max_queued_bytes`` waiting: a peer that does not read cannot grow us."""
        if peer.closed:
            return False
        frame = framing.pack(body)
        if not peer.out:
            try:
                sent = peer.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(peer, "closed")
                return False
            if sent == len(frame):
                return True
            frame = frame[sent:]
        if len(peer.out) + len(frame) > self.max_queued_bytes:
            log.warning("[local] dropping %r: %d bytes queued and it does not read", peer, len(peer.out))
            self._drop(peer, "not_reading")
            return False
        if not peer.out:
            self._poller.modify(peer.fd, POLLIN | POLLOUT)
        peer.out += frame
        return True

    def _flush(self, peer: Peer) -> None:
        while peer.out:
            try:
                sent = peer.sock.send(peer.out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(peer, "closed")
                return
            del peer.out[:sent]
        self._poller.modify(peer.fd, POLLIN)

    def _drop(self, peer: Peer, reason: str, notify: bool = True) -> None:
        if peer.closed:
            return
        peer.closed = True
        peer.backlog.clear()
        self._backlogged.pop(peer.fd, None)
        if self._peers.pop(peer.fd, None) is not None:
            uid = peer.creds.uid if peer.creds is not None else None
            left = self._per_uid.get(uid, 1) - 1
            if left > 0:
                self._per_uid[uid] = left
            else:
                self._per_uid.pop(uid, None)
        self._poller.unregister(peer.fd)
        try:
            peer.sock.close()
        except OSError:
            pass
        peer.out.clear()
        if notify:
            self._on_close(peer, reason)


def listening_socket(family: int, address) -> socket.socket:
    """A non-blocking stream socket listening on ``address`` (backlog 1,024). A unix one is born 0660
    (group as :func:`nodeagent.runtime.secure_socket` sets it)."""
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    try:
        if family == socket.AF_UNIX:
            old_umask = os.umask(0o117)  # no window with looser modes
            try:
                sock.bind(address)
            finally:
                os.umask(old_umask)
            runtime.secure_socket(address)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def send_and_close(sock: socket.socket, data: bytes) -> None:
    """Tell a connection refused why, as much as the kernel takes at once, and close it."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass
    sock.close()


def _peer_credentials(conn: socket.socket) -> procwatch.PeerCredentials | None:
    """SO_PEERCRED of a unix connection: the pid, uid and gid of the process that
    connected, as the kernel recorded them. None for TCP."""
    if conn.family != socket.AF_UNIX:
        return None
    try:
        pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:
        return None
    if pid <= 0:
        return None
    return procwatch.PeerCredentials(uid=uid, gid=gid, pid=pid, namespaces=_peer_namespaces(conn, pid))


def _peer_namespaces(conn: socket.socket, pid: int) -> tuple | None:
    """The namespaces of the process that connected (:func:`procwatch.namespaces_of`), read through
    its pidfd: SO_PEERPIDFD's (Linux 6.5: that very process; None once it has exited, whatever
    process has its pid now), else one opened for ``pid`` now (the connecting process, unless it
    exited before the accept)."""
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:
        pidfd = procwatch.open_pidfd(pid)
    if pidfd is None or pidfd < 0:
        return None
    try:
        if _pidfd_pid(pidfd) not in (None, pid):
            return None
        return procwatch.namespaces_of(pid, pidfd)
    finally:
        os.close(pidfd)


def _pidfd_pid(pidfd: int) -> int | None:
    """The pid a pidfd refers to, in this pid namespace (``Pid:`` of its fdinfo), or None."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
            for line in f:
                if line.startswith(b"Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
