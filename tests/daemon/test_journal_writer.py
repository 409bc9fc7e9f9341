"""The journal writer (nodeagent/daemon/journal_writer.py) stepped by hand: what it says, counts and
publishes when the journal fails and recovers, and which sessions it calls durable. A real SQLite
journal whose writes fail on cue; a real bus whose events are recorded; a fresh metrics registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from nodeagent.daemon.bus import Bus, DurabilityChanged, Published
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session
from nodeagent.journal import Journal, JournalError
from nodeagent.metrics import Metrics
from sharing import Workload
from tests.daemon_parts import FullDiskJournal




class Writer:
    """A :class:`JournalWriter` and what can be read of it: its gauges, its counter, its events."""

    def __init__(self, journal) -> None:
        self.registry = CollectorRegistry()
        bus = Bus()
        self.heard: list[object] = []
        bus.subscribe(Published, self.heard.append)
        bus.subscribe(DurabilityChanged, self.heard.append)
        self.writer = JournalWriter(journal, Metrics(self.registry), bus)

    def take(self) -> list[object]:
        heard, self.heard[:] = list(self.heard), []
        return heard

    @property
    def journal_ok(self) -> float:
        return self.registry.get_sample_value("nodeagent_journal_ok")

    @property
    def failures(self) -> float:
        return self.registry.get_sample_value("nodeagent_journal_write_failures_total")


@pytest.fixture
def disk(tmp_path):
    journal = Journal(str(tmp_path / "state.db"))
    yield FullDiskJournal(journal)
    journal.close()


def _session(sid: str) -> Session:
    return Session(id=sid, key="k", route=None, name=f"job-{sid}", claimed_pid=7, verified_pid=None,
                   start_ticks=None, uid=1000, workload=Workload.INFERENCE, weight=2.5, device=0, memory_mb=300,
                   last_seen=0.0, borrower="job-7")


def _health(event) -> dict | None:
    return event.data if isinstance(event, Published) and event.kind == "health" else None


def test_without_a_journal_writes_succeed_unrun_and_nothing_is_durable(disk):
    w = Writer(None)
    ran = []
    assert w.writer.write(ran.append, session="s-a") is True and ran == []
    assert not w.writer.durable("s-a") and w.journal_ok == 0 and w.take() == []
    w.writer.attach(disk)  # opened once the addresses are bound
    assert w.writer.durable("s-a") and w.journal_ok == 1


def test_the_first_failure_is_said_once_and_its_session_is_stale(disk):
    w = Writer(disk)
    assert w.writer.put_session(_session("s-a")) and w.writer.durable("s-a") and w.journal_ok == 1
    disk.full = True
    assert w.writer.put_session(_session("s-a")) is False
    heard = w.take()
    assert [_health(e) for e in heard] == [{"journal": "failed", "error": "database or disk is full"}, None]
    assert heard[1] == DurabilityChanged(None)  # every session's client is told: nothing is durable now
    assert (w.journal_ok, w.failures) == (0, 1)
    assert not w.writer.durable("s-a") and not w.writer.durable("s-b") and w.writer.stale == {"s-a"}
    assert w.writer.write(lambda j: j.set_weight("s-a", 1.0), session="s-a") is False
    assert w.take() == [] and w.failures == 2  # counted, said no more


def test_a_session_first_failing_while_the_journal_is_down_is_told_alone(disk):
    w = Writer(disk)
    disk.full = True
    w.writer.put_session(_session("s-a"))
    w.take()
    assert w.writer.put_session(_session("s-b")) is False
    assert w.take() == [DurabilityChanged("s-b")] and w.writer.stale == {"s-a", "s-b"}
    w.writer.write(lambda j: j.put_meta("x", "1"))  # a write of no session: stale as before, nothing said
    assert w.take() == [] and w.writer.stale == {"s-a", "s-b"}


def test_only_a_probe_makes_the_journal_healthy_again(disk):
    w = Writer(disk)
    disk.full = True
    w.writer.put_session(_session("s-a"))
    w.writer.put_session(_session("s-b"))
    w.take()
    disk.full = False
    assert w.writer.put_session(_session("s-a"))  # its row is right again, but the journal may still fail
    assert w.take() == [] and w.writer.stale == {"s-b"} and not w.writer.durable("s-a") and w.journal_ok == 0
    disk.full = True
    assert w.writer.probe() is False and w.failures == 3 and w.take() == [] and not w.writer.ok
    disk.full = False
    assert w.writer.probe() is True
    heard = w.take()
    assert [_health(e) for e in heard] == [{"journal": "ok", "stale_sessions": 1}, None]
    assert heard[1] == DurabilityChanged(None) and w.journal_ok == 1
    assert w.writer.durable("s-a") and not w.writer.durable("s-b")
    assert w.writer.probe() is True and w.take() == []  # healthy already: nothing to say
    assert w.writer.put_session(_session("s-b"))
    assert w.take() == [DurabilityChanged("s-b")] and w.writer.durable("s-b") and w.writer.stale == set()


def test_a_write_that_raises_anything_costs_that_write_only(disk):
    w = Writer(disk)

    def missing_row(journal):
        raise KeyError("s-gone")

    assert w.writer.write(missing_row, session="s-gone") is False
    assert w.writer.stale == {"s-gone"} and w.failures == 1
    assert [_health(e)["error"] for e in w.take() if _health(e)] == ["'s-gone'"]


def test_put_session_writes_the_sessions_row_as_it_is_now(disk):
    w = Writer(disk)
    s = _session("s-a")
    assert w.writer.put_session(s)
    s.weight, s.memory_mb = 4.0, 500
    assert w.writer.put_session(s)
    [row] = disk.read_sessions()[0]
    assert (row.id, row.key, row.name, row.claimed_pid, row.uid, row.workload, row.device, row.borrower) == (
        "s-a", "k", "job-s-a", 7, 1000, "inference", 0, "job-7")
    assert (row.weight, row.memory_mb) == (4.0, 500)
