"""Tests of sharing.lifecycle: the device lending state machine, stepped by hand.

Time is a plain float passed to every call, so each test reads as a script.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client_lib.protocol import ErrorCode
from sharing import DeviceLifecycle, DeviceState, LifecycleError, ReclaimDue, Transition, Workload

FREE, RUN, PROTECT, LENT, DRAINING = (DeviceState.FREE, DeviceState.RUN, DeviceState.PROTECT,
                                      DeviceState.LENT, DeviceState.DRAINING)


def moves(changes) -> list[tuple[DeviceState, DeviceState]]:
    return [(c.old, c.new) for c in changes if isinstance(c, Transition)]


def lent(borrower: str = "job-a", now: float = 0.0, max_s=None, protect_s: float = 60.0) -> DeviceLifecycle:
    life = DeviceLifecycle(0, protect_s=protect_s)
    life.lend(borrower, now, max_s)
    return life


def protected(now: float = 0.0, protect_s: float = 60.0) -> DeviceLifecycle:
    life = DeviceLifecycle(0, protect_s=protect_s)
    life.observe(True, now)
    life.observe(False, now)
    return life


# ---------------------------------------------------------------- inference observations


def test_starts_free_and_lendable():
    life = DeviceLifecycle(3)
    assert life.state is FREE and life.borrower is None and life.next_deadline() is None
    assert life.protect_s == 60.0


def test_free_to_run_when_inference_active():
    life = DeviceLifecycle(1, protect_s=30)
    changes = life.observe(True, 5.0)
    assert changes == [Transition(1, FREE, RUN, "inference active", 5.0)]
    assert life.state is RUN


def test_observe_is_a_noop_when_nothing_changes():
    life = DeviceLifecycle(0)
    assert life.observe(False, 1.0) == []
    life.observe(True, 2.0)
    assert life.observe(True, 3.0) == []
    assert life.state is RUN


def test_run_to_protect_when_inference_idle_then_free_after_protect_s():
    life = DeviceLifecycle(0, protect_s=30)
    life.observe(True, 10.0)
    changes = life.observe(False, 12.0)
    assert moves(changes) == [(RUN, PROTECT)]
    assert life.protect_until == 42.0 and life.next_deadline() == 42.0
    assert life.tick(41.999) == []
    assert life.state is PROTECT
    changes = life.tick(42.0)
    assert moves(changes) == [(PROTECT, FREE)] and changes[0].at == 42.0
    assert life.protect_until is None and life.next_deadline() is None


def test_protect_back_to_run_when_inference_returns():
    life = protected(now=0.0, protect_s=30)
    changes = life.observe(True, 10.0)
    assert moves(changes) == [(PROTECT, RUN)]
    assert life.protect_until is None and life.next_deadline() is None
    # A fresh window starts at the next idle, not the old one.
    life.observe(False, 20.0)
    assert life.protect_until == 50.0


def test_zero_protect_s_goes_straight_through_protect_to_free():
    life = DeviceLifecycle(0, protect_s=0)
    life.observe(True, 1.0)
    changes = life.observe(False, 2.0)
    assert moves(changes) == [(RUN, PROTECT), (PROTECT, FREE)]
    assert life.state is FREE


def test_observe_settles_an_expired_window_first():
    life = protected(now=0.0, protect_s=10)
    # No tick came; an inactive observation after the window ends frees the device.
    assert moves(life.observe(False, 11.0)) == [(PROTECT, FREE)]


# ---------------------------------------------------------------- lend


def test_lend_from_free():
    life = DeviceLifecycle(2)
    changes = life.lend("job-a", 100.0)
    assert changes == [Transition(2, FREE, LENT, "lent to job-a", 100.0)]
    assert life.state is LENT and life.borrower == "job-a" and life.lent_until is None
    assert life.next_deadline() is None


def test_lend_with_max_s_sets_lent_until_and_deadline():
    life = DeviceLifecycle(0)
    life.lend("job-a", 100.0, max_s=50)
    assert life.lent_until == 150.0 and life.next_deadline() == 150.0


def test_repeated_lend_to_same_borrower_is_a_noop_and_keeps_the_first_deadline():
    life = DeviceLifecycle(0)
    life.lend("job-a", 100.0, max_s=50)
    assert life.lend("job-a", 120.0, max_s=50) == []
    assert life.lent_until == 150.0 and life.state is LENT


def test_lend_to_another_borrower_while_lent_is_refused():
    life = lent("job-a")
    with pytest.raises(LifecycleError, match="lent to 'job-a'.*reclaim") as err:
        life.lend("job-b", 1.0)
    assert err.value.state is LENT and err.value.code == ErrorCode.STATE
    assert life.borrower == "job-a"


def test_lend_while_run_is_refused():
    life = DeviceLifecycle(0)
    life.observe(True, 0.0)
    with pytest.raises(LifecycleError, match="RUN: inference") as err:
        life.lend("job-a", 1.0)
    assert err.value.state is RUN and err.value.retry_at is None
    assert life.state is RUN and life.borrower is None


def test_lend_while_protect_is_refused_saying_when_it_ends():
    life = protected(now=10.0, protect_s=60)
    with pytest.raises(LifecycleError, match=r"PROTECT.*in 45\.0s") as err:
        life.lend("job-a", 25.0)
    assert err.value.state is PROTECT and err.value.retry_at == 70.0
    assert life.state is PROTECT and life.protect_until == 70.0


def test_lend_after_the_window_ended_succeeds_without_a_tick():
    life = protected(now=10.0, protect_s=60)
    changes = life.lend("job-a", 70.0)
    assert moves(changes) == [(PROTECT, FREE), (FREE, LENT)]


def test_lend_while_draining_is_refused():
    life = DeviceLifecycle(0)
    life.drain(0.0)
    with pytest.raises(LifecycleError, match="DRAINING; cancel the drain") as err:
        life.lend("job-a", 1.0)
    assert err.value.state is DRAINING and life.state is DRAINING


@pytest.mark.parametrize("borrower", ["", "   ", None, 7])
def test_lend_rejects_a_bad_borrower(borrower):
    life = DeviceLifecycle(0)
    with pytest.raises(ValueError, match="borrower"):
        life.lend(borrower, 0.0)
    assert life.state is FREE


@pytest.mark.parametrize("max_s", [0, -1, math.inf, math.nan, True, "5"])
def test_lend_rejects_a_bad_max_s(max_s):
    life = DeviceLifecycle(0)
    with pytest.raises(ValueError, match="max_s"):
        life.lend("job-a", 0.0, max_s)
    assert life.state is FREE


def test_inference_on_a_lent_device_is_recorded_but_does_not_end_the_lend():
    life = lent("job-a")
    assert life.observe(True, 1.0) == []
    assert life.state is LENT and life.inference_active


# ---------------------------------------------------------------- reclaim and expiry


def test_reclaim_moves_lent_to_protect_and_the_window_then_frees():
    life = lent("job-a", now=0.0, protect_s=30)
    changes = life.reclaim(10.0)
    assert changes == [Transition(0, LENT, PROTECT, "reclaimed from job-a", 10.0)]
    assert life.borrower is None and life.lent_until is None and life.protect_until == 40.0
    assert moves(life.tick(40.0)) == [(PROTECT, FREE)]


def test_reclaim_with_inference_already_waiting_goes_on_to_run():
    life = lent("job-a")
    life.observe(True, 1.0)
    assert moves(life.reclaim(2.0)) == [(LENT, PROTECT), (PROTECT, RUN)]
    assert life.state is RUN and life.protect_until is None


def test_reclaim_is_idempotent():
    life = lent("job-a")
    life.reclaim(1.0)
    assert life.reclaim(2.0) == []
    assert DeviceLifecycle(0).reclaim(0.0) == []


def test_lend_expiry_reports_reclaim_due_once():
    life = lent("job-a", now=100.0, max_s=50)
    assert life.tick(149.0) == []
    due = life.tick(151.0)
    assert due == [ReclaimDue(0, "job-a", 150.0)]
    assert life.state is LENT  # the server reclaims; the machine does not
    assert life.tick(152.0) == [] and life.next_deadline() is None
    life.reclaim(153.0)
    assert life.state is PROTECT


def test_a_new_lend_after_reclaim_gets_its_own_expiry_report():
    life = lent("job-a", now=0.0, max_s=10, protect_s=0)
    life.tick(10.0)
    life.reclaim(11.0)
    life.lend("job-b", 12.0, max_s=5)
    assert life.tick(17.0) == [ReclaimDue(0, "job-b", 17.0)]


# ---------------------------------------------------------------- drain


@pytest.mark.parametrize("setup", ["free", "run", "protect", "lent"])
def test_drain_from_any_state(setup):
    life = {"free": lambda: DeviceLifecycle(0), "run": lambda: DeviceLifecycle(0),
            "protect": protected, "lent": lent}[setup]()
    if setup == "run":
        life.observe(True, 0.0)
    old = life.state
    changes = life.drain(5.0)
    assert moves(changes) == [(old, DRAINING)]
    assert life.borrower is None and life.lent_until is None and life.protect_until is None
    assert life.next_deadline() is None
    assert life.drain(6.0) == []


def test_drain_ends_a_lend_and_says_so():
    life = lent("job-a")
    (change,) = life.drain(1.0)
    assert "job-a" in change.reason


def test_undrain_goes_to_run_or_free_by_the_last_observation():
    life = DeviceLifecycle(0)
    life.drain(0.0)
    life.observe(True, 1.0)
    assert life.state is DRAINING
    assert moves(life.undrain(2.0)) == [(DRAINING, RUN)]
    life.drain(3.0)
    life.observe(False, 4.0)
    assert moves(life.undrain(5.0)) == [(DRAINING, FREE)]
    assert life.undrain(6.0) == []


# ---------------------------------------------------------------- set_protect_s


def test_set_protect_s_rescales_a_window_in_progress():
    life = protected(now=10.0, protect_s=60)
    life.set_protect_s(5)
    assert life.protect_until == 15.0 and life.next_deadline() == 15.0
    assert moves(life.tick(15.0)) == [(PROTECT, FREE)]


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan, "60", None, True])
def test_set_protect_s_rejects_bad_values(bad):
    life = DeviceLifecycle(0)
    with pytest.raises(ValueError, match="protect_s"):
        life.set_protect_s(bad)
    assert life.protect_s == 60.0
    with pytest.raises(ValueError, match="protect_s"):
        DeviceLifecycle(0, protect_s=bad)


def test_now_must_be_a_finite_number():
    life = DeviceLifecycle(0)
    for call in (lambda: life.observe(True, math.nan), lambda: life.lend("a", math.inf),
                 lambda: life.tick("1")):
        with pytest.raises(ValueError, match="now"):
            call()
    assert life.state is FREE


# ---------------------------------------------------------------- admission


def test_admits_by_state_workload_and_borrower():
    life = DeviceLifecycle(4)
    assert life.admits("inference", None) is None
    assert life.admits("training", None) is None  # a local job
    assert life.admits(Workload.BEST_EFFORT, None) is None
    assert "not lent to 'job-a'" in life.admits("training", "job-a")
    assert "not lent to 'job-a'" in life.admits("best-effort", "job-a")
    life.lend("job-a", 0.0)
    assert life.admits("training", "job-a") is None
    assert life.admits(Workload.TRAINING, "job-a") is None
    assert "lent to 'job-a', not to 'job-b'" in life.admits("training", "job-b")
    assert life.admits("inference", "job-b") is None  # inference is never kept off a lent device
    assert "only its sessions" in life.admits("training", None)  # nor a local job (issue 21)
    assert "only its sessions" in life.admits(Workload.BEST_EFFORT, None)
    life.reclaim(1.0)
    assert "PROTECT" in life.admits("training", "job-a")
    life.drain(2.0)
    for workload, borrower in [("inference", None), ("training", None), ("training", "job-a")]:
        assert "DRAINING" in life.admits(workload, borrower)


def test_admits_rejects_an_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload"):
        DeviceLifecycle(0).admits("gaming", None)


# ---------------------------------------------------------------- restore


def test_restore_a_lent_device():
    life = DeviceLifecycle.restore(1, "LENT", borrower="job-a", lent_until=500.0, protect_s=20)
    assert life.state is LENT and life.borrower == "job-a" and life.next_deadline() == 500.0
    assert life.tick(500.0) == [ReclaimDue(1, "job-a", 500.0)]


def test_restore_protect_keeps_its_end():
    life = DeviceLifecycle.restore(0, DeviceState.PROTECT, protect_until=80.0, protect_s=30)
    assert life.protect_until == 80.0
    assert moves(life.tick(80.0)) == [(PROTECT, FREE)]


@pytest.mark.parametrize("kw", [
    dict(state="FREE", borrower="job-a"),
    dict(state="LENT"),
    dict(state="RUN", lent_until=3.0),
    dict(state="PROTECT"),
    dict(state="FREE", protect_until=3.0),
    dict(state="SLEEPING"),
])
def test_restore_rejects_inconsistent_fields(kw):
    with pytest.raises(ValueError):
        DeviceLifecycle.restore(0, kw.pop("state"), **kw)


# ---------------------------------------------------------------- property: invariants


def check_invariants(life: DeviceLifecycle) -> None:
    assert (life.borrower is not None) == (life.state is LENT)
    assert life.lent_until is None or life.state is LENT
    assert (life.protect_until is not None) == (life.state is PROTECT)
    if life.state is FREE:
        assert not life.inference_active
    if life.state is PROTECT:
        assert not life.inference_active
    if life.state is RUN:
        assert life.inference_active
    deadline = life.next_deadline()
    if deadline is not None:
        assert life.state in (PROTECT, LENT)


_events = st.one_of(
    st.tuples(st.just("observe"), st.booleans()),
    st.tuples(st.just("lend"), st.sampled_from(["a", "b"]), st.one_of(st.none(), st.floats(0.5, 50))),
    st.tuples(st.just("reclaim")),
    st.tuples(st.just("drain")),
    st.tuples(st.just("undrain")),
    st.tuples(st.just("protect"), st.floats(0, 30)),
    st.tuples(st.just("tick")),
)


@settings(max_examples=300, deadline=None)
@given(protect_s=st.floats(0, 30), script=st.lists(st.tuples(st.floats(0, 20), _events), max_size=40))
def test_random_sequences_keep_the_invariants(protect_s, script):
    life = DeviceLifecycle(0, protect_s=protect_s)
    now = 0.0
    for step, event in script:
        now += step
        before = (life.state, life.borrower, life.lent_until, life.protect_until)
        kind = event[0]
        changes = []
        try:
            if kind == "observe":
                changes = life.observe(event[1], now)
            elif kind == "lend":
                changes = life.lend(event[1], now, event[2])
            elif kind == "reclaim":
                changes = life.reclaim(now)
            elif kind == "drain":
                changes = life.drain(now)
            elif kind == "undrain":
                changes = life.undrain(now)
            elif kind == "protect":
                life.set_protect_s(event[1])
            else:
                changes = life.tick(now)
        except LifecycleError as err:
            # A refusal changes nothing and names the state that refused.
            assert err.state is before[0] and before[0] in (RUN, PROTECT, LENT, DRAINING)
            assert (life.state, life.borrower, life.lent_until, life.protect_until) == before
        check_invariants(life)
        transitions = [c for c in changes if isinstance(c, Transition)]
        # Transitions chain: each starts where the previous ended, and the last is the state now.
        if transitions:
            assert transitions[0].old is before[0]
            for a, b in zip(transitions, transitions[1:]):
                assert a.new is b.old
            assert transitions[-1].new is life.state
            assert all(t.old is not t.new and t.at == now for t in transitions)
        else:
            assert life.state is before[0]
        # Time never leaves a deadline behind: after a tick, none is in the past except a reported lend.
        if kind == "tick":
            deadline = life.next_deadline()
            assert deadline is None or deadline > now
