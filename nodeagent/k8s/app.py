"""The whole device plugin, put together: the daemon watcher, the gRPC service and the
runner that keeps it registered. ``nodeagent k8s-device-plugin`` runs one; tests run one
in-process against a fake kubelet."""

from __future__ import annotations

import contextlib
import os
import threading

from nodeagent.k8s import shares
from nodeagent.k8s.plugin import DevicePluginService, PluginRunner, RunnerSettings
from nodeagent.k8s.watch import DaemonWatcher, EventsSource, ViewBoard


class DevicePlugin:
    """``start()`` (a first look at the daemon; ValueError for an events key that will not load),
    then ``run()`` until :meth:`request_stop` (safe from a signal handler), then ``close()``."""

    def __init__(self, *, endpoint: str, policy: shares.SharePolicy, allocation: shares.AllocationSettings,
                 runner: RunnerSettings, poll_interval_s: float = 2.0, events: EventsSource | None = None) -> None:
        self.stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.board = ViewBoard()
        self.watcher = DaemonWatcher(endpoint, self.board, policy, poll_interval_s=poll_interval_s, events=events)
        self.service = DevicePluginService(self.board, policy, allocation, self.stopping)
        self.runner = PluginRunner(runner, self.service)

    def start(self) -> None:
        self.watcher.start()

    def run(self) -> None:
        """Serve and stay registered until :meth:`request_stop`; PluginError when our socket cannot be served."""
        try:
            self.runner.run(self.stopping, self._wake_r)
        finally:
            self.stopping.set()

    def request_stop(self) -> None:
        """Make :meth:`run` return at once. Only sets a flag and writes a byte: fit for a signal handler."""
        self.stopping.set()
        with contextlib.suppress(OSError):  # full (a stop is pending) or closed
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Streams end, the socket goes, the watcher stops; in that order, each at once. Again: a no-op."""
        if self._wake_r < 0:
            return
        self.stopping.set()
        self.board.close()
        self.runner.server.stop()  # our socket goes; after the board's close, so that streams end at once
        self.watcher.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1
