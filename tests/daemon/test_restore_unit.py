"""The restorer (nodeagent/daemon/restore.py) stepped by hand, without a daemon process.

What an old daemon journalled is written into a real SQLite journal in tmp_path; a new
``Restorer`` over real sessions, real ``Tokens`` and a real token gate takes it back: which rows
it restores and which it drops (and deletes), the boot number and the grant ids that continue
above the old daemon's, the restore windows, and the processes an old daemon left stopped (a
real ``sleep`` child, SIGSTOPped). Then the journal retry: while the journal fails, it is probed
every ``JOURNAL_RETRY_S``, and once it works the stale sessions are written again. MPS is a fake
that records who joined."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time

import pytest
from prometheus_client import CollectorRegistry

from nodeagent import procwatch
from nodeagent.config import ServeConfig
from nodeagent.daemon.bus import Bus
from nodeagent.daemon.gate import TokenGate
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.restore import JOURNAL_RETRY_S, Restorer, continue_orphan, unrestorable
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.journal import Journal, JournalError, SessionRecord
from nodeagent.metrics import Metrics
from sharing import Workload
from sharing.scheduler import SessionState
from sharing.suspension import SuspendState
from sharing.partition import PartitionError
from tests.daemon_parts import FakeDevices, FullDiskJournal, make_suspensions, make_tokens

CAPACITY_MB = 1000




class RecordingMps:
    """What the restorer asks of MPS: each join is recorded; the sessions in ``refuse`` get no share."""

    def __init__(self) -> None:
        self.joined: list[tuple[str, int, int, int | None]] = []
        self.refuse: set[str] = set()

    def join(self, session: str, device: int, memory_mb: int, uid: int | None = None) -> bool:
        if session in self.refuse:
            raise PartitionError("no SM share left on the device")
        self.joined.append((session, device, memory_mb, uid))
        return True


class Daemon:
    """One daemon's restore side over the journal at ``path``, built as the server builds it."""

    def __init__(self, path, devices: int = 2) -> None:
        self.journal = FullDiskJournal(Journal(str(path)))
        self.sessions = SessionTable()
        self.registry = CollectorRegistry()
        self.writer = JournalWriter(self.journal, Metrics(self.registry), Bus())
        self.tokens = make_tokens(count=devices, sessions=self.sessions, journal=self.writer.write)
        self.suspensions = make_suspensions(sessions=self.sessions, tokens=self.tokens)
        self.gate = TokenGate(sessions=self.sessions, tokens=self.tokens, devices=FakeDevices(devices),
                              suspensions=self.suspensions)
        self.mps = RecordingMps()
        self.config = ServeConfig(backend="cpu", enforce="revoke", heartbeat_ms=500.0, heartbeat_misses=4)
        self.restorer = Restorer(config=self.config, journal=self.writer, sessions=self.sessions,
                                 tokens=self.tokens, mps=self.mps, capacities_mb=[CAPACITY_MB] * devices,
                                 suspensions=self.suspensions, gate=self.gate)

    def add_session(self, session: Session, now: float) -> None:
        self.tokens.add(session.device, session.id, session.workload, session.weight, now)
        self.sessions.add(session)

    @property
    def write_failures(self) -> float:
        return self.registry.get_sample_value("nodeagent_journal_write_failures_total")

    def journalled(self) -> list[str]:
        records, bad = self.journal.journal.read_sessions()
        return [r.id for r in records] + [f"bad:{b.seq}" for b in bad]

    def close(self) -> None:
        self.sessions.close()
        self.journal.journal.close()


@pytest.fixture
def daemons(tmp_path):
    """Build daemons over one journal, as restarts do; each is closed at the end."""
    built: list[Daemon] = []

    def build(devices: int = 2) -> Daemon:
        built.append(Daemon(tmp_path / "state.db", devices))
        return built[-1]
    yield build
    for d in built:
        d.close()


@pytest.fixture
def child():
    """A live ``sleep`` process (pid, start ticks), killed at the end."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc.pid, procwatch.read_stat(proc.pid).start_ticks
    finally:
        proc.kill()
        proc.wait()


def record(sid: str, **fields) -> SessionRecord:
    values = dict(id=sid, key=f"key-{sid}", name=f"name-{sid}", claimed_pid=4242, verified_pid=None,
                  start_ticks=None, uid=None, workload="training", weight=1.0, device=0, memory_mb=100,
                  created_unix=time.time())
    values.update(fields)
    return SessionRecord(**values)


def process_state(pid: int) -> str:
    return procwatch.read_stat(pid).state


def wait_state(pid: int, wanted: str, timeout_s: float = 2.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := process_state(pid)) != wanted and time.monotonic() < deadline:
        time.sleep(0.005)
    return state


# ------------------------------------------------------------------ restore


def test_each_boot_counts_up_and_grant_ids_continue_above_the_old_daemons(daemons):
    for boot in (1, 2, 3):
        d = daemons()
        assert d.restorer.restore(0.0) == boot
        d.add_session(Session(id=f"s-{boot}", key="k", route=None, name="n", claimed_pid=1, verified_pid=None,
                              start_ticks=None, uid=None, workload=Workload.TRAINING, weight=1.0, device=1,
                              memory_mb=0, last_seen=0.0), 0.0)
        d.tokens.request(1, f"s-{boot}", 0.0)
        assert boot << 32 < d.tokens.grant_of(d.sessions[f"s-{boot}"]) < (boot << 32) + 16  # above every older boot's


def test_a_journalled_session_comes_back_as_it_was_written_and_joins_mps(daemons, child):
    pid, ticks = child
    old = daemons()
    old.journal.put_session(record("s-live", verified_pid=pid, start_ticks=ticks, uid=os.getuid(), device=1,
                                   workload="inference", weight=2.5, memory_mb=300, borrower="job-7"))
    old.journal.put_session(record("s-unverified"))
    new = daemons()
    new.restorer.restore(50.0)
    s = new.sessions["s-live"]
    assert (s.route, s.name, s.key, s.verified_pid, s.start_ticks, s.uid) == (None, "name-s-live", "key-s-live",
                                                                             pid, ticks, os.getuid())
    assert (s.workload, s.weight, s.device, s.memory_mb, s.borrower) == (Workload.INFERENCE, 2.5, 1, 300, "job-7")
    assert (s.last_seen, new.tokens.stopped(s)) == (50.0, False)
    assert s.pidfd is not None  # watched again: its exit ends it
    assert "s-unverified" in new.sessions  # a claimed pid alone is restored too (nothing to check)
    assert new.tokens.state(1, "s-live") is SessionState.IDLE and new.tokens.on_device(0, "s-unverified")
    assert new.mps.joined == [("s-live", 1, 300, os.getuid()), ("s-unverified", 0, 100, None)]
    assert new.journalled() == ["s-live", "s-unverified"]


def test_rows_that_cannot_be_restored_are_dropped_and_deleted_from_the_journal(daemons, child):
    pid, ticks = child
    old = daemons()
    for rec in (record("s-gone", verified_pid=pid, start_ticks=ticks + 1),  # its pid now another process
                record("s-no-device", device=2),
                record("s-too-big", memory_mb=CAPACITY_MB + 1),
                record("s-kept", memory_mb=CAPACITY_MB)):
        old.journal.put_session(rec)
    new = daemons()
    new.restorer.restore(0.0)
    assert list(new.sessions) == ["s-kept"]
    assert new.journalled() == ["s-kept"]
    assert [j[0] for j in new.mps.joined] == ["s-kept"]


def test_unrestorable_names_why(child):
    pid, ticks = child
    capacities = [CAPACITY_MB, 10]
    assert unrestorable(record("a", device=2), capacities) == "device 2 no longer exists"
    assert unrestorable(record("a", device=-1), capacities) == "device -1 no longer exists"
    assert "beyond device 1's 10 MB" in unrestorable(record("a", device=1, memory_mb=11), capacities)
    assert unrestorable(record("a", device=1, memory_mb=10), capacities) is None
    assert unrestorable(record("a", memory_mb=-1), capacities) is not None
    assert unrestorable(record("a", verified_pid=pid, start_ticks=ticks + 1), capacities) == \
        f"process {pid} is gone"
    assert unrestorable(record("a", verified_pid=pid, start_ticks=ticks), capacities) is None


def test_the_devices_with_restored_sessions_open_a_window_until_the_heartbeat_timeout(daemons):
    old = daemons()
    for rec in (record("s-a", device=1), record("s-b", device=1), record("s-gone", device=5)):
        old.journal.put_session(rec)
    new = daemons()
    new.restorer.restore(10.0)
    assert new.gate.awaited() == {"s-a", "s-b"}
    assert new.gate.next_deadline(10.0) == pytest.approx(10.0 + 0.5 * 4)
    new.gate.on_timers(12.0)  # the window closes: no one is awaited any more
    assert new.gate.awaited() == set()


def test_a_session_without_an_mps_share_or_with_a_bad_suspension_is_still_restored(daemons):
    old = daemons()
    old.journal.put_session(record("s-no-share"))
    old.journal.put_session(record("s-suspended", suspension={"state": "suspended", "bytes_parked": 4096,
                                                               "reason": "memory"}))
    old.journal.put_session(record("s-bad-suspension", suspension={"state": "half-parked"}))
    new = daemons()
    new.mps.refuse.add("s-no-share")
    new.restorer.restore(0.0)
    assert sorted(new.sessions) == ["s-bad-suspension", "s-no-share", "s-suspended"]
    assert new.suspensions.state(new.sessions["s-suspended"]) is SuspendState.SUSPENDED
    assert new.suspensions.parked_bytes(new.sessions["s-suspended"]) == 4096
    assert new.suspensions.state(new.sessions["s-bad-suspension"]) is SuspendState.RUNNING  # not suspended: it runs


def test_a_process_the_old_daemon_left_stopped_is_continued_whether_restored_or_dropped(daemons, child):
    pid, ticks = child
    other = subprocess.Popen(["sleep", "60"])
    try:
        other_ticks = procwatch.read_stat(other.pid).start_ticks
        os.kill(pid, signal.SIGSTOP)
        os.kill(other.pid, signal.SIGSTOP)
        assert wait_state(pid, "T") == "T" and wait_state(other.pid, "T") == "T"
        old = daemons()
        old.journal.put_session(record("s-restored", verified_pid=pid, start_ticks=ticks, stopped=True))
        old.journal.put_session(record("s-dropped", verified_pid=other.pid, start_ticks=other_ticks, stopped=True,
                                       device=9))
        new = daemons()
        new.restorer.restore(0.0)
        assert wait_state(pid, "S") == "S"
        assert wait_state(other.pid, "S") == "S"
        assert new.tokens.stopped(new.sessions["s-restored"]) is False
        assert [r.stopped for r in new.journal.journal.read_sessions()[0]] == [False]  # and journalled running
        assert new.journalled() == ["s-restored"]
    finally:
        other.kill()
        other.wait()


def test_a_bad_row_is_deleted_and_the_process_it_stopped_continued(daemons, child, tmp_path):
    pid, ticks = child
    old = daemons()
    old.journal.put_session(record("s-bad", verified_pid=pid, start_ticks=ticks, stopped=True))
    old.journal.put_session(record("s-good"))
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("UPDATE sessions SET workload='bogus' WHERE id='s-bad'")
    os.kill(pid, signal.SIGSTOP)
    assert wait_state(pid, "T") == "T"
    new = daemons()
    new.restorer.restore(0.0)
    assert wait_state(pid, "S") == "S"
    assert list(new.sessions) == ["s-good"]
    assert new.journalled() == ["s-good"]


def test_continue_orphan_signals_only_a_stopped_process_that_is_still_the_one_named(child):
    pid, ticks = child
    os.kill(pid, signal.SIGSTOP)
    assert wait_state(pid, "T") == "T"
    row = {"stopped": 1, "verified_pid": pid, "start_ticks": ticks, "managed_pgid": None, "uid": None}
    assert continue_orphan({**row, "stopped": 0}) is False  # the old daemon did not stop it
    assert continue_orphan({**row, "start_ticks": ticks + 1}) is False  # the pid was reused: not ours
    for pid_value in (None, True, 0, -pid, 2**40, str(pid)):
        assert continue_orphan({**row, "verified_pid": pid_value}) is False
    assert continue_orphan({**row, "start_ticks": str(ticks)}) is False
    assert continue_orphan({**row, "start_ticks": True}) is False
    assert process_state(pid) == "T"  # none of those touched it
    assert continue_orphan(row) is True
    assert wait_state(pid, "S") == "S"


def test_continue_orphan_of_a_process_that_has_exited_is_false():
    proc = subprocess.Popen(["true"])
    ticks = procwatch.read_stat(proc.pid).start_ticks if procwatch.read_stat(proc.pid) else 0
    proc.wait()
    assert continue_orphan({"stopped": True, "verified_pid": proc.pid, "start_ticks": ticks}) is False


# ------------------------------------------------------------------ journal retry


def stale_world(daemons):
    """A daemon whose journal failed while two sessions changed and one left: (daemon, kept, gone)."""
    d = daemons()
    d.restorer.restore(0.0)
    kept, gone = record("s-kept"), record("s-gone")
    for rec in (kept, gone):
        d.journal.put_session(rec)
        d.add_session(Session(id=rec.id, key=rec.key, route=None, name=rec.name, claimed_pid=rec.claimed_pid,
                              verified_pid=None, start_ticks=None, uid=None, workload=Workload.TRAINING,
                              weight=1.0, device=0, memory_mb=100, last_seen=0.0), 0.0)
    d.journal.full = True
    d.sessions["s-kept"].weight = 3.0
    assert not d.writer.put_session(d.sessions["s-kept"])
    d.sessions.remove(d.sessions["s-gone"])
    assert not d.writer.write(lambda j: j.delete_session("s-gone"), session="s-gone")
    assert d.writer.stale == {"s-kept", "s-gone"}
    return d


def test_a_healthy_journal_or_none_needs_no_retry(daemons):
    d = daemons()
    d.restorer.restore(0.0)
    d.restorer.on_timers(1.0)
    assert d.restorer.next_deadline(1.0) is None
    d.writer.journal = None  # no journal at all
    d.writer.ok = False
    d.restorer.on_timers(2.0)
    assert d.restorer.next_deadline(2.0) is None


def test_stale_sessions_are_written_again_once_a_probe_succeeds(daemons):
    d = stale_world(daemons)
    d.restorer.on_timers(10.0)  # the first turn after the failure: schedules the probe
    assert d.restorer.next_deadline(10.0) == pytest.approx(10.0 + JOURNAL_RETRY_S)
    d.journal.full = False
    d.restorer.on_timers(10.0 + JOURNAL_RETRY_S / 2)  # not yet due: nothing written
    assert d.writer.stale == {"s-kept", "s-gone"} and not d.writer.ok
    d.restorer.on_timers(10.0 + JOURNAL_RETRY_S)
    assert d.writer.ok and d.writer.stale == set()
    records, _ = d.journal.journal.read_sessions()
    assert [(r.id, r.weight) for r in records] == [("s-kept", 3.0)]  # written as it is now; the gone one deleted
    d.restorer.on_timers(20.0)
    assert d.restorer.next_deadline(20.0) is None  # done: no more probes


def test_while_the_probe_fails_nothing_is_written_and_it_is_tried_every_retry_period(daemons):
    d = stale_world(daemons)
    d.restorer.on_timers(0.0)
    due = JOURNAL_RETRY_S
    for _ in range(3):
        failures = d.write_failures
        d.restorer.on_timers(due)
        assert d.write_failures == failures + 1  # the probe alone: no stale session is tried (and logged)
        assert not d.writer.ok and d.writer.stale == {"s-kept", "s-gone"}
        assert d.restorer.next_deadline(due) == pytest.approx(due + JOURNAL_RETRY_S)
        due += JOURNAL_RETRY_S
    d.journal.full = False
    d.restorer.on_timers(due)
    assert d.writer.stale == set()


def test_a_write_that_fails_after_the_probe_stops_the_round_and_the_next_finishes_it(daemons):
    d = stale_world(daemons)
    d.restorer.on_timers(0.0)
    d.journal.full = False
    real_delete = d.journal.journal.delete_session
    d.journal.journal.delete_session = lambda sid: (_ for _ in ()).throw(JournalError("disk I/O error"))
    d.restorer.on_timers(JOURNAL_RETRY_S)  # s-gone first (sorted): it fails, s-kept waits
    assert d.writer.stale == {"s-kept", "s-gone"}
    assert d.journal.journal.read_sessions()[0][0].weight == 1.0
    d.journal.journal.delete_session = real_delete
    d.restorer.on_timers(2 * JOURNAL_RETRY_S)
    assert d.writer.stale == set() and d.journalled() == ["s-kept"]


def test_a_stopped_row_with_no_process_to_continue_does_not_stop_the_restore(daemons):
    old = daemons()
    old.journal.put_session(record("s-stopped-unverified", stopped=True))  # passes the journal's row checks
    old.journal.put_session(record("s-next"))
    new = daemons()
    new.restorer.restore(0.0)  # the daemon's start once failed here (PermissionError from Tokens.cont)
    assert "s-next" in new.sessions  # the rows after it are restored
    restored = new.sessions.get("s-stopped-unverified")
    assert restored is None or not new.tokens.stopped(restored)  # and nothing says it is still stopped
