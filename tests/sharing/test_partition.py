"""Tests of sharing.partition: the pure MPS partition planner."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharing.partition import (
    ACTIVE_THREAD_PERCENTAGE_ENV,
    PINNED_MEM_LIMIT_ENV,
    PartitionError,
    PartitionPlan,
    PartitionTable,
    plan_partition,
)


# ---------------------------------------------------------------- shares


def _free_percent(plan: PartitionPlan) -> int:
    """Percent of the plan's total that no session holds."""
    return plan.total - sum(plan.shares.values())


def test_sessions_without_requests_split_equally_ties_to_the_smaller_id():
    plan = plan_partition({"c": None, "a": None, "b": None})
    assert dict(plan.shares) == {"a": 34, "b": 33, "c": 33}
    assert _free_percent(plan) == 0


def test_explicit_requests_first_the_rest_shared():
    plan = plan_partition({"train": 50, "x": None, "y": None})
    assert dict(plan.shares) == {"train": 50, "x": 25, "y": 25}


def test_only_explicit_requests_leave_the_rest_free():
    plan = plan_partition({"a": 30, "b": 20})
    assert dict(plan.shares) == {"a": 30, "b": 20}
    assert _free_percent(plan) == 50


def test_fractions_round_by_largest_remainder():
    plan = plan_partition({"a": 33.3, "b": 33.3, "c": 33.4})
    assert dict(plan.shares) == {"a": 33, "b": 33, "c": 34}
    plan = plan_partition({"a": 12.5, "b": 12.5})  # sum 25: one of them rounds up, the smaller id
    assert dict(plan.shares) == {"a": 13, "b": 12}
    plan = plan_partition({"a": 10.6, "b": 10.6})  # sum 21.2 -> 21, never over what was asked in total
    assert sum(plan.shares.values()) == 21


def test_same_requests_in_any_order_give_the_same_plan():
    one = plan_partition({"a": None, "b": 20.5, "c": None, "d": 7.25})
    two = plan_partition({"d": 7.25, "c": None, "b": 20.5, "a": None})
    assert dict(one.shares) == dict(two.shares)


def test_total_below_100_holds_some_back():
    plan = plan_partition({"a": None, "b": None}, total=90)
    assert dict(plan.shares) == {"a": 45, "b": 45} and _free_percent(plan) == 0 and plan.total == 90


def test_empty_plan():
    plan = plan_partition({})
    assert dict(plan.shares) == {} and _free_percent(plan) == 100


@settings(max_examples=300, deadline=None)
@given(
    explicit=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(5, 60), max_size=6),
    open_count=st.integers(0, 4),
    total=st.integers(20, 100),
)
def test_feasible_plans_keep_every_rule(explicit, open_count, total):
    requests = {**explicit, **{f"open{i}": None for i in range(open_count)}}
    try:
        plan = plan_partition(requests, min_percent=5, total=total)
    except PartitionError:
        asked = sum(explicit.values())
        assert asked > total or (open_count and (total - asked) / open_count < 5)
        return
    shares = plan.shares
    assert set(shares) == set(requests)
    assert sum(shares.values()) <= total
    exact = dict(explicit)
    if open_count:
        exact.update({s: (total - sum(explicit.values())) / open_count for s in requests if requests[s] is None})
    for s, share in shares.items():
        assert isinstance(share, int) and 5 <= share <= 100
        assert math.floor(exact[s] + 1e-9) <= share <= math.floor(exact[s] + 1e-9) + 1
    assert sum(shares.values()) == math.floor(sum(exact.values()) + 1e-9)


# ---------------------------------------------------------------- infeasible


def test_requests_over_the_total_name_sessions_and_numbers():
    with pytest.raises(PartitionError) as info:
        plan_partition({"a": 80, "b": 50, "c": None})
    assert str(info.value) == "SM requests sum to 130% (a=80%, b=50%), over the 100% available"


def test_a_request_below_the_minimum_names_it():
    with pytest.raises(PartitionError, match=r"session 'tiny' asks for 2% of the SMs; the minimum share is 5%"):
        plan_partition({"tiny": 2, "big": 50})


def test_open_sessions_squeezed_below_the_minimum():
    with pytest.raises(PartitionError) as info:
        plan_partition({"a": 92, "x": None, "y": None})
    message = str(info.value)
    assert "'x', 'y'" in message and "8% left" in message and "4% each" in message and "5% minimum" in message


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True, "50"])
def test_bad_percent_values(bad):
    with pytest.raises(PartitionError, match="percent of session 'a'"):
        plan_partition({"a": bad})


@pytest.mark.parametrize("options", [{"total": 0}, {"total": 101}, {"total": 50.0}, {"min_percent": 0},
                                     {"min_percent": 60, "total": 50}, {"min_percent": 2.5}])
def test_bad_options(options):
    with pytest.raises(PartitionError):
        plan_partition({"a": None}, **options)


def test_partition_error_is_a_value_error_with_a_stable_code():
    assert issubclass(PartitionError, ValueError) and PartitionError.code == "E_PARTITION"


# ---------------------------------------------------------------- memory


def test_memory_is_capped_only_where_declared_and_undeclared_sessions_are_left_uncapped():
    """Issue 30, defect 5: an even split of what is left capped the second undeclared session on an
    H200 at half the card and the third at a third, so an LLM server or trainer that fits without the
    daemon ran out of memory beside it. Memory admission stays the daemon's (declarations and NVML)."""
    plan = plan_partition({"a": 50, "b": None, "c": None}, memory_total_mb=10000, memory_requests_mb={"a": 4000})
    assert dict(plan.memory_limits_mb) == {"a": 4000}
    assert PINNED_MEM_LIMIT_ENV not in plan.env_for("b") and PINNED_MEM_LIMIT_ENV not in plan.env_for("c")
    table = PartitionTable(0, memory_total_mb=143_771)  # an H200's MiB
    for name in ("llm", "trainer", "third"):
        table.join(name)
    assert dict(table.plan.memory_limits_mb) == {}
    assert all(PINNED_MEM_LIMIT_ENV not in table.issue(name, uncapped=True) for name in ("llm", "trainer", "third"))


def test_memory_without_a_device_total_limits_only_those_who_asked():
    plan = plan_partition({"a": None, "b": None}, memory_requests_mb={"a": 2048})
    assert dict(plan.memory_limits_mb) == {"a": 2048}


def test_memory_over_the_device_names_sessions():
    with pytest.raises(PartitionError) as info:
        plan_partition({"a": None, "b": None}, memory_total_mb=8000, memory_requests_mb={"a": 6000, "b": 4000})
    assert str(info.value) == ("memory requests sum to 10000 MiB (a=6000 MiB, b=4000 MiB), over the 8000 MiB "
                               "the device has")


def test_a_declaration_of_the_whole_device_leaves_the_others_uncapped_not_refused():
    plan = plan_partition({"a": None, "b": None}, memory_total_mb=100, memory_requests_mb={"a": 100})
    assert dict(plan.memory_limits_mb) == {"a": 100}


def test_memory_for_unknown_sessions_and_bad_values():
    with pytest.raises(PartitionError, match="'ghost'"):
        plan_partition({"a": None}, memory_requests_mb={"ghost": 100})
    with pytest.raises(PartitionError, match="memory of session 'a'"):
        plan_partition({"a": None}, memory_requests_mb={"a": 0})


# ---------------------------------------------------------------- environment


def test_env_for_formats():
    plan = plan_partition({"a": 25, "b": None}, memory_requests_mb={"a": 2048})
    assert plan.env_for("a") == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M"}
    assert plan.env_for("a", device_ordinal=1)[PINNED_MEM_LIMIT_ENV] == "1=2048M"
    assert plan.env_for("b") == {ACTIVE_THREAD_PERCENTAGE_ENV: "75"}  # no memory limit: no variable
    with pytest.raises(KeyError):
        plan.env_for("nobody")
    with pytest.raises(ValueError):
        plan.env_for("a", device_ordinal=-1)


def test_plan_is_read_only():
    plan = plan_partition({"a": 10})
    with pytest.raises(TypeError):
        plan.shares["a"] = 90  # type: ignore[index]
    assert isinstance(plan, PartitionPlan)


# ---------------------------------------------------------------- re-planning


def test_table_join_leave_partition():
    table = PartitionTable(0, memory_total_mb=9000)
    assert dict(table.join("a").shares) == {"a": 100}
    assert dict(table.join("b", percent=30, memory_mb=3000).shares) == {"a": 70, "b": 30}
    assert dict(table.plan.memory_limits_mb) == {"b": 3000}
    plan = table.join("c")
    assert dict(plan.shares) == {"a": 35, "b": 30, "c": 35}
    plan = table.partition({"c": 50})  # the placement layer sets the whole partition
    assert dict(plan.shares) == {"a": 25, "b": 25, "c": 50}
    assert dict(plan.memory_limits_mb) == {"b": 3000}  # memory requests kept, the others uncapped
    plan = table.leave("c")
    assert dict(plan.shares) == {"a": 50, "b": 50}
    assert table.leave("c") is plan  # leaving twice is harmless
    assert table.sessions() == ["a", "b"]


def test_table_refuses_infeasible_changes_and_keeps_its_plan():
    table = PartitionTable(0)
    table.join("a", percent=60)
    before = table.plan
    with pytest.raises(PartitionError, match="sum to 110%"):
        table.join("b", percent=50)
    with pytest.raises(PartitionError, match="already in the partition"):
        table.join("a")
    with pytest.raises(PartitionError, match="no session\\(s\\) 'zz'"):
        table.partition({"zz": 10})
    with pytest.raises(PartitionError, match="sum to 120%"):
        table.partition({"a": 120})
    assert table.plan is before and table.sessions() == ["a"]


def test_table_tracks_what_was_issued_and_what_went_stale():
    table = PartitionTable(0)
    table.join("a")
    assert table.issue("a") == {ACTIVE_THREAD_PERCENTAGE_ENV: "100"}
    assert table.stale() == []
    table.join("b")  # a still runs with 100%: its context keeps what it was given
    assert table.stale() == ["a"]
    assert table.issue("b") == {ACTIVE_THREAD_PERCENTAGE_ENV: "50"}
    table.issue("a")  # a re-created its context with the new share
    assert table.stale() == []
    table.leave("b")
    assert table.stale() == ["a"]  # a could have 100 again
