"""Tests of sharing.scheduler: the pure token scheduler, stepped by hand.

Time is a plain float passed to every call (the scheduler has no clock), so
each test reads as a script of who did what when.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client_lib.protocol import ErrorCode
from sharing import (
    AskYield,
    DuplicateSessionError,
    Enforce,
    Grant,
    NotHolderError,
    Revoked,
    SchedulerError,
    SchedulerPolicy,
    SessionState,
    TokenScheduler,
    UnknownSessionError,
    Workload,
)

INFER, TRAIN, BEST = Workload.INFERENCE, Workload.TRAINING, Workload.BEST_EFFORT
IDLE, WAITING, HOLDING, YIELDING = (
    SessionState.IDLE,
    SessionState.WAITING,
    SessionState.HOLDING,
    SessionState.YIELDING,
)
Q_TRAIN_S = 0.2  # default training quantum
GRACE_S = 0.1  # default grace


def make(*sessions: tuple[str, Workload, float], policy: SchedulerPolicy | None = None, **kw) -> TokenScheduler:
    sched = TokenScheduler(0, policy, **kw)
    for name, workload, weight in sessions:
        sched.add_session(name, workload, weight, 0.0)
    return sched


def view(sched: TokenScheduler, session: str, now: float):
    (found,) = [v for v in sched.snapshot(now).sessions if v.session == session]
    return found


def just_before(t: float) -> float:
    return math.nextafter(t, -math.inf)


# ---------------------------------------------------------------- workload, policy


def test_workload_wire_names_round_trip_in_priority_order():
    assert [w.wire for w in sorted(Workload)] == ["inference", "training", "best-effort"]
    for w in Workload:
        assert Workload.parse(w.wire) is w


@pytest.mark.parametrize("name", ["best_effort", "Training", "", None])
def test_workload_parse_rejects_unknown_names_listing_the_valid_ones(name):
    with pytest.raises(ValueError, match="'inference', 'training', 'best-effort'"):
        Workload.parse(name)


def test_policy_defaults():
    policy = SchedulerPolicy()
    assert dict(policy.quantum_ms) == {INFER: 50.0, TRAIN: 200.0, BEST: 200.0}
    assert policy.grace_ms == 100.0
    assert policy.quantum_s(INFER) == pytest.approx(0.05)
    assert policy.quantum_s(TRAIN) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"quantum_ms": {INFER: 50, TRAIN: -1, BEST: 200}}, r"quantum_ms\[training\] must be finite and > 0, got -1"),
        ({"quantum_ms": {INFER: 0, TRAIN: 1, BEST: 1}}, r"quantum_ms\[inference\] must be finite and > 0, got 0"),
        ({"quantum_ms": {INFER: 1, TRAIN: 1, BEST: math.nan}}, r"quantum_ms\[best-effort\] must be finite"),
        ({"quantum_ms": {INFER: 1, TRAIN: math.inf, BEST: 1}}, r"quantum_ms\[training\] must be finite"),
        ({"quantum_ms": {INFER: 1, TRAIN: "fast", BEST: 1}}, r"quantum_ms\[training\] must be a number"),
        ({"quantum_ms": {INFER: 50, TRAIN: 200}}, r"quantum_ms\[best-effort\] is missing"),
        ({"quantum_ms": {INFER: 1, TRAIN: 1, BEST: 1, "gpu": 1}}, r"quantum_ms has a bad key: unknown workload 'gpu'"),
        ({"grace_ms": 0}, r"grace_ms must be finite and > 0, got 0"),
        ({"grace_ms": -5.0}, r"grace_ms must be finite and > 0"),
        ({"grace_ms": math.nan}, r"grace_ms must be finite"),
    ],
)
def test_policy_validation_error_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerPolicy(**kwargs)


def test_policy_is_immutable_and_detached_from_the_callers_dict():
    given_ms = {INFER: 10.0, TRAIN: 20.0, BEST: 30.0}
    policy = SchedulerPolicy(quantum_ms=given_ms)
    given_ms[TRAIN] = 999.0
    assert policy.quantum_ms[TRAIN] == 20.0
    with pytest.raises(TypeError):
        policy.quantum_ms[TRAIN] = 1.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.grace_ms = 1.0  # type: ignore[misc]
    assert policy == SchedulerPolicy(quantum_ms={INFER: 10, TRAIN: 20, BEST: 30})
    assert hash(policy) == hash(SchedulerPolicy(quantum_ms={INFER: 10, TRAIN: 20, BEST: 30}))


def test_policy_accepts_wire_names_as_keys():
    policy = SchedulerPolicy(quantum_ms={"inference": 10, "training": 20, "best-effort": 30})
    assert policy.quantum_s(BEST) == pytest.approx(0.03)


# ---------------------------------------------------------------- sessions


def test_added_session_starts_idle_and_is_counted():
    sched = make(("a", TRAIN, 1.0))
    assert "a" in sched and "b" not in sched and len(sched) == 1
    assert sched.state("a") is IDLE
    assert view(sched, "a", 0.0).vtime_s == 0.0
    assert sched.holder() is None


def test_adding_a_duplicate_session_is_refused():
    sched = make(("a", TRAIN, 1.0))
    with pytest.raises(DuplicateSessionError, match="'a' is already on device 0"):
        sched.add_session("a", INFER, 1.0, 0.0)
    assert view(sched, "a", 0.0).workload is TRAIN


@pytest.mark.parametrize("weight", [0, -1.0, math.nan, math.inf])
def test_bad_weight_is_refused_on_add_and_on_set(weight):
    sched = make(("a", TRAIN, 1.0))
    with pytest.raises(ValueError, match="weight must be finite and > 0"):
        sched.add_session("b", TRAIN, weight, 0.0)
    assert "b" not in sched
    with pytest.raises(ValueError, match="weight"):
        sched.set_weight("a", weight, 0.0)
    assert view(sched, "a", 0.0).weight == 1.0


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.request("ghost", 1.0),
        lambda s: s.cancel("ghost", 1.0),
        lambda s: s.release("ghost", 1, 1.0),
        lambda s: s.revoke("ghost", 1.0, "x"),
        lambda s: s.remove_session("ghost", 1.0),
        lambda s: s.set_weight("ghost", 1.0, 1.0),
        lambda s: s.state("ghost"),
    ],
)
def test_unknown_session_raises_a_readable_key_error(call):
    sched = make(("a", TRAIN, 1.0))
    with pytest.raises(UnknownSessionError) as info:
        call(sched)
    assert isinstance(info.value, KeyError) and isinstance(info.value, SchedulerError)
    assert str(info.value) == "no session 'ghost' on device 0"


def test_error_codes_match_the_wire_protocol():
    assert UnknownSessionError.code == ErrorCode.NO_SESSION
    assert NotHolderError.code == ErrorCode.NOT_HOLDER


# ---------------------------------------------------------------- grant, queue order


def test_request_when_token_is_free_grants_at_once():
    sched = make(("a", TRAIN, 1.0))
    assert sched.request("a", 1.0) == [Grant("a", 1, 200.0, 0.0)]
    assert sched.state("a") is HOLDING
    assert sched.holder() == "a"


def test_request_is_idempotent_while_waiting_holding_or_yielding():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.1)
    assert sched.request("b", 0.15) == []
    assert view(sched, "b", 0.15).waiting_since == 0.1
    assert sched.request("a", 0.15) == []
    assert sched.state("a") is HOLDING
    assert [type(a) for a in sched.tick(0.2)] == [AskYield]
    assert sched.request("a", 0.25) == []
    assert sched.state("a") is YIELDING and sched.holder() == "a"


def test_cancel_takes_a_waiter_out_and_is_a_no_op_otherwise():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), ("c", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.01)
    assert sched.cancel("b", 0.02) == []
    assert sched.state("b") is IDLE
    assert sched.snapshot(0.02).queue == ()
    assert view(sched, "b", 0.02).waiting_since is None
    assert sched.cancel("c", 0.03) == []  # idle
    assert sched.cancel("a", 0.03) == []  # holder must release instead
    assert sched.state("a") is HOLDING
    assert sched.release("a", 1, 0.05) == []  # nobody left to grant
    assert sched.holder() is None


def test_equal_vtime_waiters_are_granted_first_come_first_served():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), ("c", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("c", 0.01)
    sched.request("b", 0.02)
    assert sched.snapshot(0.02).queue == ("c", "b")
    assert sched.release("a", 1, 0.1) == [Grant("c", 2, 200.0, pytest.approx(0.09))]
    assert sched.release("c", 2, 0.15) == [Grant("b", 3, 200.0, pytest.approx(0.13))]


def test_equal_vtime_and_arrival_fall_back_to_session_id():
    sched = make(("a", TRAIN, 1.0), ("z", TRAIN, 1.0), ("m", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("z", 0.0)
    sched.request("m", 0.0)
    assert sched.snapshot(0.0).queue == ("m", "z")
    assert sched.release("a", 1, 0.0)[0].session == "m"


def test_least_virtual_time_goes_first_even_over_a_longer_wait():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), ("c", TRAIN, 4.0))
    sched.request("a", 0.0)
    sched.request("b", 0.0)
    sched.request("c", 0.01)
    assert sched.release("a", 1, 0.01)[0].session == "b"
    assert sched.release("b", 2, 0.11, requeue=True)[0].session == "c"  # b: vtime 0.1
    # c held 0.2 s at weight 4: vtime 0.05 < b's 0.1, though b has waited longer.
    assert sched.release("c", 3, 0.31, requeue=True) == [Grant("c", 4, 200.0, 0.0)]
    assert view(sched, "b", 0.31).vtime_s == pytest.approx(0.1)
    assert view(sched, "c", 0.31).vtime_s == pytest.approx(0.05)


def test_strict_priority_grants_the_highest_class_first():
    sched = make(("t1", TRAIN, 1.0), ("t2", TRAIN, 1.0), ("b", BEST, 1.0), ("i", INFER, 1.0))
    sched.request("t1", 0.0)
    sched.request("b", 0.01)
    sched.request("t2", 0.02)
    sched.request("i", 0.03)
    assert sched.snapshot(0.03).queue == ("i", "t2", "b")
    assert sched.release("t1", 1, 0.04)[0].session == "i"
    assert sched.release("i", 2, 0.05)[0].session == "t2"
    assert sched.release("t2", 3, 0.06)[0].session == "b"


# ---------------------------------------------------------------- release


def test_release_without_requeue_frees_the_token_and_idles_the_session():
    sched = make(("a", TRAIN, 1.0))
    sched.request("a", 0.0)
    assert sched.release("a", 1, 0.05) == []
    assert sched.state("a") is IDLE
    assert sched.holder() is None
    assert sched.next_deadline() is None


def test_release_hands_over_to_the_next_waiter_in_the_same_call():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.05)
    assert sched.release("a", 1, 0.1) == [Grant("b", 2, 200.0, pytest.approx(0.05))]
    assert sched.holder() == "b" and sched.state("b") is HOLDING
    assert view(sched, "b", 0.1).waiting_since is None


def test_release_with_requeue_goes_back_to_waiting_behind_the_next_waiter():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.05)
    assert sched.release("a", 1, 0.1, requeue=True)[0].session == "b"
    assert sched.state("a") is WAITING
    assert view(sched, "a", 0.1).waiting_since == 0.1
    assert sched.snapshot(0.1).queue == ("a",)


def test_release_with_requeue_as_only_waiter_regrants_under_a_new_id():
    sched = make(("a", TRAIN, 1.0))
    sched.request("a", 0.0)
    assert sched.release("a", 1, 0.1, requeue=True) == [Grant("a", 2, 200.0, 0.0)]
    assert sched.state("a") is HOLDING
    with pytest.raises(NotHolderError):
        sched.release("a", 1, 0.2)


def test_release_while_yielding_hands_over():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.0)
    sched.tick(0.2)
    assert sched.state("a") is YIELDING
    assert sched.release("a", 1, 0.25) == [Grant("b", 2, 200.0, 0.25)]
    assert sched.state("a") is IDLE


@pytest.mark.parametrize(
    "session, grant, message",
    [
        ("a", 1, "'a' holds grant 2 of device 0, not grant 1"),  # stale id
        ("a", 3, "'a' holds grant 2 of device 0, not grant 3"),
        ("b", 2, "'b' does not hold the token of device 0 \\(it is waiting; holder: 'a'\\)"),
        ("c", 2, "'c' does not hold the token of device 0 \\(it is idle"),
    ],
)
def test_release_by_a_non_holder_or_with_a_wrong_grant_changes_nothing(session, grant, message):
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), ("c", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.release("a", 1, 0.01, requeue=True)  # a now holds grant 2
    sched.request("b", 0.02)
    before, deadline = sched.snapshot(0.05), sched.next_deadline()
    with pytest.raises(NotHolderError, match=message):
        sched.release(session, grant, 0.05, requeue=True)
    assert sched.snapshot(0.05) == before
    assert sched.next_deadline() == deadline
    assert sched.release("a", 2, 0.05)[0] == Grant("b", 3, 200.0, pytest.approx(0.03))


# ---------------------------------------------------------------- preemption, quantum


def test_higher_class_request_preempts_a_holding_lower_class_at_once():
    sched = make(("t", TRAIN, 1.0), ("i", INFER, 1.0), ("i2", INFER, 1.0))
    sched.request("t", 0.0)
    assert sched.request("i", 0.01) == [AskYield("t", 1, 100.0, "preempted")]
    assert sched.state("t") is YIELDING and sched.holder() == "t"
    assert sched.next_deadline() == 0.01 + GRACE_S
    assert sched.request("i2", 0.02) == []  # already asked; the deadline stands
    assert sched.next_deadline() == 0.01 + GRACE_S


@pytest.mark.parametrize("holder_class, waiter_class", [(INFER, TRAIN), (TRAIN, BEST), (INFER, BEST)])
def test_a_lower_class_waiter_never_makes_the_holder_yield(holder_class, waiter_class):
    sched = make(("h", holder_class, 1.0), ("w", waiter_class, 1.0))
    sched.request("h", 0.0)
    assert sched.request("w", 0.01) == []
    assert sched.next_deadline() is None
    assert sched.tick(100.0) == []
    assert sched.state("h") is HOLDING


def test_quantum_ask_needs_a_waiter_of_the_same_class():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    assert sched.tick(1.0) == []  # slice long over, but nobody waits
    assert sched.next_deadline() is None
    assert sched.request("b", 1.0) == []
    assert sched.next_deadline() == Q_TRAIN_S  # already due: the daemon ticks at once
    assert sched.tick(1.0) == [AskYield("a", 1, 100.0, "quantum")]
    assert sched.state("a") is YIELDING
    assert sched.next_deadline() == 1.0 + GRACE_S


def test_quantum_ask_comes_exactly_at_the_end_of_the_slice():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.5)
    sched.request("b", 0.6)
    slice_end = sched.next_deadline()
    assert slice_end == 0.5 + Q_TRAIN_S
    assert sched.tick(just_before(slice_end)) == []
    assert sched.state("a") is HOLDING
    assert sched.tick(slice_end) == [AskYield("a", 1, 100.0, "quantum")]


def test_the_quantum_is_the_holders_class_quantum():
    sched = make(("i1", INFER, 1.0), ("i2", INFER, 1.0))
    assert sched.request("i1", 0.0) == [Grant("i1", 1, 50.0, 0.0)]
    sched.request("i2", 0.0)
    assert sched.next_deadline() == 0.05
    assert sched.tick(0.05) == [AskYield("i1", 1, 100.0, "quantum")]


# ---------------------------------------------------------------- enforce, revoke


def _yielding_pair() -> tuple[TokenScheduler, float]:
    """a holds grant 1 and was asked to yield at 0.2; b waits. Returns the yield deadline."""
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.0)
    sched.tick(0.2)
    return sched, 0.2 + GRACE_S


def test_enforce_comes_exactly_at_the_yield_deadline_and_only_once():
    sched, deadline = _yielding_pair()
    assert sched.next_deadline() == deadline
    assert sched.tick(just_before(deadline)) == []
    assert sched.tick(deadline) == [Enforce("a", 1, 0.0)]
    assert sched.holder() == "a" and sched.state("a") is YIELDING  # the daemon decides
    assert sched.next_deadline() is None
    assert sched.tick(deadline + 5.0) == []


def test_enforce_reports_the_overrun_when_ticked_late():
    sched, deadline = _yielding_pair()
    (enforce,) = sched.tick(deadline + 0.05)
    assert enforce.overrun_ms == pytest.approx(50.0)


def test_each_grant_gets_its_own_enforce():
    sched, deadline = _yielding_pair()
    sched.tick(deadline)
    sched.revoke("a", deadline, "overrun")
    sched.request("a", deadline)
    sched.tick(deadline + Q_TRAIN_S)
    assert sched.tick(deadline + Q_TRAIN_S + GRACE_S) == [Enforce("b", 2, 0.0)]


def test_revoke_takes_the_token_idles_the_session_and_grants_the_next():
    sched, deadline = _yielding_pair()
    sched.tick(deadline)
    assert sched.revoke("a", 0.4, "overrun") == [Revoked("a", 1, "overrun"), Grant("b", 2, 200.0, 0.4)]
    assert sched.state("a") is IDLE  # not requeued
    assert sched.snapshot(0.4).queue == ()
    assert view(sched, "a", 0.4).gpu_time_s == pytest.approx(0.4)


def test_revoke_with_nobody_waiting_frees_the_token():
    sched = make(("a", TRAIN, 1.0))
    sched.request("a", 0.0)
    assert sched.revoke("a", 0.15, "client lost") == [Revoked("a", 1, "client lost")]
    assert sched.holder() is None


def test_revoke_of_a_non_holder_is_refused_and_changes_nothing():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), ("c", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.0)
    before = sched.snapshot(0.1)
    for session in ("b", "c"):
        with pytest.raises(NotHolderError, match=f"'{session}' does not hold"):
            sched.revoke(session, 0.1, "x")
    assert sched.snapshot(0.1) == before


# ---------------------------------------------------------------- next_deadline


def test_next_deadline_is_none_when_nothing_is_pending():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    assert TokenScheduler(0).next_deadline() is None
    assert sched.next_deadline() is None  # sessions, all idle
    sched.request("a", 0.0)
    assert sched.next_deadline() is None  # holder alone
    sched.request("b", 0.0)
    assert sched.next_deadline() == Q_TRAIN_S
    sched.cancel("b", 0.1)
    assert sched.next_deadline() is None  # the waiter left


# ---------------------------------------------------------------- remove


def test_removing_the_holder_grants_the_next_in_the_same_call():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.02)
    assert sched.remove_session("a", 0.1) == [Grant("b", 2, 200.0, pytest.approx(0.08))]
    assert "a" not in sched and len(sched) == 1
    assert sched.holder() == "b"


def test_removing_a_waiter_or_an_idle_session_just_drops_it():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), ("c", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.0)
    assert sched.remove_session("b", 0.1) == []
    assert sched.remove_session("c", 0.1) == []
    assert sched.snapshot(0.1).queue == ()
    assert sched.next_deadline() is None
    assert sched.release("a", 1, 0.2) == []
    assert sched.holder() is None and len(sched) == 1


# ---------------------------------------------------------------- accounting, snapshot


def test_release_charges_gpu_time_and_virtual_time_divided_by_weight():
    sched = make(("a", TRAIN, 2.0))
    sched.request("a", 1.0)
    sched.release("a", 1, 1.3)
    a = view(sched, "a", 5.0)
    assert a.gpu_time_s == pytest.approx(0.3)
    assert a.vtime_s == pytest.approx(0.15)
    assert a.grants == 1


def test_set_weight_on_the_holder_charges_time_so_far_at_the_old_weight():
    sched = make(("a", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.set_weight("a", 4.0, 0.1)
    sched.release("a", 1, 0.5)
    a = view(sched, "a", 0.5)
    assert a.vtime_s == pytest.approx(0.1 + 0.4 / 4)
    assert a.gpu_time_s == pytest.approx(0.5)
    assert a.weight == 4.0


def test_snapshot_counts_the_running_slice_without_charging_it():
    sched = make(("a", TRAIN, 2.0), ("b", INFER, 1.0), ("c", BEST, 1.0))
    sched.request("a", 1.0)
    sched.request("c", 1.1)
    snap = sched.snapshot(1.3)
    a = view(sched, "a", 1.3)
    assert a.gpu_time_s == pytest.approx(0.3) and a.vtime_s == pytest.approx(0.15)
    assert a.state is HOLDING and a.waiting_since is None
    assert (snap.device, snap.holder, snap.grant, snap.queue) == (0, "a", 1, ("c",))
    assert view(sched, "c", 1.3).waiting_since == 1.1
    assert [v.session for v in snap.sessions] == ["a", "b", "c"]
    sched.snapshot(1.4)
    sched.release("a", 1, 1.5)
    assert view(sched, "a", 1.5).gpu_time_s == pytest.approx(0.5)  # not counted twice
    assert sched.snapshot(1.5).grant == 2  # c holds now


# ---------------------------------------------------------------- fair share, sleeper clamp


@pytest.mark.parametrize("requeue", [False, True], ids=["release-then-request", "requeue"])
def test_weights_1_1_2_converge_to_25_25_50_with_short_voluntary_slices(requeue):
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), ("c", TRAIN, 2.0))
    now = 0.0
    (grant,) = sched.request("a", now)
    sched.request("b", now)
    sched.request("c", now)
    for _ in range(3000):
        now += 0.01  # a 10 ms `with slice():` body, well under the quantum
        actions = sched.release(grant.session, grant.grant, now, requeue=requeue)
        if not requeue:
            assert sched.request(grant.session, now) == []
        (grant,) = actions
    gpu = {v.session: v.gpu_time_s for v in sched.snapshot(now).sessions}
    total = sum(gpu.values())
    assert total == pytest.approx(now)
    assert gpu["a"] / total == pytest.approx(0.25, abs=0.01)
    assert gpu["b"] / total == pytest.approx(0.25, abs=0.01)
    assert gpu["c"] / total == pytest.approx(0.50, abs=0.01)


def test_a_newcomer_gets_at_most_about_one_quantum_more_than_a_long_running_holder():
    sched = make(("old", TRAIN, 1.0))
    sched.request("old", 0.0)
    sched.add_session("new", TRAIN, 1.0, 100.0)
    sched.request("new", 100.0)
    now = 100.0
    while now < 160.0:  # both clients yield 1 ms after being asked
        now = max(now, sched.next_deadline())
        for action in sched.tick(now):
            assert isinstance(action, AskYield)
            now += 0.001
            sched.release(action.session, action.grant, now, requeue=True)
    gpu = {v.session: v.gpu_time_s for v in sched.snapshot(now).sessions}
    old_since_arrival = gpu["old"] - 100.0
    assert gpu["new"] - old_since_arrival <= Q_TRAIN_S + 0.01
    assert gpu["new"] >= 25.0  # and it still gets its half


def test_request_from_idle_is_clamped_to_one_quantum_below_the_least_active_vtime():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), ("c", TRAIN, 1.0))
    sched.request("a", 0.0)  # holds alone for 10 s: running vtime 10
    sched.request("b", 10.0)
    assert view(sched, "b", 10.0).vtime_s == pytest.approx(10.0 - Q_TRAIN_S)
    sched.request("c", 10.0)  # floor is now b's 9.8, not the holder's 10
    assert view(sched, "c", 10.0).vtime_s == pytest.approx(9.8 - Q_TRAIN_S)


def test_no_clamp_without_an_active_session_of_the_same_class():
    sched = make(("b", TRAIN, 1.0), ("i", INFER, 1.0), ("a", TRAIN, 1.0))
    sched.request("b", 0.0)
    sched.release("b", 1, 100.0)  # b: vtime 100, now idle
    sched.request("i", 100.0)  # another class holds: not a floor for training
    sched.request("a", 100.0)
    assert view(sched, "a", 100.0).vtime_s == 0.0


@pytest.mark.parametrize(
    "requeue, vtime_after, next_holder",
    [(True, 2.0, "a"), (False, 100.0 - Q_TRAIN_S, "b")],
)
def test_release_requeue_keeps_vtime_but_a_fresh_request_is_clamped(requeue, vtime_after, next_holder):
    sched = make(("b", TRAIN, 1.0), ("a", TRAIN, 1.0))
    sched.request("b", 0.0)
    sched.release("b", 1, 100.0)  # b: vtime 100
    sched.request("a", 100.0)  # a: vtime 0, unclamped (nobody active)
    sched.request("b", 101.0)  # b keeps 100: its own vtime is above the floor
    assert view(sched, "b", 101.0).vtime_s == pytest.approx(100.0)
    sched.release("a", 2, 102.0, requeue=requeue)  # requeue: a keeps the least vtime
    if not requeue:
        sched.request("a", 102.0)  # b was granted meanwhile; a comes back from IDLE
    assert view(sched, "a", 102.0).vtime_s == pytest.approx(vtime_after)
    assert sched.holder() == next_holder


# ---------------------------------------------------------------- policy change, grant ids, time


def test_set_policy_shortens_the_running_slice_and_applies_to_the_next_grant():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.01)
    fast = SchedulerPolicy(quantum_ms={INFER: 50, TRAIN: 50, BEST: 50}, grace_ms=20)
    assert sched.set_policy(fast, 0.06) == [AskYield("a", 1, 20.0, "quantum")]
    assert sched.policy is fast
    assert sched.next_deadline() == 0.06 + 0.02
    assert sched.release("a", 1, 0.07) == [Grant("b", 2, 50.0, pytest.approx(0.06))]


def test_set_policy_lengthening_moves_the_quantum_deadline_but_not_an_announced_yield():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 0.0)
    sched.request("b", 0.0)
    slow = SchedulerPolicy(quantum_ms={INFER: 50, TRAIN: 1000, BEST: 200}, grace_ms=5000)
    assert sched.set_policy(slow, 0.1) == []
    assert sched.next_deadline() == 1.0
    assert sched.tick(0.5) == []
    sched.tick(1.0)
    assert sched.next_deadline() == 1.0 + 5.0
    sched.set_policy(SchedulerPolicy(), 1.1)
    assert sched.next_deadline() == 1.0 + 5.0  # the client was told 5000 ms


def test_grant_ids_start_at_first_grant_and_strictly_increase():
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0), first_grant=41)
    ids = [sched.request("a", 0.0)[0].grant]
    ids.append(sched.release("a", ids[-1], 0.1, requeue=True)[0].grant)
    sched.request("b", 0.1)
    ids.append(sched.revoke("a", 0.2, "x")[-1].grant)
    sched.request("a", 0.2)
    ids.append(sched.remove_session("b", 0.3)[0].grant)
    assert ids == [41, 42, 43, 44]


@pytest.mark.parametrize("first_grant", [0, -1, 1.5, True])
def test_first_grant_must_be_a_positive_int(first_grant):
    with pytest.raises(ValueError, match="first_grant"):
        TokenScheduler(0, first_grant=first_grant)


@pytest.mark.parametrize("bad_now", [4.0, math.nan, math.inf])
def test_time_going_backwards_or_not_finite_is_refused_and_changes_nothing(bad_now):
    sched = make(("a", TRAIN, 1.0), ("b", TRAIN, 1.0))
    sched.request("a", 5.0)
    with pytest.raises(ValueError, match="monotonic clock"):
        sched.request("b", bad_now)
    with pytest.raises(ValueError, match="monotonic clock"):
        sched.release("a", 1, bad_now)
    assert sched.state("b") is IDLE and sched.holder() == "a"


# ---------------------------------------------------------------- invariants under random events

SESSIONS = {"i": (INFER, 1.0), "t1": (TRAIN, 1.0), "t2": (TRAIN, 3.0), "b": (BEST, 0.5)}
OPS = ("add", "remove", "request", "cancel", "release", "stale", "revoke", "tick", "tick_due", "weight", "policy")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(OPS),
            st.sampled_from(sorted(SESSIONS)),
            st.sampled_from([0.0, 0.001, 0.03, 0.1, 0.25]),
            st.booleans(),
        ),
        max_size=60,
    )
)
def test_invariants_hold_under_random_events(events):
    sched = TokenScheduler(0)
    policies = [SchedulerPolicy(), SchedulerPolicy(quantum_ms={INFER: 10, TRAIN: 30, BEST: 60}, grace_ms=20)]
    now, last_grant, enforced, removed_gpu_s = 0.0, 0, set(), 0.0
    for op, name, dt, flag in events:
        now += dt
        actions = []
        present = name in sched
        if op == "add":
            if present:
                with pytest.raises(DuplicateSessionError):
                    sched.add_session(name, *SESSIONS[name], now)
            else:
                sched.add_session(name, *SESSIONS[name], now)
        elif not present and op in ("remove", "request", "cancel", "release", "revoke", "weight"):
            with pytest.raises(UnknownSessionError):
                sched.request(name, now)
        elif op == "remove":
            removed_gpu_s += view(sched, name, now).gpu_time_s
            actions = sched.remove_session(name, now)
        elif op == "request":
            actions = sched.request(name, now)
        elif op == "cancel":
            actions = sched.cancel(name, now)
        elif op in ("release", "stale", "revoke"):
            current = sched.snapshot(now).grant
            if op == "stale" or sched.holder() != name:
                before = sched.snapshot(now)
                with pytest.raises((NotHolderError, UnknownSessionError)):
                    sched.release(name, (current or 0) - 1 if op == "stale" else (current or 0), now)
                assert sched.snapshot(now) == before
            elif op == "release":
                actions = sched.release(name, current, now, requeue=flag)
            else:
                actions = sched.revoke(name, now, "test")
        elif op == "tick":
            actions = sched.tick(now)
            due = sched.next_deadline()
            assert due is None or due > now  # everything due was emitted
        elif op == "tick_due":
            due = sched.next_deadline()
            if due is not None:
                now = max(now, due)
                actions = sched.tick(now)
                assert actions, "next_deadline() promised an action"
        elif op == "weight":
            sched.set_weight(name, 0.5 + dt * 10, now)
        else:
            actions = sched.set_policy(policies[flag], now)

        snap = sched.snapshot(now)
        by_state = {s: [v.session for v in snap.sessions if v.state is s] for s in SessionState}
        holders = by_state[HOLDING] + by_state[YIELDING]
        assert len(holders) <= 1
        assert holders == ([snap.holder] if snap.holder is not None else [])
        assert snap.holder not in snap.queue
        assert sorted(snap.queue) == sorted(by_state[WAITING])
        assert snap.holder is not None or not snap.queue  # a free token is never left idle
        for action in actions:
            if isinstance(action, Grant):
                assert action.grant > last_grant
                last_grant = action.grant
                assert action.session == snap.holder and action.grant == snap.grant
                waiting_classes = [SESSIONS[s][0] for s in snap.queue]
                assert all(SESSIONS[action.session][0] <= c for c in waiting_classes)
            elif isinstance(action, Enforce):
                assert action.grant not in enforced
                enforced.add(action.grant)
            elif isinstance(action, AskYield):
                assert action.session == snap.holder and action.grant == snap.grant
        assert sum(v.gpu_time_s for v in snap.sessions) + removed_gpu_s <= now + 1e-9


# ------------------------------------------------------------------ preempt

def test_preempt_requeues_the_holder_and_grants_the_next():
    s = TokenScheduler(0, SchedulerPolicy(grace_ms=10.0))
    s.add_session("hog", Workload.TRAINING, 1.0, 0.0)
    s.add_session("inf", Workload.INFERENCE, 1.0, 0.0)
    [g1] = s.request("hog", 0.0)
    [ask] = s.request("inf", 1.0)
    assert ask.reason == "preempted"
    [enforce] = s.tick(1.010)
    assert isinstance(enforce, Enforce) and enforce.session == "hog"
    [g2] = s.preempt("hog", 1.010)
    assert isinstance(g2, Grant) and g2.session == "inf" and g2.grant > g1.grant
    assert s.state("hog") is SessionState.WAITING
    snap = s.snapshot(1.010)
    hog = next(v for v in snap.sessions if v.session == "hog")
    assert hog.gpu_time_s == pytest.approx(1.010)  # charged for the time it held
    # When inference leaves, the stopped trainer is next in line: no request needed.
    [g3] = s.release("inf", g2.grant, 1.5)
    assert g3.session == "hog" and g3.waited_s == pytest.approx(0.49)


def test_preempt_of_a_non_holder_is_refused_and_changes_nothing():
    s = TokenScheduler(0)
    s.add_session("a", Workload.TRAINING, 1.0, 0.0)
    s.add_session("b", Workload.TRAINING, 1.0, 0.0)
    s.request("a", 0.0)
    s.request("b", 0.0)
    before = s.snapshot(0.0)
    with pytest.raises(NotHolderError):
        s.preempt("b", 0.0)
    assert s.snapshot(0.0) == before


def test_no_enforce_when_the_waiter_that_caused_the_yield_has_left():
    s = TokenScheduler(0, SchedulerPolicy(quantum_ms={"inference": 50, "training": 100, "best-effort": 100},
                                          grace_ms=10.0))
    s.add_session("a", Workload.TRAINING, 1.0, 0.0)
    s.add_session("b", Workload.TRAINING, 1.0, 0.0)
    [g] = s.request("a", 0.0)
    s.request("b", 0.05)
    [ask] = s.tick(0.1)
    assert ask.reason == "quantum"
    s.cancel("b", 0.105)
    assert s.tick(0.2) == []  # past the deadline, but nobody is owed the device
    assert s.state("a") is SessionState.HOLDING
    assert s.next_deadline() is None
    # A new waiter starts a new quantum ask, and then enforcement applies again.
    s.request("b", 0.25)
    assert s.tick(0.25) == []  # the renewed quantum runs from 0.2
    assert [type(x) for x in s.tick(0.31)] == [AskYield]
    assert [type(x) for x in s.tick(0.33)] == [Enforce]


def test_a_request_held_back_by_the_caller_keeps_its_wait_and_gets_no_clamp():
    s = TokenScheduler(0, SchedulerPolicy(quantum_ms={"inference": 50, "training": 20, "best-effort": 20}))
    for sid in ("claimer", "parked", "fresh"):
        s.add_session(sid, Workload.TRAINING, 1.0, 0.0)
    s.request("claimer", 0.0)
    # At 0.05 the restore window closes; "parked" asked at 0.01, "fresh" asks now.
    s.request("fresh", 0.05)
    s.request("parked", 0.05, waiting_since=0.01)
    views = {v.session: v for v in s.snapshot(0.05).sessions}
    assert views["parked"].vtime_s == 0.0 and views["parked"].waiting_since == 0.01
    assert views["fresh"].vtime_s == pytest.approx(0.05 - 0.02)  # clamped: a quantum behind the claimer
    assert s.snapshot(0.05).queue == ("parked", "fresh")
    s.add_session("late", Workload.TRAINING, 1.0, 0.06)
    with pytest.raises(ValueError):
        s.request("late", 0.06, waiting_since=0.07)  # cannot have waited since the future
    assert s.state("late") is SessionState.IDLE
