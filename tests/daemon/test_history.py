"""The daemon's record of grants and slices (nodeagent/daemon/history.py) stepped by hand.

``DeviceStats``: the counters, the ring of waits and its percentiles, and the timeline (who held
a token longest in each bucket, the open slices counted up to now, slices that no one reported
ended by the next grant or report). ``AttainedService``: what the ledger does when the journal
fails, when a restarted daemon finds more jobs than it keeps, and whom it never forgets (the
sums and the flush period are in test_attained.py). Time is passed in; a real SQLite journal in
tmp_path; no daemon, no sockets."""

from __future__ import annotations

import math
import sqlite3

import pytest
from prometheus_client import CollectorRegistry

from nodeagent.daemon.bus import Bus, Granted, SliceEnded
from nodeagent.daemon.history import IDLE, MANY, MAX_HOLDERS_PER_BUCKET, AttainedService, DeviceStats, percentile
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.journal import Journal, JournalError
from nodeagent.metrics import Metrics
from sharing import Workload
from tests.daemon_parts import FullDiskJournal, make_tokens


# ------------------------------------------------------------------ DeviceStats


def stats(buckets: int = 4, bucket_s: float = 1.0, wait_window: int = 512) -> DeviceStats:
    return DeviceStats(bucket_s=bucket_s, buckets=buckets, wait_window=wait_window)


def held(stats: DeviceStats, session: str, start: float, end: float, lane: int = 0) -> None:
    """One slice of ``session`` on ``lane`` from ``start`` to ``end``, reported as the tokens component does."""
    stats.granted(session, f"name-{session}", start, 0.0, lane)
    stats.slice_ended(session, end)


@pytest.mark.parametrize("bounds", [dict(bucket_s=0.0), dict(bucket_s=-1.0), dict(bucket_s=math.nan),
                                    dict(bucket_s=math.inf), dict(buckets=0), dict(wait_window=0)])
def test_bounds_that_would_make_no_timeline_or_no_ring_are_refused(bounds):
    with pytest.raises(ValueError, match="bad DeviceStats bounds"):
        DeviceStats(**bounds)


def test_percentile_is_the_nearest_rank():
    ordered = [float(i) for i in range(1, 101)]
    assert percentile(ordered, 50) == 50.0
    assert percentile(ordered, 99) == 99.0
    assert percentile(ordered, 100) == 100.0
    assert percentile(ordered, 0) == 1.0  # never below the first rank
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 51) == 3.0
    assert percentile([7.0], 99) == 7.0


def test_counters_count_each_kind_of_event_apart():
    s = stats()
    held(s, "s-a", 0.0, 0.1)
    held(s, "s-b", 0.1, 0.2)
    s.yield_asked("preempted")
    s.yield_asked("quantum")
    s.yield_asked("quantum")
    s.enforced()
    r = s.report(0.5, ())
    assert (r.grants, r.preemptions, r.quantum_yields, r.enforcements) == (2, 1, 2, 1)


def test_waits_are_a_ring_of_the_last_wait_window_and_bad_ones_are_not_kept():
    s = stats(wait_window=4)
    assert s.report(0.0, ()).wait_p50_ms is None and s.report(0.0, ()).wait_p99_ms is None
    for waited in (9.0, 9.0, 0.001, 0.002, 0.003, 0.004):  # the two slow ones fall out of the ring
        s.granted("s-a", "a", 1.0, waited)
    s.granted("s-a", "a", 1.0, -1.0)  # never the scheduler's; counted as a grant, not as a wait
    s.granted("s-a", "a", 1.0, math.nan)
    r = s.report(1.0, ("s-a",))
    assert r.grants == 8 and r.waits == 4
    assert r.wait_p50_ms == pytest.approx(2.0)
    assert r.wait_p99_ms == pytest.approx(4.0)


def test_the_timeline_ends_with_the_bucket_now_is_in_oldest_first():
    s = stats(buckets=4)
    held(s, "s-a", 0.0, 0.9)
    held(s, "s-b", 2.0, 2.9)
    r = s.report(3.5, ())
    assert r.bucket_ms == 1000.0
    assert r.timeline == ["s-a", IDLE, "s-b", IDLE]
    assert r.holders == [["s-a"], [], ["s-b"], []]
    assert r.names == {"s-a": "name-s-a", "s-b": "name-s-b"}
    # One bucket later the oldest one has gone.
    assert s.report(4.5, ()).timeline == [IDLE, "s-b", IDLE, IDLE]


def test_a_bucket_is_idle_unless_its_longest_holder_held_longer_than_it_was_free():
    s = stats(buckets=4)
    held(s, "s-half", 0.0, 0.5)  # held 0.5, free 0.5: a tie is idle
    held(s, "s-most", 1.0, 1.6)
    held(s, "s-x", 2.0, 2.3)  # three short slices: free 0.05, the longest (0.45, under half) wins
    held(s, "s-y", 2.3, 2.5)
    held(s, "s-z", 2.5, 2.95)
    r = s.report(3.01, ())
    assert r.timeline[:3] == [IDLE, "s-most", "s-z"]
    assert r.holders[2] == ["s-z", "s-x", "s-y"]  # longest first


def test_a_slice_across_buckets_is_spread_over_them_and_one_longer_than_the_timeline_fills_it():
    s = stats(buckets=4)
    held(s, "s-a", 0.5, 2.25)  # 0.5 in bucket 0 (a tie: idle), all of 1, 0.25 of 2
    held(s, "s-b", 2.6, 3.3)  # across one edge: 0.4 of bucket 2, 0.3 of the 0.5 of 3 so far
    r = s.report(3.5, ())
    assert r.timeline == [IDLE, "s-a", "s-b", "s-b"]
    assert r.holders == [["s-a"], ["s-a"], ["s-b", "s-a"], ["s-b"]]
    held(s, "s-long", 4.0, 100.5)  # 96 buckets: only the last four are kept
    r = s.report(100.7, ())
    assert r.timeline == ["s-long", "s-long", "s-long", "s-long"]
    assert r.holders == [["s-long"]] * 4


def test_an_open_slice_counts_up_to_now_and_the_next_report_does_not_end_it():
    s = stats(buckets=4)
    s.granted("s-a", "a", 1.0, 0.0)
    r = s.report(2.6, ("s-a",))
    assert r.timeline == [IDLE, IDLE, "s-a", "s-a"]  # bucket 2 held 0.6 of its 0.6 so far
    assert r.names == {"s-a": "a"}
    r = s.report(3.2, ("s-a",))  # still held: the open slice keeps counting
    assert r.timeline == [IDLE, "s-a", "s-a", "s-a"]
    s.slice_ended("s-a", 3.4)
    assert s.report(3.9, ()).timeline == [IDLE, "s-a", "s-a", IDLE]  # 0.4 of bucket 3: now idle


def test_a_report_that_finds_another_holder_ends_the_slice_it_was_not_told_of():
    s = stats(buckets=4)
    s.granted("s-serve", "serve", 0.0, 0.0)  # a serving sub-session gives its token back unreported
    r = s.report(0.8, ("s-other",))
    assert r.timeline[-1] == "s-serve"  # it held 0.8 of the 0.8 so far
    r = s.report(3.9, ("s-other",))  # ended at the first report: nothing added since
    assert r.timeline == ["s-serve", IDLE, IDLE, IDLE]
    assert r.holders[0] == ["s-serve"]
    # A holder named alone (a string) keeps its slice.
    s.granted("s-b", "b", 4.0, 0.0)
    assert s.report(4.8, ("s-b",)).timeline[-1] == "s-b"


def test_a_grant_ends_the_open_slice_of_its_own_lane_only():
    s = stats(buckets=4)
    s.granted("s-a", "a", 0.0, 0.0, lane=0)
    s.granted("s-b", "b", 0.0, 0.0, lane=1)  # co-run: the lanes overlap
    s.granted("s-c", "c", 0.2, 0.0, lane=0)  # s-a's slice ends here, s-b's does not
    r = s.report(0.9, ("s-c", "s-b"))
    assert r.holders[-1] == ["s-b", "s-c", "s-a"]  # 0.9, 0.7, 0.2
    assert r.timeline[-1] == "s-b"


def test_ending_a_slice_no_one_holds_changes_nothing():
    s = stats(buckets=4)
    s.granted("s-a", "a", 0.0, 0.0)
    s.slice_ended("s-nobody", 0.5)
    s.slice_ended("s-a", 0.8)
    s.slice_ended("s-a", 0.95)  # reported twice (revoked, then gone)
    r = s.report(1.5, ())
    assert r.timeline[-2] == "s-a" and r.holders[-2] == ["s-a"]
    assert s.report(1.5, ()).timeline == r.timeline  # a report read twice says the same


def test_a_bucket_keeps_at_most_max_holders_and_pools_the_rest_under_many():
    s = stats(buckets=2)
    n = MAX_HOLDERS_PER_BUCKET + 3
    for i in range(n):  # the pooled ones together hold longest
        held(s, f"s-{i:02d}", i * 0.08, (i + 1) * 0.08)
    held(s, "s-00", 0.88, 0.99)  # a session already in the full bucket still adds to its own entry
    r = s.report(1.5, ())
    assert len(r.holders[0]) == MAX_HOLDERS_PER_BUCKET + 1
    assert r.holders[0][:2] == [MANY, "s-00"]  # 0.24 pooled, then 0.19
    assert r.timeline[0] == MANY
    assert MANY not in r.names and len(r.names) == MAX_HOLDERS_PER_BUCKET


def test_a_slot_from_an_earlier_round_of_the_ring_is_started_afresh():
    s = stats(buckets=2)
    held(s, "s-old", 0.0, 0.9)  # bucket 0, slot 0
    held(s, "s-new", 2.0, 2.2)  # bucket 2, slot 0 again: s-old must not show in it
    r = s.report(2.5, ())
    assert r.holders == [[], ["s-new"]]
    assert r.timeline == [IDLE, IDLE]
    assert r.names == {"s-new": "name-s-new"}


def test_on_a_co_run_device_the_lanes_overlap_and_a_bucket_is_busy_while_any_holds():
    s = stats(buckets=4)
    held(s, "s-infer", 0.0, 0.4, lane=0)
    held(s, "s-train", 0.0, 0.4, lane=1)
    held(s, "s-infer", 0.4, 0.5, lane=0)
    r = s.report(1.5, ())
    assert r.holders[-2] == ["s-infer", "s-train"]  # 0.5 and 0.4: 0.9 of the bucket's 1.0 held
    assert r.timeline[-2] == "s-infer"  # free 0.1 (the lanes' time is not counted twice as free)


# ------------------------------------------------------------------ AttainedService


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now




def job_session(sid: str, job: str | None, workload: Workload = Workload.TRAINING) -> Session:
    return Session(id=sid, key="k", route=None, name=sid, claimed_pid=1, verified_pid=None, start_ticks=None,
                   uid=None, workload=workload, weight=1.0, device=0, memory_mb=0, last_seen=0.0,
                   borrower=job)


def journalled(path) -> dict[str, float]:
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT job, gpu_s FROM attained"))


@pytest.fixture
def ledger(tmp_path):
    """(ledger, sessions, clock, the failing journal, its path): a ledger over a real journal
    (and real tokens, ``ledger.tokens``, whose grants are its running slices)."""
    path = tmp_path / "state.db"
    journal = FullDiskJournal(Journal(str(path)))
    sessions, clock = SessionTable(), Clock()
    writer = JournalWriter(journal, Metrics(CollectorRegistry()), Bus())
    tokens = make_tokens(sessions=sessions, clock=clock)
    attained = AttainedService(sessions=sessions, tokens=tokens, journal=writer, clock=clock, flush_s=1.0, max_jobs=3)
    attained.tokens = tokens
    yield attained, sessions, clock, journal, path
    journal.journal.close()
    sessions.close()


def test_a_write_the_journal_refused_is_tried_again_until_it_is_taken(ledger):
    attained, sessions, clock, journal, path = ledger
    attained.on_slice_ended(SliceEnded(job_session("s-1", "job-a"), 2.0))
    journal.full = True
    clock.now = 1.0
    assert attained.flush(1.0) is False
    assert attained.next_deadline(1.0) == pytest.approx(2.0)  # tried again flush_s later
    attained.on_slice_ended(SliceEnded(job_session("s-2", "job-b"), 1.0))
    clock.now = 2.0
    attained.on_timers(2.0)  # still full
    assert journalled(path) == {}
    journal.full = False
    clock.now = 3.0
    attained.on_timers(3.0)
    assert journalled(path) == {"job-a": 2.0, "job-b": 1.0}  # nothing that changed while it failed is lost
    assert attained.next_deadline(3.0) == math.inf


def test_slices_that_are_no_jobs_or_held_nothing_change_nothing_and_schedule_no_write(ledger):
    attained, sessions, clock, journal, path = ledger
    attained.on_slice_ended(SliceEnded(job_session("s-1", "job-a"), 0.0))
    attained.on_slice_ended(SliceEnded(job_session("s-2", "job-a"), -1.0))
    attained.on_slice_ended(SliceEnded(job_session("s-3", None), 5.0))
    attained.on_slice_ended(SliceEnded(job_session("s-4", "job-a", Workload.INFERENCE), 5.0))
    attained.on_granted(Granted(job_session("s-4", "job-a", Workload.INFERENCE), 1, 0.0))
    assert attained.snapshot(10.0) == {}
    assert attained.next_deadline(0.0) == math.inf
    attained.on_granted(Granted(job_session("s-5", "job-a"), 2, 0.0))  # a job's grant: written while it holds
    assert attained.next_deadline(0.0) == pytest.approx(1.0)


def test_a_clean_shutdown_writes_what_changed_and_the_running_slices(ledger):
    attained, sessions, clock, journal, path = ledger
    attained.on_slice_ended(SliceEnded(job_session("s-1", "job-a"), 1.5))
    running = job_session("s-2", "job-b")
    attained.tokens.add(running.device, running.id, running.workload, running.weight, 4.0)
    sessions.add(running)
    attained.tokens.request(running.device, running.id, 4.0)  # granted at 4.0: held 2.5 s at the close
    attained.flush(6.5)  # what a clean shutdown does
    assert journalled(path) == {"job-a": 1.5, "job-b": 2.5}


def test_a_restart_keeps_the_most_recently_written_jobs_and_deletes_the_rest_at_once(ledger, tmp_path):
    attained, sessions, clock, journal, path = ledger
    journal.journal.put_attained({f"job-{i}": float(i) for i in range(5)})
    with sqlite3.connect(path) as db:  # job-4 written first, job-0 last
        db.executemany("UPDATE attained SET updated_unix=? WHERE job=?", [(100.0 - i, f"job-{i}") for i in range(5)])
    clock.now = 7.0
    attained.restore()
    assert attained.snapshot(7.0) == {"job-0": 0.0, "job-1": 1.0, "job-2": 2.0}
    assert attained.next_deadline(7.0) == 7.0  # the forgotten rows go at the first turn
    attained.on_timers(7.0)
    assert journalled(path) == {"job-0": 0.0, "job-1": 1.0, "job-2": 2.0}


def test_restore_without_a_journal_keeps_nothing_and_writes_nothing():
    sessions = SessionTable()
    attained = AttainedService(sessions=sessions, tokens=make_tokens(sessions=sessions),
                               journal=JournalWriter(None, Metrics(CollectorRegistry()), Bus()), clock=lambda: 0.0)
    attained.restore()
    attained.on_slice_ended(SliceEnded(job_session("s-1", "job-a"), 1.0))
    assert attained.flush(5.0) is True  # no journal: nothing to fail
    assert attained.snapshot(5.0) == {"job-a": 1.0}
    sessions.close()


def test_past_its_bound_the_ledger_never_forgets_a_job_with_a_session_here(ledger):
    attained, sessions, clock, journal, path = ledger  # max_jobs=3
    here = job_session("s-here", "job-small")
    sessions.add(here)
    for job, seconds in (("job-small", 0.1), ("job-b", 5.0), ("job-c", 4.0), ("job-d", 3.0)):
        attained.on_slice_ended(SliceEnded(job_session(f"s-{job}", job), seconds))
    assert attained.snapshot(1.0) == {"job-small": 0.1, "job-b": 5.0, "job-c": 4.0}  # job-d: the smallest idle
    attained.flush(1.0)
    assert journalled(path) == {"job-small": 0.1, "job-b": 5.0, "job-c": 4.0}
    # A job forgotten and then heard of again before the next write is remembered, not deleted.
    attained.on_slice_ended(SliceEnded(job_session("s-e", "job-e"), 1.0))  # the smallest idle: forgotten
    attained.on_slice_ended(SliceEnded(job_session("s-e2", "job-e"), 9.0))  # back: job-c is forgotten
    attained.flush(2.0)
    assert journalled(path) == {"job-small": 0.1, "job-b": 5.0, "job-e": 9.0}
