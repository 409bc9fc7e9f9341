"""The real daemon in a thread of the test process, for tests of policy that need no daemon process.

    def test_x(inproc_daemon):               # or start_inproc_daemon("--quantum-ms", "training=20")
        with Client("a", endpoint=inproc_daemon.endpoint) as a: ...

:class:`InprocDaemon` builds the :class:`~nodeagent.daemon.server.AgentServer` from the
same flags as ``nodeagent serve`` (the CLI's own parser and config rules), binds the same
private endpoint and state dir a :class:`tests.conftest.Daemon` would, and runs
``serve_forever`` in a thread; clients reach it over its socket as they would a daemon
process. What it saves is the interpreter start and imports of ``python -m nodeagent
serve`` (most of a short test's time on a loaded machine). Tests that cross a process
boundary of the daemon's own (signals to it, SIGKILL, restart, its pidfd view of a
client living in another process, its descriptor limits) keep :class:`Daemon`.
"""

from __future__ import annotations

import logging
import os
import threading

from prometheus_client import CollectorRegistry

from client_lib import query_status

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class InprocDaemon:
    """``nodeagent serve ARGS`` as a thread: ``endpoint``, ``status()``, ``log()`` and ``stop()`` as
    :class:`tests.conftest.Daemon` has them (no ``proc``: there is no process to signal)."""

    def __init__(self, workdir: str, extra_args: list[str], endpoint: str | None = None) -> None:
        self.workdir = workdir
        self.socket_path = os.path.join(workdir, "agent.sock")
        self.endpoint = endpoint or f"ipc://{self.socket_path}"
        self.extra_args = extra_args
        self.log_path = os.path.join(workdir, "daemon.log")
        self.server = None
        self._backend = None
        self._thread: threading.Thread | None = None
        self._handler: logging.Handler | None = None
        self._old_level = logging.NOTSET
        self.failure: BaseException | None = None  # what serve_forever raised, if anything

    def start(self) -> "InprocDaemon":
        from nodeagent.cli import _config_from, build_parser
        from nodeagent.daemon.server import AgentServer
        from nodeagent.devices import open_backend
        from nodeagent.journal import Journal
        from nodeagent.metrics import Metrics

        config_path = os.path.join(self.workdir, "nodeagent.toml")
        if not os.path.exists(config_path):
            open(config_path, "w").close()  # hermetic: never the host's /etc/nodeagent/nodeagent.toml
        args = build_parser().parse_args(
            ["serve", "--config", config_path, "--backend", "cpu", "--endpoint", self.endpoint,
             "--state-dir", os.path.join(self.workdir, "state"), "--log-level", "debug",
             *(() if "--ctxpool" in self.extra_args else ("--ctxpool", "off")), *self.extra_args])
        config, _ = _config_from(args)
        self._attach_log()
        backend, _ = open_backend(config.backend, cpu_devices=config.cpu_devices)
        os.makedirs(config.state_dir, mode=0o750, exist_ok=True)
        try:
            server = AgentServer(config, backend, metrics=Metrics(CollectorRegistry()),
                                 open_journal=lambda: Journal(os.path.join(config.state_dir, "state.db")))
            server.bind()
        except BaseException:
            backend.close()
            self._detach_log()
            raise
        self.server, self._backend = server, backend
        self._thread = threading.Thread(target=self._serve, name="inproc-daemon", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            self.server.serve_forever()
        except BaseException as exc:  # the test sees it at stop()
            self.failure = exc

    def _attach_log(self) -> None:
        """The daemon's log lines (logger ``nodeagent``) to ``daemon.log``, as a daemon process writes them."""
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        logger = logging.getLogger("nodeagent")
        self._old_level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
        self._handler = handler

    def _detach_log(self) -> None:
        if self._handler is not None:
            logger = logging.getLogger("nodeagent")
            logger.removeHandler(self._handler)
            logger.setLevel(self._old_level)
            self._handler.close()
            self._handler = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self):
        return query_status(self.endpoint, timeout=5)

    def log(self) -> str:
        if self._handler is not None:
            self._handler.flush()
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> int:
        """Stop the loop as SIGTERM would; 0 if it stopped cleanly, else 1 (``failure`` says why)."""
        if self._thread is None:
            return 0
        self.server.request_stop("SIGTERM")
        self._thread.join(timeout)
        stuck = self._thread.is_alive()
        if not stuck:
            self._backend.close()
        self._thread = None
        self._detach_log()
        if stuck:
            raise TimeoutError(f"in-process daemon did not stop within {timeout} s")
        return 0 if self.failure is None else 1
