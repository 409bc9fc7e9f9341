"""The daemon's poller and timers: what the loop waits on and what it wakes for.

:class:`EventLoopPoller` is one epoll set over plain descriptors and ZeroMQ
sockets, and the one registry of readable sources: each target is registered
with the :class:`Reader` the loop runs when it is readable (its handler and the
place a bug in it is counted under), so the loop body is one lookup per ready
target. It has the shape of :class:`zmq.Poller` (``register``, ``unregister``,
``poll(timeout_ms)`` returning ``(target, events)``) but waits in epoll: a
wake-up costs one system call whatever the number of connections, and the
local endpoint's sockets are plain descriptors with no I/O thread in between.

:class:`Timers` is the one list of timed components (:class:`Timed`): the
poll timeout is the earliest of their deadlines, and their timers run in the
list's order after every turn.

ZeroMQ sockets are registered by their ``FD``, which only signals that the
socket's state *may* have changed (edge-like); their readiness is read from
``EVENTS`` after every wait, which also catches messages that arrived while
the loop was busy with something else.
"""

from __future__ import annotations

import select
from dataclasses import dataclass
from typing import Callable, Protocol, Union

import zmq

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
    """Waits on descriptors (ints) and ZeroMQ sockets, each registered with its
    :class:`Reader`; see the module docstring."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._fds: dict[int, int] = {}  # plain fd -> registered events
        self._zmq: dict[int, zmq.Socket] = {}  # zmq FD -> socket (readable interest only)
        self._readers: dict[Target, Reader] = {}  # every registered target -> what runs when it is ready

    def register(self, target: Target, events: int = POLLIN, *, on_ready: Callable[[Target, int], None],
                 where: str) -> None:
        """Watch ``target`` for ``events``; the loop runs ``on_ready(target, events)`` when it is
        ready, a bug in it counted under ``where``. Registering a plain descriptor again changes both."""
        reader = Reader(where, on_ready)
        if isinstance(target, zmq.Socket):
            fd = target.getsockopt(zmq.FD)
            self._zmq[fd] = target
            self._epoll.register(fd, select.EPOLLIN)
            self._readers[target] = reader
            return
        fd = int(target)
        mask = _epoll_mask(events)
        if fd in self._fds:
            self._epoll.modify(fd, mask)
        else:
            self._epoll.register(fd, mask)
        self._fds[fd] = events
        self._readers[fd] = reader

    def reader(self, target: Target) -> Reader | None:
        """What runs when ``target`` is ready (None: not registered, or unregistered since the wait)."""
        return self._readers.get(target)

    def modify(self, fd: int, events: int) -> None:
        """Change what a plain descriptor is watched for (e.g. add POLLOUT while output is queued)."""
        if self._fds.get(fd) != events:
            self._epoll.modify(fd, _epoll_mask(events))
            self._fds[fd] = events

    def unregister(self, target: Target) -> None:
        if isinstance(target, zmq.Socket):
            fd = next((f for f, s in self._zmq.items() if s is target), None)
            if fd is None:
                raise KeyError(target)
            del self._zmq[fd]
            del self._readers[target]
        else:
            fd = int(target)
            if self._fds.pop(fd, None) is None:
                raise KeyError(target)
            del self._readers[fd]
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):
            pass  # closed already: the kernel dropped it from the set

    def __contains__(self, target: Target) -> bool:
        if isinstance(target, zmq.Socket):
            return any(s is target for s in self._zmq.values())
        return int(target) in self._fds

    def poll(self, timeout_ms: int | None = None) -> list[tuple[Target, int]]:
        """Ready targets: ``(fd, events)`` for descriptors (epoll bits, hang-ups
        reported as POLLIN so the owner reads the EOF), ``(socket, POLLIN)`` for
        ZeroMQ sockets with a message waiting."""
        if self._zmq and any(s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in self._zmq.values()):
            timeout_ms = 0  # a message is already waiting: do not sleep on the edge
        timeout_s = -1 if timeout_ms is None or timeout_ms < 0 else timeout_ms / 1000.0
        while True:
            try:
                ready = self._epoll.poll(timeout_s)
                break
            except InterruptedError:
                continue
        out: list[tuple[Target, int]] = []
        for fd, ev in ready:
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


class Timers:
    """The one list of timed components, each with the place a bug in its timers is counted under."""

    def __init__(self) -> None:
        self._timed: list[tuple[str, Timed]] = []

    def add(self, where: str, timed: Timed) -> None:
        """``timed``'s timers run after those added before it."""
        self._timed.append((where, timed))

    def __iter__(self):
        return iter(self._timed)

    def next_deadline(self, now: float) -> float | None:
        """The earliest deadline of any of them (None: nothing pending)."""
        soonest = None
        for _, timed in self._timed:
            at = timed.next_deadline(now)
            if at is not None and (soonest is None or at < soonest):
                soonest = at
        return soonest


def _epoll_mask(events: int) -> int:
    mask = 0
    if events & POLLIN:
        mask |= select.EPOLLIN | select.EPOLLRDHUP
    if events & POLLOUT:
        mask |= select.EPOLLOUT
    return mask
