"""A full listen backlog: a unix socket's connect() fails at once with EAGAIN (the
issue's 1,127 of 3,000 simultaneous connects). client_lib connects again with a
bounded backoff within its timeout, and says in one line what happened if the
backlog never drains. The listener here is a bare socket nobody accepts on."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time

import pytest

from client_lib import DaemonUnavailableError, framing, query_status


@pytest.fixture
def full_backlog():
    """A listening unix socket whose backlog is full: (endpoint, listener)."""
    directory = tempfile.mkdtemp(prefix="na-")
    path = os.path.join(directory, "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    fillers = []
    while True:  # connect until the kernel says the backlog is full
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)
        assert len(fillers) < 64, "the backlog never filled"
    yield f"ipc://{path}", listener
    for s in fillers:
        s.close()
    listener.close()
    os.unlink(path)
    os.rmdir(directory)


def test_a_backlog_that_stays_full_is_one_line_after_the_timeout(full_backlog):
    endpoint, _ = full_backlog
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailableError) as exc:
        query_status(endpoint, timeout=0.3)
    waited = time.monotonic() - t0
    message = str(exc.value)
    assert 0.3 <= waited < 1.0
    assert "\n" not in message and endpoint in message
    assert "listen backlog stayed full for 0.3 s" in message and "tries" in message
    tries = int(message.split("(")[1].split()[0])
    assert 5 <= tries <= 20  # backed off: 1 ms doubling to 50 ms, not a spin


class _Cue(logging.Handler):
    """Set when client_lib logs that it met a full backlog."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.met = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "listen backlog is full" in record.getMessage():
            self.met.set()


def test_a_connect_that_meets_a_full_backlog_succeeds_once_it_drains(full_backlog):
    endpoint, listener = full_backlog
    cue = _Cue()
    logger = logging.getLogger("client_lib.framing")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(cue)
    result: dict = {}

    def connect() -> None:
        try:
            result["conn"] = framing.Connection(endpoint, 5.0)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=connect)
    try:
        thread.start()
        assert cue.met.wait(5.0), "the client never met the full backlog"
        accepted, _ = listener.accept()  # one slot frees
        thread.join(5.0)
        assert "error" not in result, result.get("error")
        conn = result["conn"]
        second, _ = listener.accept()  # the retried connection is the one queued now
        conn.sock.sendall(b"ping")
        assert second.recv(4) == b"ping"
        conn.close()
        accepted.close()
        second.close()
    finally:
        logger.removeHandler(cue)
        logger.setLevel(old_level)
