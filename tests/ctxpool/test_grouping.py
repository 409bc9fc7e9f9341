"""plan_groups: a partition of the layers in order, a small first group, later copies hidden where possible."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpool.grouping import GroupTiming, LayerCost, plan_groups

BPS = 1e9  # 1 GB/s: 1 MB copies in 1 ms

layer_costs = st.lists(
    st.builds(LayerCost, name=st.just("l"),
              bytes=st.one_of(st.just(0), st.integers(1, 50_000_000)),
              compute_s=st.floats(0.0, 0.05, allow_nan=False)),
    min_size=1, max_size=60)


def simulate(layers, groups, bytes_per_s) -> list[GroupTiming]:
    """The pipeline model plan_groups assumes (docs/internals.md): each group's copy and compute window."""
    out: list[GroupTiming] = []
    copy_end = compute_end = 0.0
    for group in groups:
        copy_start = copy_end
        copy_end = copy_start + sum(layers[j].bytes for j in group) / bytes_per_s
        compute_start = max(compute_end, copy_end)
        compute_end = compute_start + sum(layers[j].compute_s for j in group)
        out.append(GroupTiming(copy_start, copy_end, compute_start, compute_end))
    return out


def makespan_s(layers, groups, bytes_per_s) -> float:
    """Modelled time from the first copy to the last compute (0 for no layers)."""
    timings = simulate(layers, groups, bytes_per_s)
    return timings[-1].compute_end_s if timings else 0.0


def _bytes(layers, group) -> int:
    return sum(layers[j].bytes for j in group)


def _copy_s(layers, group) -> float:
    return _bytes(layers, group) / BPS


def _budgets(layers, groups, min_group_bytes):
    """The copy time each group k >= 1 may take: the compute still ahead when the copy stream frees up."""
    timings = simulate(layers, groups, BPS)
    return [None] + [max(timings[k - 1].compute_end_s - timings[k - 1].copy_end_s, min_group_bytes / BPS)
                     for k in range(1, len(groups))]


@settings(max_examples=300, deadline=None)
@given(layers=layer_costs, first=st.one_of(st.none(), st.integers(0, 80_000_000)),
       min_group=st.one_of(st.just(0), st.integers(1, 30_000_000)))
def test_plan_is_an_ordered_partition_with_a_small_first_group_and_hidden_copies(layers, first, min_group):
    groups = plan_groups(layers, BPS, first_group_bytes=first, min_group_bytes=min_group)

    # Every layer exactly once, in execution order, groups contiguous and non-empty.
    assert [j for g in groups for j in g] == list(range(len(layers)))
    assert all(groups)

    # The first group is the shortest prefix reaching the asked bytes (then only zero-byte layers).
    want = max(1, first or 0)
    g0 = groups[0]
    total = sum(layer.bytes for layer in layers)
    assert _bytes(layers, g0) >= min(want, total)
    with_bytes = [j for j in g0 if layers[j].bytes]
    if with_bytes:
        assert _bytes(layers, g0) - layers[with_bytes[-1]].bytes < want
        assert all(layers[j].bytes == 0 for j in g0 if j > with_bytes[-1])

    # Each later group copies within the compute ahead of it (or its floor), unless it is one layer
    # that owns bytes (a layer is never split); and it is maximal: the next layer would not fit.
    budgets = _budgets(layers, groups, min_group)
    for k in range(1, len(groups)):
        copy_s = _copy_s(layers, groups[k])
        if len([j for j in groups[k] if layers[j].bytes]) > 1:
            assert copy_s <= budgets[k] * (1 + 1e-9) + 1e-15, k
        if k + 1 < len(groups):
            assert copy_s + layers[groups[k + 1][0]].bytes / BPS > budgets[k] * (1 + 1e-9), k

    # Pipelining never loses against copying everything first.
    sequential = sum(layer.bytes for layer in layers) / BPS + sum(layer.compute_s for layer in layers)
    assert makespan_s(layers, groups, BPS) <= sequential * (1 + 1e-9) + 1e-12


@settings(max_examples=200, deadline=None)
@given(layers=layer_costs)
def test_when_every_later_copy_hides_the_swap_costs_only_the_first_group(layers):
    groups = plan_groups(layers, BPS)
    budgets = _budgets(layers, groups, 0)
    if all(_copy_s(layers, groups[k]) <= budgets[k] for k in range(1, len(groups))):
        expected = _copy_s(layers, groups[0]) + sum(layer.compute_s for layer in layers)
        assert math.isclose(makespan_s(layers, groups, BPS), expected, rel_tol=1e-9, abs_tol=1e-12)


def test_compute_bound_model_gets_geometrically_growing_groups():
    # 20 layers of 10 MB (10 ms to copy) and 20 ms of compute each: group k+1 may copy for as long as
    # the compute still ahead of it, so groups double.
    layers = [LayerCost(f"l{i}", 10_000_000, 0.020) for i in range(20)]
    groups = plan_groups(layers, BPS)
    assert [len(g) for g in groups] == [1, 2, 4, 8, 5]
    assert makespan_s(layers, groups, BPS) == pytest.approx(0.010 + 20 * 0.020)


def test_copy_bound_model_falls_back_to_the_floor_size():
    layers = [LayerCost(f"l{i}", 10_000_000, 0.0001) for i in range(40)]
    assert len(plan_groups(layers, BPS)) == 40  # nothing to hide behind: one layer per group
    assert [len(g) for g in plan_groups(layers, BPS, min_group_bytes=80_000_000)] == [1] + [8] * 4 + [7]


def test_zero_byte_layers_ride_along_and_the_first_group_can_be_asked_bigger():
    layers = [LayerCost("", 0, 0.001), LayerCost("conv", 100, 0.001), LayerCost("relu", 0, 0.001),
              LayerCost("fc", 5000, 0.001)]
    assert plan_groups(layers, BPS) == [[0, 1, 2], [3]]
    assert plan_groups(layers, BPS, first_group_bytes=200) == [[0, 1, 2, 3]]
    assert plan_groups([LayerCost("", 0, 0.1)] * 3, BPS) == [[0, 1, 2]]
    assert plan_groups([], BPS) == []


@pytest.mark.parametrize("bps", [0, -1.0, float("nan"), float("inf")])
def test_bad_bandwidth_is_refused(bps):
    with pytest.raises(ValueError, match="bytes_per_s"):
        plan_groups([LayerCost("a", 1, 0.1)], bps)


def test_bad_layer_cost_is_refused():
    with pytest.raises(ValueError, match="layer 1"):
        plan_groups([LayerCost("a", 1, 0.1), LayerCost("b", -5, 0.1)], BPS)
