"""Whole-device suspend and resume through the daemon, over real processes."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from client_lib import Client, DaemonError, ErrorCode, resume_session, suspend_session
from tests.conftest import wait_for
from tests.proc_tools import assert_stopped, proc_state


def session_by_name(daemon, name):
    return next(s for d in daemon.status().devices for s in d.sessions if s.name == name)


def test_a_cooperative_trainer_parks_frees_the_device_and_resumes(start_daemon, spawn, workdir):
    d = start_daemon("--quantum-ms", "training=1000")
    stop = os.path.join(workdir, "stop")  # the trainer's work ends on this cue, not after fixed seconds of CPU
    trainer = spawn(d.endpoint, "loop", "--name", "trainer", "--seconds", "60", "--park-bytes", "123456",
                    "--stop-file", stop)
    sid = trainer.expect("SESSION")[2]
    trainer.expect("GRANT")
    result = suspend_session(sid, deadline_ms=2000, endpoint=d.endpoint)
    assert (result.outcome, result.bytes_parked) == ("suspended", 123456)
    assert 0 < result.elapsed_ms < 1000
    trainer.expect("PARKED")
    info = session_by_name(d, "trainer")
    assert (info.suspended, info.state, info.bytes_parked) == ("suspended", "idle", 123456)
    # The host memory the client keeps for the state is counted (protocol 2.5), pinned.
    assert (info.host_bytes, info.host_pinned) == (126976, True)
    # The device is free: another session gets it at once, for as long as it likes.
    with Client("other", endpoint=d.endpoint) as other:
        other.acquire(timeout=1)
        time.sleep(0.3)
        assert not trainer.events("UNPARKED")  # still parked: it waits for resume
    resumed_at = time.monotonic()
    resume_session(sid, endpoint=d.endpoint)
    unparked = trainer.expect("UNPARKED")
    assert unparked[1] >= resumed_at - 0.01
    assert session_by_name(d, "trainer").suspended is None
    # Kept across the resume for the next park, so still counted.
    wait_for(lambda: session_by_name(d, "trainer").host_bytes == 126976)
    open(stop, "w").close()
    assert int(trainer.expect("DONE", timeout=20)[2]) > 0


def test_a_trainer_that_never_yields_is_stopped_at_the_deadline_and_continued_on_resume(start_daemon, spawn):
    d = start_daemon()
    hog = spawn(d.endpoint, "stubborn", "--name", "hog")
    sid = hog.expect("SESSION")[2]
    hog.expect("TICK", count=2)
    result = suspend_session(sid, deadline_ms=200, endpoint=d.endpoint)
    assert result.outcome == "stopped" and 190 <= result.elapsed_ms < 1000
    assert_stopped(hog.proc.pid)
    info = session_by_name(d, "hog")
    assert info.suspended == "stopped" and d.status().devices[0].holder is None  # the device is free
    resume_session(sid, endpoint=d.endpoint)
    wait_for(lambda: proc_state(hog.proc.pid) != "T")
    count = len(hog.events("TICK"))
    hog.expect("TICK", count=count + 3)


def test_a_second_suspend_of_a_suspended_session_answers_at_once(start_daemon, spawn, workdir):
    d = start_daemon()
    stop = os.path.join(workdir, "stop")
    trainer = spawn(d.endpoint, "loop", "--name", "t", "--seconds", "60", "--park-bytes", "10", "--stop-file", stop)
    sid = trainer.expect("SESSION")[2]
    trainer.expect("GRANT")
    assert suspend_session(sid, endpoint=d.endpoint).outcome == "suspended"
    again = suspend_session(sid, endpoint=d.endpoint)
    assert (again.outcome, again.elapsed_ms, again.bytes_parked) == ("suspended", 0.0, 10)
    resume_session(sid, endpoint=d.endpoint)
    resume_session(sid, endpoint=d.endpoint)  # idempotent
    open(stop, "w").close()
    trainer.expect("DONE", timeout=20)


def test_the_requester_hears_gone_if_the_session_leaves(start_daemon, spawn):
    d = start_daemon()
    hog = spawn(d.endpoint, "hold", "--name", "leaver")
    sid = hog.expect("SESSION")[2]
    hog.expect("GRANT")
    results = []
    t = threading.Thread(target=lambda: results.append(suspend_session(sid, deadline_ms=60_000, endpoint=d.endpoint)))
    t.start()
    wait_for(lambda: session_by_name(d, "leaver").suspended == "requested")
    hog.kill()
    t.join(timeout=10)
    assert results and results[0].outcome == "gone"


def test_suspend_requests_are_validated(inproc_daemon):
    d = inproc_daemon
    with pytest.raises(DaemonError) as info:
        suspend_session("s-nobody", endpoint=d.endpoint)
    assert info.value.code == ErrorCode.NO_SESSION
    with Client("target", endpoint=d.endpoint) as target:
        with pytest.raises(DaemonError) as info:
            suspend_session(target.session_id, deadline_ms=-1, endpoint=d.endpoint)
        assert info.value.code == ErrorCode.INVALID


def test_an_unverifiable_peer_may_not_suspend(start_inproc_daemon, workdir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_inproc_daemon(endpoint=f"tcp://127.0.0.1:{port}")
    with Client("target", endpoint=d.endpoint) as target:
        with pytest.raises(DaemonError) as info:
            suspend_session(target.session_id, endpoint=d.endpoint)
        assert info.value.code == ErrorCode.FORBIDDEN and "unverifiable" in str(info.value)
        with pytest.raises(DaemonError) as info:
            resume_session(target.session_id, endpoint=d.endpoint)
        assert info.value.code == ErrorCode.FORBIDDEN


def test_an_inference_session_that_does_not_fit_suspends_training_to_make_room(start_daemon, spawn, workdir):
    with open(f"{workdir}/nodeagent.toml", "w") as f:
        f.write('[memory]\nmake_room = "suspend"\nmake_room_deadline_ms = 3000\n')
    d = start_daemon()
    big = int(d.status().devices[0].memory_capacity_mb * 0.6)
    trainer = spawn(d.endpoint, "loop", "--name", "trainer", "--seconds", "10", "--memory-mb", str(big),
                    "--park-bytes", "4096")
    trainer.expect("GRANT")
    # Training may not push out training: refused as before.
    with pytest.raises(DaemonError) as info:
        Client("hungry-trainer", memory_mb=big, endpoint=d.endpoint)
    assert info.value.code == ErrorCode.NO_MEMORY
    # Inference does not fit either, but suspending the trainer frees enough.
    with Client("infer", workload="inference", memory_mb=big, endpoint=d.endpoint) as infer:
        infer.acquire(timeout=10)
        granted_at = time.monotonic()
        parked = trainer.expect("PARKED")
        assert parked[1] < granted_at  # the trainer's state left the device before inference got it
        info = session_by_name(d, "trainer")
        assert info.suspended == "suspended" and info.bytes_parked == 4096
        assert "reason=memory" in d.log()
        assert d.status().devices[0].memory_declared_mb == big  # the trainer's declaration is parked


def test_room_is_made_before_inference_runs_even_when_the_victim_does_not_cooperate(start_daemon, spawn, workdir):
    # The victim holds the token and never reaches a yield point. Plain preemption would
    # hand inference the device after the 100 ms grace with the victim's memory still on it;
    # made-room admission waits until the victim is off (here: stopped at its 1 s deadline).
    with open(f"{workdir}/nodeagent.toml", "w") as f:
        f.write('[memory]\nmake_room = "suspend"\nmake_room_deadline_ms = 1000\n[scheduler]\ngrace_ms = 100\n')
    d = start_daemon()
    big = int(d.status().devices[0].memory_capacity_mb * 0.6)
    hog = spawn(d.endpoint, "stubborn", "--name", "hog", "--memory-mb", str(big))
    hog.expect("TICK", count=2)
    with Client("infer", workload="inference", memory_mb=big, endpoint=d.endpoint) as infer:
        asked = time.monotonic()
        infer.acquire(timeout=10)
        waited = time.monotonic() - asked
        assert waited > 0.8, waited  # not the 0.1 s grace: the suspension's deadline
        assert session_by_name(d, "hog").suspended == "stopped"
        assert_stopped(hog.proc.pid)


def test_a_pending_suspend_request_is_answered_at_shutdown_not_left_to_its_timeout(start_daemon, spawn):
    d = start_daemon()
    holder = spawn(d.endpoint, "hold", "--name", "holder")  # never parks: the suspension stays pending
    sid = holder.expect("SESSION")[2]
    holder.expect("GRANT")
    answers = []

    def ask():
        started = time.monotonic()
        try:
            suspend_session(sid, deadline_ms=60_000, endpoint=d.endpoint, timeout=30)
            answers.append(("result", time.monotonic() - started))
        except Exception as exc:  # noqa: BLE001 - the test asserts on what it was
            answers.append((exc, time.monotonic()))
    t = threading.Thread(target=ask)
    t.start()
    wait_for(lambda: session_by_name(d, "holder").suspended == "requested")
    stopped_at = time.monotonic()
    assert d.stop() == 0  # SIGTERM
    t.join(timeout=35)
    (exc, answered_at), = answers
    assert isinstance(exc, DaemonError) and exc.code == ErrorCode.SHUTTING_DOWN, exc
    assert "shutting down" in str(exc) and sid in str(exc)
    assert answered_at - stopped_at < 2.0  # at once, not after the requester's 30 s


def test_suspensions_can_be_stepped_by_hand_and_a_missed_deadline_of_an_unverifiable_session_is_a_timeout():
    """The component with scripted collaborators and no loop: the deadline it reports is
    the one the loop sleeps to; missing it with a process it may not stop (``stop`` says no)
    reports ``timeout`` to the requester and to the cluster once, and the suspension is no
    longer under way (it may still suspend later)."""
    from prometheus_client import CollectorRegistry

    from client_lib import protocol as p
    from nodeagent.config import ServeConfig
    from nodeagent.daemon.bus import Bus, SuspendFinished
    from nodeagent.daemon.journal_writer import JournalWriter
    from nodeagent.metrics import Metrics
    from tests.daemon_parts import replies
    from nodeagent.daemon.sessions import Session, SessionTable
    from nodeagent.daemon.suspension import Suspensions
    from sharing import TokenScheduler, Workload
    from sharing.suspension import SuspendState

    config = ServeConfig(backend="cpu")
    scheduler = TokenScheduler(0, config.policy())
    sessions = SessionTable()
    s = Session(id="s-t", key="k", route="trainer", name="t", claimed_pid=1, verified_pid=None, start_ticks=None,
                uid=None, workload=Workload.TRAINING, weight=1.0, device=0, memory_mb=0, last_seen=0.0)
    scheduler.add_session(s.id, s.workload, s.weight, 0.0)
    sessions.add(s)
    sent, finished, stop_asked = [], [], []

    class ScriptedTokens:
        """What Suspensions asks of the tokens component: this scheduler's state, and a stop
        that is refused (an unverifiable process)."""

        device_count = 1

        def state(self, device, sid):
            return scheduler.state(sid)

        def cancel_session(self, victim, now):
            scheduler.cancel(victim.id, now)

        def end_slice(self, victim, now):
            pass

        def stop(self, victim):
            stop_asked.append(victim.id)
            return False

        def grant_of(self, s):
            return None  # the scheduler's grant is not carried out here: no grant id was sent

    bus = Bus()
    bus.subscribe(SuspendFinished, lambda e: finished.append((e.session.id, e.outcome, e.elapsed_ms)))
    suspensions = Suspensions(sessions=sessions, tokens=ScriptedTokens(), metrics=Metrics(CollectorRegistry()),
                              replies=replies(sent), bus=bus, journal=JournalWriter(None, Metrics(CollectorRegistry()), bus))
    try:
        suspensions.wait_for(s, "operator", 5)
        assert suspensions.asked_on(0) == 0
        suspensions.begin(s, 500.0, 10.0, reason="requested")
        assert suspensions.under_way(s) and suspensions.next_deadline(10.0) == 10.5
        assert (suspensions.asked_on(0), suspensions.asked_on(1)) == (1, 0)  # status's activity.suspensions
        assert sent == [("trainer", p.SuspendNotice(deadline_ms=500.0, reason="requested"))]
        suspensions.on_timers(10.49)
        assert stop_asked == [] and finished == []
        suspensions.on_timers(10.5)
        assert stop_asked == ["s-t"] and finished == [("s-t", "timeout", 500.0)]
        assert not suspensions.under_way(s) and suspensions.next_deadline(10.5) is None
        [(route, result)] = sent[1:]
        assert (route, result.id, result.outcome) == ("operator", 5, "timeout")
        assert suspensions.state(s) is SuspendState.REQUESTED and suspensions.waiters(s) == ()
        suspensions.on_timers(20.0)
        suspensions.forget(s, 20.0)  # reported once: nothing more to tell when it ends
        assert len(finished) == 1
    finally:
        sessions.close()


@pytest.mark.parametrize("reason", ["memory", "reclaim"])
def test_sessions_a_make_room_suspension_blocked_ask_before_its_end_reaches_a_reclaim(reason):
    """Only a make-room suspension reaches the token gate (``MakeRoomFinished``), and before its
    ``SuspendFinished`` (a reclaim waiting on the same suspension is answered then): the session
    it blocked has asked for the token by the time the reclaim hears it. Any other suspension
    ends without the gate hearing it."""
    from prometheus_client import CollectorRegistry

    from nodeagent.daemon.bus import Bus, MakeRoomFinished, SuspendFinished
    from nodeagent.daemon.gate import TokenGate
    from nodeagent.daemon.journal_writer import JournalWriter
    from nodeagent.daemon.sessions import Session, SessionTable
    from nodeagent.daemon.suspension import MAKE_ROOM, Suspensions
    from nodeagent.metrics import Metrics
    from sharing import SessionState, Workload
    from tests.daemon_parts import FakeDevices, replies

    asked = []

    class ScriptedTokens:
        """The victim holds its token and may not be stopped (unverifiable): its deadline reports
        ``timeout``; the gate's requests are recorded."""

        def state(self, device, sid):
            return SessionState.HOLDING

        def cancel_session(self, victim, now):
            pass

        def end_slice(self, victim, now):
            pass

        def stop(self, victim):
            return False

        def grant_of(self, s):
            return None  # held in the scheduler's state alone: no grant id was sent

        def waiting_since(self, s):
            return None

        def on_device(self, device, sid):
            return True

        def request(self, device, sid, now, waiting_since=None):
            asked.append(sid)

    sessions = SessionTable()

    def add(sid, workload):
        s = Session(id=sid, key="k", route=sid, name=sid, claimed_pid=1, verified_pid=None, start_ticks=None,
                    uid=None, workload=workload, weight=1.0, device=0, memory_mb=0, last_seen=0.0)
        sessions.add(s)
        return s

    victim, admitted = add("s-train", Workload.TRAINING), add("s-infer", Workload.INFERENCE)
    tokens, bus, heard = ScriptedTokens(), Bus(), []
    suspensions = Suspensions(sessions=sessions, tokens=tokens, metrics=Metrics(CollectorRegistry()),
                              replies=replies([]), bus=bus, journal=JournalWriter(None, Metrics(CollectorRegistry()), bus))
    gate = TokenGate(sessions=sessions, tokens=tokens, devices=FakeDevices(1), suspensions=suspensions)
    bus.subscribe(MakeRoomFinished, gate.on_make_room_finished)
    bus.subscribe(MakeRoomFinished, lambda e: heard.append(("make-room", e.session)))
    bus.subscribe(SuspendFinished, lambda e: heard.append(("finished", e.session.id, list(asked))))
    try:
        assert MAKE_ROOM == "memory"  # the reason admission's plan suspends with (and the log shows)
        gate.block(admitted, [victim])
        gate.ask(admitted, 10.0)
        suspensions.begin(victim, 500.0, 10.0, reason=reason)
        suspensions.on_timers(10.5)
        if reason == MAKE_ROOM:
            assert heard == [("make-room", "s-train"), ("finished", "s-train", ["s-infer"])]
        else:
            assert heard == [("finished", "s-train", [])] and asked == [] and gate.kept(admitted)
    finally:
        sessions.close()


@pytest.mark.parametrize("when", ["suspended", "requested"])
def test_a_daemon_sigkilled_mid_suspension_finishes_it_after_a_restart(start_daemon, spawn, when):
    """Issue 22: a suspension is journalled before its notice; a restarted daemon keeps it.
    ``suspended``: the client had parked; after the restart it stays parked (the welcome says
    so) and only a resume brings it back. ``requested``: the client had not parked yet (stopped
    by the test meanwhile); the restarted daemon asks again and the suspension completes."""
    import signal as signals
    d = start_daemon("--heartbeat-ms", "200")
    trainer = spawn(d.endpoint, "loop", "--name", "trainer", "--seconds", "30", "--park-bytes", "4096")
    trainer.expect("GRANT")
    sid = session_by_name(d, "trainer").id
    if when == "requested":
        os.kill(trainer.proc.pid, signals.SIGSTOP)  # it cannot park before the daemon dies
        threading.Thread(target=lambda: _suspend_quietly(sid, d.endpoint), daemon=True).start()
        wait_for(lambda: session_by_name(d, "trainer").suspended == "requested")
    else:
        assert suspend_session(sid, deadline_ms=5000, endpoint=d.endpoint).outcome == "suspended"
        trainer.expect("PARKED")
    d.kill()  # SIGKILL: no goodbye, the journal is all the next one has
    d2 = start_daemon("--heartbeat-ms", "200")
    if when == "requested":
        os.kill(trainer.proc.pid, signals.SIGCONT)
        trainer.expect("PARKED", timeout=10)  # asked again by the restarted daemon, it parks now
    wait_for(lambda: getattr(_session_or_none(d2, "trainer"), "suspended", None) == "suspended", timeout=10)
    wait_for(lambda: session_by_name(d2, "trainer").attached, timeout=10)  # its reattach backs off (issue 32)
    info = session_by_name(d2, "trainer")
    assert info.id == sid and info.bytes_parked == 4096 and info.attached
    time.sleep(0.3)
    assert not trainer.events("UNPARKED")  # still parked: the restart did not resume it
    resume_session(sid, endpoint=d2.endpoint)
    trainer.expect("UNPARKED", timeout=10)
    wait_for(lambda: session_by_name(d2, "trainer").suspended is None)


def _session_or_none(daemon, name):
    return next((s for d in daemon.status().devices for s in d.sessions if s.name == name), None)


def _suspend_quietly(sid: str, endpoint: str) -> None:
    """A suspend whose caller dies with the daemon (its answer never comes)."""
    try:
        suspend_session(sid, deadline_ms=10_000, endpoint=endpoint, timeout=15)
    except Exception:
        pass


def _refused(d, claim: str) -> float:
    return d.server.metrics.registry.get_sample_value("nodeagent_refused_claims_total", {"claim": claim})


def test_a_report_no_suspension_asked_for_is_refused_and_counted(inproc_daemon):
    """A session never asked to suspend cannot say it parked, nor set the host memory it keeps
    (nodeagent_host_kept_bytes): its suspended is answered E_INVALID, its resumed ignored, both
    counted. Asked, it may report, but not more host memory than the host has."""
    from client_lib import protocol as p
    from nodeagent.daemon.suspension import HOST_MEMORY_BYTES
    from tests.rawpeer import RawPeer

    d = inproc_daemon
    liar = RawPeer(d.endpoint)
    sid = liar.hello("liar").session
    reply = liar.call(p.Suspended(id=liar.take_id(), bytes_parked=1, suspend_ms=1.0, host_bytes=9 * 10**15,
                                  host_pinned=True))
    assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID and "not asked" in reply.message
    liar.send(p.Resumed(id=liar.take_id(), resume_ms=1.0, host_bytes=9 * 10**15))
    wait_for(lambda: _refused(d, "resumed") == 1)
    info = session_by_name(d, "liar")
    assert (info.host_bytes, info.host_pinned, info.suspended) == (0, False, None)
    assert _refused(d, "suspended") == 1
    # Asked now (by its owner): the report is believed, but not a host bigger than this one.
    results = []
    t = threading.Thread(target=lambda: results.append(suspend_session(sid, deadline_ms=60_000, endpoint=d.endpoint)))
    t.start()
    liar.next_notice(p.SuspendNotice)
    reply = liar.call(p.Suspended(id=liar.take_id(), bytes_parked=1, suspend_ms=1.0,
                                  host_bytes=HOST_MEMORY_BYTES + 1))
    assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID and "host" in reply.message
    assert _refused(d, "host_bytes") == 1
    liar.send(p.Suspended(id=liar.take_id(), bytes_parked=7, suspend_ms=1.0, host_bytes=4096, host_pinned=True))
    t.join(timeout=10)
    assert results and (results[0].outcome, results[0].bytes_parked) == ("suspended", 7)
    assert (session_by_name(d, "liar").host_bytes, _refused(d, "suspended")) == (4096, 1)
    kept = d.server.metrics.registry.get_sample_value("nodeagent_host_kept_bytes", {"device": "0", "pinned": "true"})
    assert kept == 4096  # read at scrape time from the suspension component
    liar.close()


def test_a_suspended_session_whose_connection_closes_is_lost_at_once_not_given_the_ended_grace(inproc_daemon):
    """A session that left nothing undone may be waiting for its process to end (ENDED_GRACE_S,
    detached meanwhile); a suspended one left its state parked, so its closed connection loses it
    at once: the daemon never shows it detached."""
    from client_lib import protocol as p
    from tests.rawpeer import RawPeer

    d = inproc_daemon
    peer = RawPeer(d.endpoint)
    sid = peer.hello("parked").session
    results = []
    t = threading.Thread(target=lambda: results.append(suspend_session(sid, deadline_ms=60_000, endpoint=d.endpoint)))
    t.start()
    peer.next_notice(p.SuspendNotice)
    peer.send(p.Suspended(id=peer.take_id(), bytes_parked=7, suspend_ms=1.0))
    t.join(timeout=10)
    assert results and results[0].outcome == "suspended"

    def found():
        return next((s for dev in d.status().devices for s in dev.sessions if s.id == sid), None)

    assert found().attached
    peer.close()
    wait_for(lambda: found() is None or not found().attached)
    assert found() is None  # dropped when its connection closed, never kept detached


def test_a_waiting_session_asked_to_suspend_leaves_the_line_and_its_wait_is_no_longer_timed():
    """Stepped by hand over real tokens: the holder's release then grants nobody, and the wait
    of the suspended session is not observed when it is granted after its resume."""
    from nodeagent.daemon.sessions import Session, SessionTable
    from sharing import SessionState, Workload
    from tests.daemon_parts import make_suspensions, make_tokens

    sessions = SessionTable()
    try:
        tokens = make_tokens(sessions=sessions)
        suspensions = make_suspensions(sessions=sessions, tokens=tokens)
        holder, waiter = (Session(id=sid, key="k", route=sid, name=sid, claimed_pid=1, verified_pid=None,
                                  start_ticks=None, uid=None, workload=Workload.TRAINING, weight=1.0, device=0,
                                  memory_mb=0, last_seen=0.0) for sid in ("s-hold", "s-wait"))
        for s in (holder, waiter):
            sessions.add(s)
            tokens.add(0, s.id, s.workload, s.weight, 0.5)
        for s in (holder, waiter):
            tokens.time_wait(s, 1.0)
            tokens.request(0, s.id, 1.0)
        assert tokens.state(0, waiter.id) is SessionState.WAITING and tokens.waiting_since(waiter) == 1.0
        suspensions.begin(waiter, 1000.0, 2.0, reason="requested")
        assert tokens.state(0, waiter.id) is SessionState.IDLE and tokens.waiting_since(waiter) is None
        tokens.release_session(holder, tokens.grant_of(holder), 3.0)
        assert tokens.grant_of(waiter) is None
    finally:
        sessions.close()
