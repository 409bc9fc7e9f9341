"""The daemon's poller: one epoll set over plain descriptors and ZeroMQ sockets.

It has the shape of :class:`zmq.Poller` (``register``, ``unregister``,
``poll(timeout_ms)`` returning ``(target, events)``) so components register
what they own without knowing the loop's internals, but it waits in epoll: a
wake-up costs one system call whatever the number of connections, and the
local endpoint's sockets are plain descriptors with no I/O thread in between.

ZeroMQ sockets are registered by their ``FD``, which only signals that the
socket's state *may* have changed (edge-like); their readiness is read from
``EVENTS`` after every wait, which also catches messages that arrived while
the loop was busy with something else.
"""

from __future__ import annotations

import select
from typing import Union

import zmq

POLLIN = select.EPOLLIN
POLLOUT = select.EPOLLOUT
_HANGUP = select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP

Target = Union[int, zmq.Socket]


class EventLoopPoller:
    """Waits on descriptors (ints) and ZeroMQ sockets; see the module docstring."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._fds: dict[int, int] = {}  # plain fd -> registered events
        self._zmq: dict[int, zmq.Socket] = {}  # zmq FD -> socket (readable interest only)

    def register(self, target: Target, events: int = POLLIN) -> None:
        if isinstance(target, zmq.Socket):
            fd = target.getsockopt(zmq.FD)
            self._zmq[fd] = target
            self._epoll.register(fd, select.EPOLLIN)
            return
        fd = int(target)
        mask = _epoll_mask(events)
        if fd in self._fds:
            self._epoll.modify(fd, mask)
        else:
            self._epoll.register(fd, mask)
        self._fds[fd] = events

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
        else:
            fd = int(target)
            if self._fds.pop(fd, None) is None:
                raise KeyError(target)
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


def _epoll_mask(events: int) -> int:
    mask = 0
    if events & POLLIN:
        mask |= select.EPOLLIN | select.EPOLLRDHUP
    if events & POLLOUT:
        mask |= select.EPOLLOUT
    return mask
