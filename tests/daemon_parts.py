"""Daemon components built on their own, for tests that step one by hand (no loop, no sockets).

    from tests.daemon_parts import FakeDevices, make_suspensions, make_tokens

``make_tokens`` is a real :class:`nodeagent.daemon.tokens.Tokens` (real schedulers,
real carrying-out of their actions) whose notices land in a list and whose
events go to a bus the test may subscribe to; ``make_suspensions`` a real
:class:`nodeagent.daemon.suspension.Suspensions` over the tokens it is given, with no journal.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from client_lib import codec
from nodeagent.config import ServeConfig
from nodeagent.daemon.bus import Bus, LoopHandle, Replies
from nodeagent.daemon.loop import EventLoopPoller
from nodeagent.daemon.gate import LostDevices
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import SessionTable
from nodeagent.daemon.suspension import Suspensions
from nodeagent.daemon.tokens import Tokens
from nodeagent.devices import CpuBackend
from nodeagent.metrics import Metrics


class FakeDevices:
    """What components read of the devices: ``count`` cpu devices, none lost unless marked."""

    def __init__(self, count: int = 1, backend=None, name: str = "cpu") -> None:
        self.backend = backend if backend is not None else CpuBackend(count)
        self.lost = LostDevices()
        self._name = name
        self._info = self.backend.devices()

    @property
    def name(self) -> str:
        return self._name

    @property
    def count(self) -> int:
        return len(self._info)

    def info(self) -> list:
        return self._info

    def refresh(self) -> list:
        return self._info


def make_tokens(*, count: int = 1, sessions: SessionTable | None = None, metrics: Metrics | None = None,
                sent: list | None = None, bus: Bus | None = None, config: ServeConfig | None = None,
                clock=time.monotonic, journal=None) -> Tokens:
    """A :class:`Tokens` over ``count`` devices; notices go to ``sent`` as (route, message);
    ``journal``: what its journal writes go through (a ``JournalWriter.write``; default: taken, nowhere)."""
    sent = sent if sent is not None else []
    return Tokens(config=config or ServeConfig(backend="cpu", enforce="revoke"), devices=FakeDevices(count),
                  sessions=sessions if sessions is not None else SessionTable(),
                  metrics=metrics if metrics is not None else Metrics(CollectorRegistry()),
                  journal=journal if journal is not None else lambda *a, **k: True, send=lambda route, msg: sent.append((route, msg)),
                  bus=bus if bus is not None else Bus(), clock=clock)


def make_suspensions(*, sessions: SessionTable, tokens, sent: list | None = None, bus: Bus | None = None,
                     metrics: Metrics | None = None) -> Suspensions:
    """A :class:`Suspensions` over ``tokens`` (real or scripted), journalling nowhere; its
    notices and replies go to ``sent`` as (route, message)."""
    bus = bus if bus is not None else Bus()
    metrics = metrics if metrics is not None else Metrics(CollectorRegistry())
    return Suspensions(sessions=sessions, tokens=tokens, metrics=metrics,
                       replies=replies(sent if sent is not None else []), bus=bus,
                       journal=JournalWriter(None, metrics, bus))


def loop_handle(clock=time.monotonic, wake=lambda: None) -> LoopHandle:
    return LoopHandle(EventLoopPoller(), clock, wake)


def replies(sent: list, session_for=lambda route, request_id, now: None) -> Replies:
    """Replies that record (route, message); errors as protocol Error messages."""
    from client_lib import protocol as p
    return Replies(send=lambda route, msg: sent.append((route, msg)),
                   error=lambda route, rid, code, message: sent.append((route, p.Error(id=rid, code=code,
                                                                                     message=message))),
                   bad=lambda route, rid, message: sent.append((route, ("bad", rid, message))),
                   session_for=session_for)


class RecordingLocal:
    """Stands in for the LocalEndpoint: every message the daemon sends, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, object]] = []

    def send(self, route, body: bytes) -> bool:
        self.sent.append((route, codec.decode_reply(body)))
        return True

    def of(self, route) -> list:
        return [msg for r, msg in self.sent if r == route]


class FullDiskJournal:
    """A real journal whose writes raise what SQLite says of a full disk while ``full``."""

    def __init__(self, journal) -> None:
        self.journal = journal
        self.full = False

    def __getattr__(self, name: str):
        attr = getattr(self.journal, name)
        if not name.startswith(("put_", "set_", "delete_")):
            return attr

        def write(*args, **kwargs):
            if self.full:
                from nodeagent.journal import JournalError
                raise JournalError("database or disk is full")
            return attr(*args, **kwargs)
        return write
