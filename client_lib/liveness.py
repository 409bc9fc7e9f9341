"""One thread per process that keeps every :class:`~client_lib.client.Client`'s session alive
without chatter: it waits for hang-ups to reattach after a daemon restart, and sends heartbeats
only for sessions the daemon cannot watch. Detail: docs/internals.md.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
import weakref
from contextlib import suppress

log = logging.getLogger("client_lib.liveness")

_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


class Watcher(threading.Thread):
    """The process's liveness thread; :func:`watcher` returns it."""

    def __init__(self) -> None:
        super().__init__(name="nodeagent-liveness", daemon=True)
        self._clients: "weakref.WeakSet" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pid = os.getpid()

    def watch(self, client) -> None:
        """Start (or refresh, after a reconnect) watching ``client``."""
        with self._lock:
            self._clients.add(client)
        self.wake()

    def unwatch(self, client) -> None:
        with self._lock:
            self._clients.discard(client)
        self.wake()

    def wake(self) -> None:
        with suppress(OSError):  # BlockingIOError: a wake-up is pending already
            os.write(self._wake_w, b"x")

    def run(self) -> None:
        while True:
            with self._lock:
                clients = list(self._clients)
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            by_fd = {}
            for client in clients:
                fd = client._watch_fd()
                if fd is not None:
                    by_fd[fd] = client
                    poller.register(fd, select.POLLRDHUP)
            dues = [due for due in (client._watch_due() for client in clients) if due is not None]
            timeout_ms = max(0, int((min(dues) - time.monotonic()) * 1000) + 1) if dues else -1
            del clients
            try:
                ready = poller.poll(timeout_ms)
            except InterruptedError:
                continue
            hung_up = set()
            for fd, events in ready:
                if fd == self._wake_r:
                    with suppress(OSError):  # BlockingIOError once drained
                        while os.read(self._wake_r, 4096):
                            pass
                elif events & _HANGUP and fd in by_fd:
                    hung_up.add(by_fd[fd])
            now = time.monotonic()
            for client in list(by_fd.values()) + [c for c in list(self._clients) if c not in by_fd.values()]:
                due = client._watch_due()
                if client in hung_up or (due is not None and due <= now):
                    try:
                        client._on_watch(now, client in hung_up)
                    except Exception:  # one client's trouble must not stop the others' liveness
                        log.exception("[client] liveness check failed")


_watcher: Watcher | None = None
_watcher_lock = threading.Lock()


def forget(client) -> None:
    """Stop watching ``client``, without starting a watcher where none runs (a
    client closed at interpreter exit, or in a forked child that never watched)."""
    current = _watcher
    if current is not None and current._pid == os.getpid():
        current.unwatch(client)


def watcher() -> Watcher:
    """The process's watcher, started on first use (and again in a forked child)."""
    global _watcher
    with _watcher_lock:
        if _watcher is None or _watcher._pid != os.getpid() or not _watcher.is_alive():
            _watcher = Watcher()
            _watcher.start()
        return _watcher
