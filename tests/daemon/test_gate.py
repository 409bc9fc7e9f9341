"""The token gate (nodeagent/daemon/gate.py) stepped by hand: make-room blocks, restore windows."""

from __future__ import annotations

import pytest

from nodeagent.daemon.bus import MakeRoomFinished
from nodeagent.daemon.gate import TokenGate
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import Workload
from sharing.suspension import Gate
from tests.daemon_parts import FakeDevices, make_suspensions


class AskedTokens:
    """What the gate asks of the tokens component: every request it makes is recorded."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float | None]] = []
        self.waits: dict[str, float] = {}  # session id -> when its timed wait began (Tokens.waiting_since)

    def on_device(self, device, sid):
        return True

    def grant_of(self, s):
        return None

    def waiting_since(self, s):
        return self.waits.get(s.id)

    def request(self, device, sid, now, waiting_since=None):
        self.asked.append((sid, waiting_since))


@pytest.fixture
def sessions():
    table = SessionTable()
    yield table
    table.close()


def add(sessions: SessionTable, sid: str, workload: Workload = Workload.TRAINING) -> Session:
    s = Session(id=sid, key="k", route=None, name=sid, claimed_pid=1, verified_pid=None, start_ticks=None, uid=None,
                workload=workload, weight=1.0, device=0, memory_mb=0, last_seen=0.0)
    sessions.add(s)
    return s


def test_a_session_admitted_by_make_room_asks_once_every_suspension_it_waits_for_has_finished(sessions):
    tokens = AskedTokens()
    gate = TokenGate(sessions=sessions, tokens=tokens, devices=FakeDevices(1),
                     suspensions=make_suspensions(sessions=sessions, tokens=tokens))
    first, second = add(sessions, "s-a"), add(sessions, "s-b")
    admitted = add(sessions, "s-infer", Workload.INFERENCE)
    gate.block(admitted, [first, second])
    tokens.waits[admitted.id] = 1.0
    assert gate.ask(admitted, 1.0) is Gate.KEEP and gate.kept(admitted) and tokens.asked == []
    gate.on_make_room_finished(MakeRoomFinished("s-other", 2.0))  # blocks no one
    gate.on_make_room_finished(MakeRoomFinished(first.id, 2.0))
    assert tokens.asked == [] and gate.kept(admitted)  # the second is still on the device
    gate.on_make_room_finished(MakeRoomFinished(second.id, 3.0))
    assert tokens.asked == [("s-infer", 1.0)] and not gate.kept(admitted)  # its wait kept
    gate.on_make_room_finished(MakeRoomFinished(second.id, 4.0))  # reported again (timeout, then parked)
    assert tokens.asked == [("s-infer", 1.0)]
    assert gate.ask(admitted, 5.0) is Gate.QUEUE  # blocked no longer


def test_a_restore_window_closes_when_its_last_awaited_session_ends_not_at_its_deadline(sessions):
    """The window waits for the restored sessions to reattach; one that ends instead (its process
    gone, bye) is waited for no longer: when it was the last, the parked requests are made at
    once, keeping their wait, not at the window's deadline (the token gate owns the windows).
    (Moved here from test_restart.py: it starts no daemon.)"""
    gone, waiting = add(sessions, "s-gone"), add(sessions, "s-new")
    tokens = AskedTokens()
    gate = TokenGate(sessions=sessions, tokens=tokens, devices=FakeDevices(1),
                     suspensions=make_suspensions(sessions=sessions, tokens=tokens))
    gate.open_windows({0: {"s-gone"}}, deadline=100.0)
    tokens.waits[waiting.id] = 1.5
    assert gate.ask(waiting, 2.0) is Gate.PARK and tokens.asked == []
    sessions.remove(gone)
    gate.forget(gone, 3.0)  # what the server does when a session ends
    assert tokens.asked == [("s-new", 1.5)] and gate.next_deadline(3.0) is None
    assert gate.ask(add(sessions, "s-late"), 4.0) is Gate.QUEUE  # the window is closed: nothing is parked


def test_a_session_that_ends_leaves_nothing_kept_parked_or_held_to_be_asked_for_later(sessions):
    """What the gate kept back for a session that then ended is never asked for: not at the end
    of the blocks it waited for, nor when its restore window closes, nor when its lost device is back."""
    from nodeagent.daemon.bus import DeviceBack

    tokens = AskedTokens()
    devices = FakeDevices(2)
    gate = TokenGate(sessions=sessions, tokens=tokens, devices=devices,
                     suspensions=make_suspensions(sessions=sessions, tokens=tokens))
    blocked, parked, held, victim = (add(sessions, sid) for sid in ("s-kept", "s-parked", "s-held", "s-victim"))
    held.device = 1
    gate.block(blocked, [victim])
    gate.open_windows({0: {"s-other"}}, deadline=10.0)
    devices.lost.lose(1, "Xid 79")  # as the gate does on DeviceLost
    assert [gate.ask(s, 1.0) for s in (blocked, parked, held)] == [Gate.KEEP, Gate.PARK, Gate.HOLD]
    for s in (blocked, parked, held):
        gate.forget(s, 2.0)
    gate.on_make_room_finished(MakeRoomFinished(victim.id, 3.0))
    gate.on_timers(10.0)
    gate.on_device_back(DeviceBack(1, 11.0))
    assert tokens.asked == [] and not gate.kept(blocked)
