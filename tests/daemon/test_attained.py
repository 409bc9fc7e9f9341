"""Issue 25, item 1: a job's attained service (summed over its sessions, journalled, kept by a
daemon SIGKILLed and started again), the renew op (a lend's lease), and the set_weight op.

The ledger and the endpoint's operations are stepped by hand with a scripted clock; one test
runs a real daemon and kills it."""

from __future__ import annotations

import math
import os
import sqlite3
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from client_lib import Client
from client_lib import codec
from client_lib import protocol as p
from nodeagent.daemon.history import AttainedService
from nodeagent.daemon.bus import Bus, SliceEnded
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.journal import Journal
from nodeagent.metrics import Metrics
from nodeagent.procwatch import PeerCredentials, own_namespaces
from sharing import Workload
from tests.conftest import wait_for
from tests.daemon_parts import make_tokens
from tests.cluster_nodes import inventory_or_none
from tests.daemon.cluster_stepped import PLACEMENT

USER = SimpleNamespace(creds=PeerCredentials(uid=1000, gid=1000, pid=4242))
ROOT = SimpleNamespace(creds=PeerCredentials(uid=0, gid=0, pid=1, namespaces=own_namespaces()))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _session(sid: str, *, borrower: str | None, workload: str = "training", device: int = 0) -> Session:
    return Session(id=sid, key="k", route=f"conn-{sid}", name=sid, claimed_pid=1, verified_pid=None,
                   start_ticks=None, uid=None, workload=Workload.parse(workload), weight=1.0, device=device,
                   memory_mb=0, last_seen=0.0, borrower=borrower)


@pytest.fixture
def ledger(tmp_path):
    """(ledger, tokens, sessions, clock, journal path): the ledger wired to real Tokens as the daemon wires it."""
    clock, bus, sessions = Clock(), Bus(), SessionTable()
    metrics = Metrics(CollectorRegistry())
    path = str(tmp_path / "state.db")
    writer = JournalWriter(Journal(path), metrics, bus)
    tokens = make_tokens(count=1, sessions=sessions, metrics=metrics, bus=bus, clock=clock)
    attained = AttainedService(sessions=sessions, tokens=tokens, journal=writer, clock=clock, flush_s=1.0)
    bus.subscribe(SliceEnded, attained.on_slice_ended)
    from nodeagent.daemon.bus import Granted
    bus.subscribe(Granted, attained.on_granted)
    yield attained, tokens, sessions, clock, path
    writer.journal.close()
    sessions.close()


def _join(tokens, sessions, s: Session, now: float = 0.0) -> Session:
    tokens.add(s.device, s.id, s.workload, s.weight, now)
    sessions.add(s)
    return s


def _slice(tokens, clock, s: Session, start: float, held_s: float) -> None:
    clock.now = start
    tokens.request(s.device, s.id, start)
    grant = tokens.grant_of(s)
    assert grant is not None
    clock.now = start + held_s
    tokens.release_session(s, grant, clock.now)


def _journalled(path: str) -> dict[str, float]:
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT job, gpu_s FROM attained"))


def test_a_jobs_service_is_summed_over_its_sessions_and_only_jobs_count(ledger):
    attained, tokens, sessions, clock, path = ledger
    first = _join(tokens, sessions, _session("s-1", borrower="job-7"))
    _slice(tokens, clock, first, 0.0, 2.0)
    _slice(tokens, clock, first, 3.0, 0.5)
    tokens.remove(0, first.id, 4.0)
    sessions.remove(first)
    second = _join(tokens, sessions, _session("s-2", borrower="job-7"), 4.0)  # the job restarted: a new session
    _slice(tokens, clock, second, 5.0, 1.5)
    inference = _join(tokens, sessions, _session("s-inf", borrower="job-7", workload="inference"), 7.0)
    _slice(tokens, clock, inference, 7.0, 3.0)
    local = _join(tokens, sessions, _session("s-local", borrower=None), 11.0)
    _slice(tokens, clock, local, 11.0, 3.0)
    assert attained.snapshot(14.0) == {"job-7": pytest.approx(4.0)}
    # A slice in progress counts up to now, and its session leaving while it holds ends it.
    clock.now = 20.0
    tokens.request(0, second.id, 20.0)
    assert attained.of("job-7", 20.5) == pytest.approx(4.5)
    sessions.remove(second)
    tokens.end_slice(second, 21.0)
    assert attained.snapshot(30.0) == {"job-7": pytest.approx(5.0)}
    assert attained.of("job-never-seen", 30.0) == 0.0


def test_the_ledger_is_journalled_every_flush_s_and_restored_by_the_next_daemon(ledger):
    attained, tokens, sessions, clock, path = ledger
    s = _join(tokens, sessions, _session("s-1", borrower="job-7"))
    _slice(tokens, clock, s, 0.0, 2.0)
    assert attained.next_deadline(0.0) == pytest.approx(1.0)  # flush_s after the grant: not per grant or slice
    assert _journalled(path) == {}
    attained.on_timers(0.9)
    assert _journalled(path) == {}
    attained.on_timers(2.0)
    assert _journalled(path) == {"job-7": pytest.approx(2.0)}
    assert attained.next_deadline(2.0) == math.inf  # nothing changes and nothing holds: no more writes
    # While a job's session holds the token, its running slice is written every flush_s.
    clock.now = 10.0
    tokens.request(0, s.id, 10.0)
    assert attained.next_deadline(10.0) == pytest.approx(11.0)
    attained.on_timers(11.0)
    assert _journalled(path) == {"job-7": pytest.approx(3.0)}
    assert attained.next_deadline(11.0) == pytest.approx(12.0)
    attained.on_timers(12.5)
    # A daemon killed now keeps what was written: another ledger on the same journal reads it.
    restarted = AttainedService(sessions=SessionTable(), tokens=make_tokens(), journal=JournalWriter(
        Journal(path), Metrics(CollectorRegistry()), Bus()), clock=clock)
    restarted.restore()
    assert restarted.snapshot(13.0) == {"job-7": pytest.approx(4.5)}
    # The live ledger does not count the running slice twice once it ends.
    tokens.release_session(s, tokens.grant_of(s), 13.0)
    assert attained.snapshot(13.0) == {"job-7": pytest.approx(5.0)}


def test_the_ledger_forgets_the_smallest_idle_job_past_its_bound(ledger, tmp_path):
    attained, tokens, sessions, clock, path = ledger
    attained._max_jobs = 2
    for i, held in enumerate((3.0, 1.0, 2.0)):
        s = _join(tokens, sessions, _session(f"s-{i}", borrower=f"job-{i}"), 10.0 * i)
        _slice(tokens, clock, s, 10.0 * i, held)
        tokens.remove(0, s.id, clock.now)
        sessions.remove(s)
    assert attained.snapshot(40.0) == {"job-0": 3.0, "job-2": 2.0}
    attained.flush(40.0)
    assert _journalled(path) == {"job-0": 3.0, "job-2": 2.0}


# ------------------------------------------------------------------ the endpoint's ops


def test_renew_gives_a_lend_a_new_term_and_refuses_what_it_must(endpoint):
    cluster, rec, sessions, schedulers = endpoint
    cluster.on_lend(PLACEMENT, p.Lend(id=1, device=0, borrower="job-a", max_s=10.0), None, 0.0)
    assert rec.to(PLACEMENT)[-1].lent_until is not None
    cluster.on_renew(PLACEMENT, p.Renew(id=2, device=0, borrower="job-a", max_s=20.0), None, 5.0)
    reply = rec.to(PLACEMENT)[-1]
    assert isinstance(reply, p.LifecycleReply) and reply.id == 2 and reply.changed and reply.state == "LENT"
    # the lend ran to 10 s, the renewal at 5 s runs to 25 s: 15 s after the first term's end
    assert reply.lent_until == pytest.approx(rec.to(PLACEMENT)[0].lent_until + 15.0, abs=0.5)
    assert cluster.next_deadline(5.0) == pytest.approx(25.0)
    assert rec.of("renew") == [{"borrower": "job-a", "max_s": 20.0}]
    cluster.on_timers(10.0)
    assert rec.suspends == []  # the first term's end passed: the lease holds
    # Refused, each changing nothing: another job's renewal, bad values, a device not lent, no device.
    refusals = [(p.Renew(id=3, device=0, borrower="job-b", max_s=20.0), ROOT, p.ErrorCode.STATE),
                (p.Renew(id=4, device=0, borrower="job-a", max_s=20.0), USER, p.ErrorCode.FORBIDDEN),
                (p.Renew(id=5, device=1, borrower="job-a", max_s=20.0), None, p.ErrorCode.STATE),
                (p.Renew(id=6, device=9, borrower="job-a", max_s=20.0), None, p.ErrorCode.DEVICE),
                (p.Renew(id=7, device=0, borrower="job-a\n", max_s=20.0), None, p.ErrorCode.INVALID)]
    refusals += [(p.Renew(id=8 + i, device=0, borrower="job-a", max_s=bad), None, p.ErrorCode.INVALID)
                 for i, bad in enumerate((0.0, -1.0, math.inf, math.nan))]
    for msg, peer, code in refusals:
        route = PLACEMENT if peer is None else f"local-{msg.id}"
        cluster.on_renew(route, msg, peer, 11.0)
        answer = rec.to(route)[-1]
        assert isinstance(answer, p.Error) and (answer.id, answer.code) == (msg.id, code), answer
    assert cluster.next_deadline(11.0) == pytest.approx(25.0) and len(rec.of("renew")) == 1
    cluster.on_renew("root-conn", p.Renew(id=20, device=0, borrower="job-a", max_s=30.0), ROOT, 12.0)
    assert rec.to("root-conn")[-1].changed  # local root may renew too
    # A lease that ran out is reclaimed, and cannot be renewed then.
    cluster.on_timers(42.0)
    assert [s for s, _, _ in rec.suspends] == [] and cluster.device_state(0) == "PROTECT"
    cluster.on_renew(PLACEMENT, p.Renew(id=21, device=0, borrower="job-a", max_s=30.0), None, 43.0)
    assert rec.to(PLACEMENT)[-1].code == p.ErrorCode.STATE


def test_a_renewal_after_the_lease_ran_out_but_before_the_reclaim_is_refused(endpoint):
    cluster, rec, sessions, schedulers = endpoint
    cluster.on_lend(PLACEMENT, p.Lend(id=1, device=0, borrower="job-a", max_s=10.0), None, 0.0)
    cluster.on_renew(PLACEMENT, p.Renew(id=2, device=0, borrower="job-a", max_s=10.0), None, 10.0)
    assert rec.to(PLACEMENT)[-1].code == p.ErrorCode.STATE and "ran out" in rec.to(PLACEMENT)[-1].message


def test_set_weight_changes_a_sessions_share_and_refuses_what_it_must(endpoint):
    cluster, rec, sessions, schedulers = endpoint
    s = _session("s-a", borrower=None)
    schedulers[0].add_session(s.id, s.workload, s.weight, 0.0)
    sessions.add(s)
    cluster.on_set_weight(PLACEMENT, p.SetWeight(id=1, session="s-a", weight=4.0), None, 1.0)
    assert rec.to(PLACEMENT)[-1] == p.Ok(id=1)
    assert s.weight == 4.0
    assert next(v.weight for v in schedulers[0].snapshot(1.0).sessions if v.session == "s-a") == 4.0
    assert rec.of("weight") == [{"old": 1.0, "weight": 4.0}]
    refusals = [(p.SetWeight(id=2, session="s-a", weight=2.0), USER, p.ErrorCode.FORBIDDEN),
                (p.SetWeight(id=3, session="s-gone", weight=2.0), None, p.ErrorCode.NO_SESSION)]
    for msg, peer, code in refusals:
        route = PLACEMENT if peer is None else "local-user"
        cluster.on_set_weight(route, msg, peer, 2.0)
        answer = rec.to(route)[-1]
        assert isinstance(answer, p.Error) and (answer.id, answer.code) == (msg.id, code), answer
    assert s.weight == 4.0 and len(rec.of("weight")) == 1
    for i, bad in enumerate((0.0, -1.0, math.inf, math.nan, 2e6)):  # refused as the frame is decoded
        with pytest.raises(codec.BadFrame) as refused:
            codec.decode_request(codec.encode(p.SetWeight(id=4 + i, session="s-a", weight=bad)))
        assert (refused.value.request_id, refused.value.code) == (4 + i, p.ErrorCode.INVALID), refused.value
    cluster.on_set_weight("root-conn", p.SetWeight(id=20, session="s-a", weight=0.5), ROOT, 3.0)
    assert rec.to("root-conn")[-1] == p.Ok(id=20) and s.weight == 0.5


# ------------------------------------------------------------------ a real daemon


def _attained(peer) -> dict[str, float]:
    return peer.call(p.Inventory(id=0)).attained_gpu_s


def _journal_rows(node) -> dict[str, float]:
    path = os.path.join(node.daemon.workdir, "state", "state.db")
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            return dict(db.execute("SELECT job, gpu_s FROM attained"))
    except sqlite3.OperationalError:  # not migrated yet
        return {}


def test_a_sigkilled_daemon_keeps_every_jobs_attained_service(cluster_node, start_daemon, spawn):
    node = cluster_node("--cpu-devices", "2")
    peer = node.peer()
    assert peer.call(p.Lend(id=0, device=0, borrower="job-7")).changed
    assert peer.call(p.Lend(id=0, device=1, borrower="job-8")).changed
    per_session = []
    for name in ("a1", "a2"):  # job-7 runs twice, one session after the other (a job that restarted)
        with Client(name, workload="training", endpoint=node.daemon.endpoint, borrower="job-7") as c:
            c.acquire()
            c.release()
            per_session.append(peer.call(p.Inventory(id=0)).devices[0].sessions[0].gpu_time_s)
    assert all(t > 0 for t in per_session)
    assert _attained(peer)["job-7"] == pytest.approx(sum(per_session), abs=1e-4)
    # job-8's session holds the token when the daemon dies: its running slice was written up to a flush.
    holder = spawn(node.daemon.endpoint, "hold", "--name", "b", "--borrower", "job-8")
    holder.expect("GRANT")
    written = wait_for(lambda: (rows := _journal_rows(node)).get("job-8", 0) > 0 and "job-7" in rows and rows)
    assert written["job-7"] == pytest.approx(sum(per_session), abs=1e-4)
    node.daemon.proc.kill()
    node.daemon.proc.wait()
    start_daemon("--cpu-devices", "2")
    after = wait_for(lambda: inventory_or_none(peer)).attained_gpu_s
    assert after["job-7"] == pytest.approx(written["job-7"], abs=1e-4)
    assert after["job-8"] >= written["job-8"]
    holder.kill()
    peer.close()


def test_a_clean_stop_journals_the_service_no_flush_had_written_yet(cluster_node, spawn):
    """SIGTERM: the server flushes the ledger before the journal closes. job-7's slice ended less
    than a flush interval (1 s) before the stop, and job-8's session holds the token when it comes:
    without that last flush, job-7 has no row and job-8's row lags by up to a second."""
    node = cluster_node("--cpu-devices", "2")
    peer = node.peer()
    assert peer.call(p.Lend(id=0, device=0, borrower="job-7")).changed
    assert peer.call(p.Lend(id=0, device=1, borrower="job-8")).changed
    holder = spawn(node.daemon.endpoint, "hold", "--name", "b", "--borrower", "job-8")
    holder.expect("GRANT")
    wait_for(lambda: _journal_rows(node).get("job-8", 0) > 0)  # a periodic flush has run: the next is < 1 s away
    with Client("a", workload="training", endpoint=node.daemon.endpoint, borrower="job-7") as c:
        c.acquire()
        c.release()
        before = _attained(peer)
        node.daemon.proc.terminate()
        assert node.daemon.proc.wait(timeout=30) == 0
    rows = _journal_rows(node)
    assert rows.get("job-7") == pytest.approx(before["job-7"], abs=1e-4)
    assert rows["job-8"] >= before["job-8"]
    holder.kill()
    peer.close()


def test_renew_and_set_weight_over_the_wire(cluster_node):
    node = cluster_node("--cpu-devices", "1")
    peer = node.peer()
    lent = peer.call(p.Lend(id=0, device=0, borrower="job-7", max_s=100.0))
    renewed = peer.call(p.Renew(id=0, device=0, borrower="job-7", max_s=1000.0))
    assert isinstance(renewed, p.LifecycleReply) and renewed.changed
    assert renewed.lent_until == pytest.approx(lent.lent_until + 900.0, abs=5.0)
    assert peer.call(p.Inventory(id=0)).devices[0].lent_until == pytest.approx(renewed.lent_until, abs=0.01)
    refused = peer.call(p.Renew(id=0, device=0, borrower="job-8", max_s=10.0))
    assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.STATE
    with Client("t", workload="training", endpoint=node.daemon.endpoint, borrower="job-7") as trainer:
        assert isinstance(peer.call(p.SetWeight(id=0, session=trainer.session_id, weight=3.0)), p.Ok)
        assert peer.call(p.Inventory(id=0)).devices[0].sessions[0].weight == 3.0
        bad = peer.call(p.SetWeight(id=0, session=trainer.session_id, weight=-1.0))
        gone = peer.call(p.SetWeight(id=0, session="s-nobody", weight=1.0))
        assert (bad.code, gone.code) == (p.ErrorCode.INVALID, p.ErrorCode.NO_SESSION)
    peer.close()
