"""Measured forward passes (:func:`profile`): the layers in execution order, their times,
and which layer first needs each tensor, for :mod:`ctxpool.grouping`. Detail: docs/internals.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ctxpool.layout import Slot


@dataclass
class Profile:
    layer_names: list[str]  # execution order, layer 0 is the model ("")
    compute_s: list[float]
    slot_owner: list[int]  # per slot, its owner layer
    forward_s: float


class _FirstUse(TorchFunctionMode):
    """Records, for each watched tensor, the name of the layer current at its first use."""

    def __init__(self, watched: dict[int, int], current: list[str], first_use: dict[int, str]) -> None:
        super().__init__()
        self._watched, self._current, self._first_use = watched, current, first_use

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if len(self._first_use) < len(self._watched):
            for arg in (*args, *kwargs.values()):
                for t in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                    slot = self._watched.get(id(t)) if isinstance(t, torch.Tensor) else None
                    if slot is not None and slot not in self._first_use:
                        self._first_use[slot] = self._current[0]
        return func(*args, **kwargs)


def profile(module: torch.nn.Module, run: Callable[[], Any], slots: list[Slot],
            synchronize: Callable[[], None], timed_runs: int = 2) -> Profile:
    """Run ``run()`` (which calls ``module``) 1 + ``timed_runs`` times; see docs/internals.md.

    The first run watches first uses (a TorchFunctionMode is slow) and pays for first-call costs
    (kernel selection, lazy init); the others, with only the timing hooks, are measured."""
    watched = {id(slot.tensor): i for i, slot in enumerate(slots)}
    current = [""]
    first_use: dict[int, str] = {}  # slot -> name of the layer current at its first use

    def follow(name: str):
        def hook(_module, _args):
            current[0] = name
        return hook

    with _hooks(module, follow), _FirstUse(watched, current, first_use):
        run()
    synchronize()

    layer_of: dict[str, int] = {}  # module name -> layer index (first call)
    names: list[str] = []
    cuts: list[tuple[float, int]] = []  # (time, layer) at every pre-hook

    def timed(name: str):
        def hook(_module, _args):
            synchronize()
            index = layer_of.get(name)
            if index is None:
                index = layer_of[name] = len(names)
                names.append(name)
            cuts.append((time.perf_counter(), index))
        return hook

    compute_s: list[float] = []
    forward_s = float("inf")
    with _hooks(module, timed):
        for _ in range(timed_runs):
            cuts.clear()
            t0 = time.perf_counter()
            run()
            synchronize()
            t_end = time.perf_counter()
            if not names or names[0] != "":
                raise ValueError("the example run never called the model itself")
            this_run = [0.0] * len(names)
            for (t, layer), (t_next, _) in zip(cuts, cuts[1:] + [(t_end, 0)]):
                this_run[layer] += t_next - t
            this_run[0] += cuts[0][0] - t0
            # Per layer, the fastest run: noise (a busy machine) only ever adds time.
            compute_s = [min(a, b) for a, b in zip(compute_s, this_run)] + this_run[len(compute_s):]
            forward_s = min(forward_s, t_end - t0)

    owners = []
    for i, slot in enumerate(slots):
        static = min(_nearest_called(r, layer_of) for r in slot.registrants)
        used = layer_of.get(first_use[i], static) if i in first_use else static
        owners.append(min(static, used))
    return Profile(names, compute_s, owners, forward_s)


@contextmanager
def _hooks(module: torch.nn.Module, make: Callable[[str], Callable]) -> Iterator[None]:
    """A forward pre-hook ``make(name)`` on every submodule, removed on exit."""
    handles = [sub.register_forward_pre_hook(make(name)) for name, sub in module.named_modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _nearest_called(name: str, layer_of: dict[str, int]) -> int:
    while name not in layer_of:
        if name == "":
            return 0
        name = name.rpartition(".")[0]
    return layer_of[name]
