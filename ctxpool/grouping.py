"""Layer groups for pipelined swap-in, pure: which layers travel to the device together
(:func:`plan_groups` over each layer's :class:`LayerCost`). The objective: docs/internals.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_TOLERANCE = 1 + 1e-9  # a copy that fits exactly is not refused for a rounding error


@dataclass(frozen=True)
class LayerCost:
    """One unit of a model's execution, in execution order (first call)."""

    name: str  # qualified module name ("" for the model itself: params no called child owns)
    bytes: int  # parameter + buffer bytes that must be on the device when this layer starts
    compute_s: float  # forward time attributed to this layer in a measured run


@dataclass(frozen=True)
class GroupTiming:
    """When one group copies and computes, in seconds from the start of the swap-in."""

    copy_start_s: float
    copy_end_s: float
    compute_start_s: float
    compute_end_s: float


def plan_groups(layers: Sequence[LayerCost], bytes_per_s: float, *, first_group_bytes: int | None = None,
                min_group_bytes: int = 0) -> list[list[int]]:
    """Contiguous groups of layer indices covering every layer once, in order (see docs/internals.md)."""
    if not (isinstance(bytes_per_s, (int, float)) and math.isfinite(bytes_per_s) and bytes_per_s > 0):
        raise ValueError(f"bytes_per_s must be a positive finite number, got {bytes_per_s!r}")
    for i, layer in enumerate(layers):
        if layer.bytes < 0 or not (math.isfinite(layer.compute_s) and layer.compute_s >= 0):
            raise ValueError(f"layer {i} ({layer.name!r}) has negative or non-finite cost: {layer}")
    n = len(layers)
    if n == 0:
        return []
    groups: list[list[int]] = []
    i = 0
    # Group 0: the shortest prefix reaching first_group_bytes (or the first layer with bytes),
    # then the zero-byte layers right after it.
    want = max(1, first_group_bytes or 0)
    first: list[int] = []
    held = 0
    while i < n and (held < want or layers[i].bytes == 0):
        held += layers[i].bytes
        first.append(i)
        i += 1
    groups.append(first)
    copy_end = held / bytes_per_s
    compute_end = copy_end + sum(layers[j].compute_s for j in first)
    floor_s = max(0, min_group_bytes) / bytes_per_s
    while i < n:
        budget_s = max(compute_end - copy_end, floor_s)
        group: list[int] = []
        group_bytes = 0
        while i < n:
            b = layers[i].bytes
            if b and group_bytes and (group_bytes + b) / bytes_per_s > budget_s * _TOLERANCE:
                break
            group.append(i)
            group_bytes += b
            i += 1
        groups.append(group)
        copy_end += group_bytes / bytes_per_s
        compute_end = max(compute_end, copy_end) + sum(layers[j].compute_s for j in group)
    return groups
