"""Grant ids (nodeagent/daemon/tokens.py): unique per boot across every device, in both
sharing modes, as docs/protocol.md says; a session's ids only grow.

The server runs in this process with its local endpoint replaced by a recorder."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from client_lib import protocol as p
from nodeagent.config import ServeConfig
from nodeagent.daemon.server import AgentServer
from nodeagent.daemon.sessions import Session
from nodeagent.devices import CpuBackend
from nodeagent.metrics import Metrics
from sharing import Workload
from tests.daemon_parts import RecordingLocal


@pytest.mark.parametrize("sharing", ["exclusive", "corun"])
def test_grant_ids_are_unique_per_boot_across_devices(workdir, sharing):
    """Issue 32 item 13: each device numbered its grants from ``boot << 32`` on its own, so
    device 0's first grant and device 1's first grant had the same id."""
    config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/ids.sock", state_dir=workdir, sharing=sharing)
    server = AgentServer(config, CpuBackend(3), metrics=Metrics(CollectorRegistry()))
    local = RecordingLocal()
    server._local = local
    boot = 5
    server._tokens.renew((boot << 32) + 1)  # what a restart does (restore.py)
    now = time.monotonic()
    sessions = []
    for device in range(3):
        for workload in (Workload.TRAINING, Workload.INFERENCE, Workload.TRAINING):
            sid = f"s{device}-{len(sessions)}"
            s = Session(id=sid, key="k", route=sid, name=sid, claimed_pid=1, verified_pid=None, start_ticks=None,
                        uid=0, workload=workload, weight=1.0, device=device, memory_mb=0, last_seen=now)
            server._add_session(s, now)
            sessions.append(s)
    for _ in range(20):  # every session asks, is granted in turn and releases, over and over
        for s in sessions:
            if server._tokens.grant_of(s) is None:  # asking again while waiting is a no-op
                server._gate.ask(s, time.monotonic())
        for s in sessions:
            grant = server._tokens.grant_of(s)
            if grant is not None:
                server._on_release(s.route, p.Release(id=1, grant=grant, quiet=True), None, time.monotonic())
    grants = [(route, msg.grant, msg.device) for route, msg in local.sent if isinstance(msg, p.Grant)]
    ids = [g for _, g, _ in grants]
    assert {d for _, _, d in grants} == {0, 1, 2} and len(ids) > 60, grants[:5]
    assert len(set(ids)) == len(ids), sorted(g - (boot << 32) for g in ids)[:20]
    assert min(ids) > boot << 32 and max(ids) < (boot + 1) << 32
    for s in sessions:
        mine = [g for route, g, _ in grants if route == s.route]
        assert mine == sorted(mine), (s.id, mine)  # a session's ids only grow


def _session(sid: str, workload: Workload, now: float = 0.0) -> Session:
    return Session(id=sid, key="k", route=f"conn-{sid}", name=sid, claimed_pid=1, verified_pid=None, start_ticks=None,
                   uid=None, workload=workload, weight=1.0, device=0, memory_mb=0, last_seen=now)


def test_a_best_effort_holder_on_a_corun_device_leaves_the_pace_board_written(tmp_path):
    """A best-effort holder has no pace controller of its own (nobody is below it): the board's
    writer looked its lane up through ``CoRunScheduler.lanes()``, removed with one-hop handoffs,
    so every turn it held raised AttributeError and no device's board was written after it."""
    from client_lib.pace import PaceBoardReader
    from nodeagent.daemon.sessions import SessionTable
    from tests.daemon_parts import make_tokens

    sessions = SessionTable()
    tokens = make_tokens(sessions=sessions, clock=lambda: 1.0,
                         config=ServeConfig(backend="cpu", sharing="corun", enforce="revoke", corun_duty="pause"))
    for sid, workload in (("b", Workload.BEST_EFFORT), ("t", Workload.TRAINING), ("i", Workload.INFERENCE)):
        sessions.add(_session(sid, workload))
        tokens.add(0, sid, workload, 1.0, 0.0)
    tokens.open_pace_boards(None, str(tmp_path))
    try:
        board = PaceBoardReader(tokens.pace_board(0))
        for sid in "bti":  # each is granted at once, in its own lane
            tokens.request(0, sid, 1.0)
        assert tokens.holders(0) == ("i", "t", "b")
        tokens.write_pace_boards()
        training, best_effort = board.read(int(Workload.TRAINING)), board.read(int(Workload.BEST_EFFORT))
        assert training.present == 1 and training.active and training.throttled  # paused for the inference holder
        assert best_effort.present == 2 and best_effort.active and best_effort.throttled
        board.close()
    finally:
        tokens.close_pace_boards()


# ------------------------------------------------------------------ a session's token state (issue 31 item 2)


def test_a_sessions_token_state_is_read_through_the_views_its_commands_keep():
    """The grant held and since when, the wait timed and a stop are the tokens component's, kept
    by session id from ``add`` until ``remove``; the views read what its commands wrote."""
    from nodeagent.daemon.sessions import SessionTable
    from tests.daemon_parts import make_tokens

    sessions = SessionTable()
    tokens = make_tokens(sessions=sessions)
    a, b = _session("a", Workload.TRAINING), _session("b", Workload.TRAINING)
    for s in (a, b):
        sessions.add(s)
        tokens.add(0, s.id, s.workload, 1.0, 0.0)
    try:
        tokens.time_wait(a, 1.0)
        assert tokens.waiting_since(a) == 1.0 and tokens.grant_of(a) is None and tokens.held_since(a) is None
        tokens.request(0, "a", 1.0)
        grant = tokens.grant_of(a)
        assert grant is not None and tokens.held_since(a) == 1.0 and tokens.waiting_since(a) is None
        tokens.time_wait(a, 2.0)  # asking again while holding starts no wait
        assert tokens.waiting_since(a) is None
        tokens.time_wait(b, 2.5)
        tokens.request(0, "b", 2.5)
        tokens.release_session(a, grant, 3.0, requeue=True)  # a requeue's wait starts at the release
        assert (tokens.grant_of(a), tokens.held_since(a), tokens.waiting_since(a)) == (None, None, 3.0)
        assert tokens.grant_of(b) is not None and tokens.held_since(b) == 3.0 and tokens.waiting_since(b) is None
        tokens.cancel_session(a, 3.5)  # it leaves the line (a suspension): its wait is no longer timed
        assert tokens.waiting_since(a) is None and tokens.stopped(a) is False
        tokens.remove(0, "a", 4.0)
        assert tokens.waiting_since(a) is None and tokens.grant_of(a) is None  # gone with its session
    finally:
        sessions.close()


def test_a_session_restored_stopped_is_stopped_until_continued():
    from nodeagent.daemon.sessions import SessionTable
    from tests.daemon_parts import make_tokens

    sessions = SessionTable()
    writes = []
    tokens = make_tokens(sessions=sessions, journal=lambda write, session=None: writes.append(session) or True)
    s = _session("s", Workload.TRAINING)
    tokens.add(0, s.id, s.workload, 1.0, 0.0, stopped=True)
    sessions.add(s)
    try:
        assert tokens.stopped(s)
        tokens.cont(s)  # it names no process it can reach: nothing is signalled, the stop is undone all the same
        assert tokens.stopped(s) is False and writes == ["s"]  # journalled running
    finally:
        sessions.close()


def test_a_wait_kept_through_a_make_room_block_is_the_one_the_tokens_component_timed():
    """The gate asks again for a session its make-room block kept, with the wait the tokens
    component timed (``Tokens.waiting_since``): the grant says it waited from its acquire."""
    from nodeagent.daemon.bus import Bus, Granted, MakeRoomFinished
    from nodeagent.daemon.gate import TokenGate
    from nodeagent.daemon.sessions import SessionTable
    from tests.daemon_parts import FakeDevices, make_suspensions, make_tokens

    sessions, bus = SessionTable(), Bus()
    granted = []
    bus.subscribe(Granted, lambda e: granted.append((e.session.id, e.waited_ms)))
    tokens = make_tokens(sessions=sessions, bus=bus)
    gate = TokenGate(sessions=sessions, tokens=tokens, devices=FakeDevices(1),
                     suspensions=make_suspensions(sessions=sessions, tokens=tokens))
    victim, admitted = _session("v", Workload.TRAINING), _session("i", Workload.INFERENCE)
    for s in (victim, admitted):
        sessions.add(s)
        tokens.add(0, s.id, s.workload, 1.0, 0.0)
    try:
        gate.block(admitted, [victim])
        tokens.time_wait(admitted, 1.0)
        gate.ask(admitted, 1.0)
        assert granted == []  # kept
        gate.on_make_room_finished(MakeRoomFinished(victim.id, 3.0))
        assert granted == [("i", pytest.approx(2000.0))]
    finally:
        sessions.close()


def test_a_preempted_holder_holds_no_grant_and_its_slice_is_counted():
    """``Tokens.preempt`` (a stop for memory or an overrun) ends the holder's slice before it goes
    back in line: the next session is granted, and the stopped one holds nothing."""
    from nodeagent.daemon.bus import Bus, SliceEnded
    from nodeagent.daemon.sessions import SessionTable
    from tests.daemon_parts import make_tokens

    sessions, bus, ended = SessionTable(), Bus(), []
    bus.subscribe(SliceEnded, ended.append)
    tokens = make_tokens(sessions=sessions, bus=bus, clock=lambda: 1.0)
    a, b = _session("a", Workload.TRAINING), _session("b", Workload.TRAINING)
    for s in (a, b):
        tokens.add(0, s.id, s.workload, s.weight, 0.0)
        sessions.add(s)
    tokens.request(0, "a", 0.0)
    tokens.request(0, "b", 0.1)
    assert tokens.grant_of(a) is not None and tokens.grant_of(b) is None
    tokens.preempt(a, 2.0)
    assert tokens.grant_of(a) is None and tokens.grant_of(b) is not None
    assert [(event.session.id, event.held_s) for event in ended] == [("a", 2.0)]
