"""ClusterEndpoint stepped by hand: no daemon and no sockets. It touches only what its
constructor is given, so these fakes are all it needs (tests/daemon/test_cluster.py drives the
same operations through a real daemon and real CURVE sockets)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from client_lib import protocol as p
from nodeagent.daemon.bus import SuspendFinished
from nodeagent.daemon.cluster import EXPIRY_DEADLINE_MS, ClusterRoute
from nodeagent.procwatch import PeerCredentials, own_namespaces
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import Workload
from tests.daemon.cluster_stepped import PLACEMENT


def _borrower_session(sessions: SessionTable, schedulers, sid: str, borrower: str, device: int = 0) -> Session:
    s = Session(id=sid, key="k", route=f"conn-{sid}", name=sid, claimed_pid=1, verified_pid=None, start_ticks=None,
                uid=None, workload=Workload.parse("training"), weight=1.0, device=device, memory_mb=0,
                last_seen=0.0, borrower=borrower)
    schedulers[device].add_session(s.id, s.workload, s.weight, 0.0)
    sessions.add(s)
    return s


def test_a_lent_device_admits_only_its_borrower_and_a_reclaim_answers_once_it_is_off(endpoint):
    cluster, rec, sessions, schedulers = endpoint
    cluster.on_lend(PLACEMENT, p.Lend(id=1, device=0, borrower="job-a"), None, 0.0)
    assert rec.to(PLACEMENT) == [p.LifecycleReply(id=1, device=0, state="LENT", borrower="job-a", changed=True)]
    assert rec.of("lend") == [{"borrower": "job-a", "max_s": None}]
    assert cluster.admission_refusal(0, "training", "job-a") is None
    assert cluster.admission_refusal(0, "training", "job-b") is not None
    assert cluster.admission_refusal(1, "training", "job-a") is not None  # the other device is not lent

    s = _borrower_session(sessions, schedulers, "s-a", "job-a")
    _borrower_session(sessions, schedulers, "s-other", "job-b", device=1)  # not on the device: left alone
    cluster.on_reclaim(PLACEMENT, p.Reclaim(id=2, device=0, deadline_ms=800.0), None, 1.0)
    assert rec.suspends == [("s-a", 800.0, "reclaim")]
    second = ClusterRoute(b"placement-2")
    cluster.on_reclaim(second, p.Reclaim(id=3, device=0), None, 1.2)  # joins the reclaim under way
    assert len(rec.suspends) == 1 and len(rec.to(PLACEMENT)) == 1 and rec.to(second) == []

    rec.parked["s-a"] = 4096  # what the suspension component says it parked
    cluster.on_suspend_finished(SuspendFinished(s, "suspended", 300.0, 1.5))
    for route, request_id in ((PLACEMENT, 2), (second, 3)):
        reply = rec.to(route)[-1]
        assert isinstance(reply, p.ReclaimReply) and reply.id == request_id
        assert reply.outcomes == {"s-a": "suspended"} and reply.changed and reply.free_ms == pytest.approx(500.0)
        assert reply.state == "PROTECT"
    assert rec.of("reclaim") == [{"borrower": "job-a", "free_ms": 500.0, "sessions": 1, "suspended": 1,
                                  "attained_gpu_s": 0.0}]
    assert [(d["outcome"], d["bytes_parked"]) for d in rec.of("suspend")] == [("suspended", 4096)]


def test_a_lend_that_runs_out_starts_a_reclaim_at_its_deadline(endpoint):
    cluster, rec, sessions, schedulers = endpoint
    cluster.on_lend(PLACEMENT, p.Lend(id=1, device=0, borrower="job-a", max_s=10.0), None, 0.0)
    _borrower_session(sessions, schedulers, "s-a", "job-a")
    assert cluster.next_deadline(0.0) == pytest.approx(10.0)
    cluster.on_timers(9.9)
    assert rec.suspends == []
    cluster.on_timers(10.0)
    assert rec.suspends == [("s-a", EXPIRY_DEADLINE_MS, "reclaim")]
    assert ("LENT", "PROTECT") in [(d["old"], d["new"]) for d in rec.of("device_state")]


def test_operations_need_root_locally_and_a_reclaim_under_way_is_answered_at_close(endpoint):
    cluster, rec, sessions, schedulers = endpoint
    user = SimpleNamespace(creds=PeerCredentials(uid=1000, gid=1000, pid=4242))
    cluster.on_lend("local-conn", p.Lend(id=1, device=0, borrower="job-a"), user, 0.0)
    [refused] = rec.to("local-conn")
    assert refused.code == p.ErrorCode.FORBIDDEN
    assert cluster.admission_refusal(0, "training", "job-a") is not None  # not lent: the refusal changed nothing
    root = SimpleNamespace(creds=PeerCredentials(uid=0, gid=0, pid=1, namespaces=own_namespaces()))
    cluster.on_lend("root-conn", p.Lend(id=2, device=0, borrower="job-a"), root, 0.0)
    assert rec.to("root-conn")[-1].state == "LENT"

    _borrower_session(sessions, schedulers, "s-a", "job-a")
    cluster.on_reclaim(PLACEMENT, p.Reclaim(id=3, device=0), None, 1.0)
    assert rec.to(PLACEMENT) == []
    cluster.close()
    [answer] = rec.to(PLACEMENT)
    assert answer.id == 3 and answer.code == p.ErrorCode.SHUTTING_DOWN
    assert cluster.events is None  # nothing is published after close
    cluster.event("health", devices=2)  # and publishing then is a no-op, not an error


def test_a_lost_device_is_not_lent(endpoint):
    """Before: a device NVML reported lost was lent like any other, and the borrower's
    workers then could not start there. Now: E_DEVICE saying why, nothing moves."""
    cluster, rec, sessions, schedulers = endpoint
    cluster.test_lost_devices.lose(0, "GPU has fallen off the bus")
    cluster.on_lend(PLACEMENT, p.Lend(id=1, device=0, borrower="job-a"), None, 0.0)
    [refusal] = rec.to(PLACEMENT)
    assert isinstance(refusal, p.Error) and refusal.code == p.ErrorCode.DEVICE and refusal.id == 1
    assert "fallen off the bus" in refusal.message and rec.of("lend") == []
    assert "FREE" in cluster.admission_refusal(0, "training", "job-a")  # not lent: the borrower is not let in
    cluster.test_lost_devices.back(0)
    cluster.on_lend(PLACEMENT, p.Lend(id=2, device=0, borrower="job-a"), None, 1.0)
    assert rec.to(PLACEMENT)[-1] == p.LifecycleReply(id=2, device=0, state="LENT", borrower="job-a", changed=True)


def test_a_borrower_with_control_characters_is_not_lent_to(endpoint):
    """Hello refuses such a borrower (a newline forges a log line; escapes reach operators'
    terminals through status), so a loan to one could only be written to the log and matched by
    no session. Refused the same way, and the device stays FREE."""
    cluster, rec, _, _ = endpoint
    cluster.on_lend(PLACEMENT, p.Lend(id=1, device=0, borrower="job-a\nlend device=1 borrower=x"), None, 0.0)
    cluster.on_lend(PLACEMENT, p.Lend(id=2, device=0, borrower="job-\x1b[2Ja"), None, 0.0)
    errors = rec.to(PLACEMENT)
    assert [(e.id, e.code, e.message) for e in errors] == [
        (rid, p.ErrorCode.INVALID, "borrower must be printable (no control characters)") for rid in (1, 2)]
    assert rec.of("lend") == [] and cluster.device_state(0) == "FREE"


def test_a_lend_s_end_on_the_wall_clock_is_one_time_however_late_in_its_turn_it_is_read(endpoint):
    # A turn's ``now`` is read when the turn starts; a reply, the inventory or the journal may
    # convert a time with it much later in that turn on a loaded host. Converting with the wall
    # clock of the call instead of the turn moved a lend's end by the turn's length (a renew reply
    # and the inventory that followed disagreed by tens of ms under load).
    cluster, rec, sessions, schedulers = endpoint
    cluster._clock = time.monotonic  # the loop's real clock, as the daemon's
    now = time.monotonic()
    cluster.on_lend(PLACEMENT, p.Lend(id=1, device=0, borrower="job-a", max_s=100.0), None, now)
    [(_, _, at_once)] = [f for f in cluster.lifecycle_facts(now)][:1]
    time.sleep(0.2)  # the rest of a slow turn
    [(_, _, later)] = [f for f in cluster.lifecycle_facts(now)][:1]
    assert later == pytest.approx(at_once, abs=0.01)
    assert at_once == pytest.approx(time.time() - 0.2 + 100.0, abs=0.05)
