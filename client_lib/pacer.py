"""Pause points between layers and a bounded GPU run-ahead, for a trainer that co-runs (:class:`Pacer`).

Hooks on about ``points`` modules, their gradients and the optimizer step read the device's pace
board (:mod:`client_lib.pace`) and wait there while the trainer is paused; while a pause can come,
each point also keeps this process's queued GPU work under ``ahead_ms``. A fence finishes queued
work before the token is handed on. Why the bound is in time, and what it cost: docs/internals.md.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterable

import torch

log = logging.getLogger("client_lib.pacer")


class Pacer:
    """Pause points, bounded run-ahead and a yield fence for ``modules`` of a lower-class session
    (see docs/internals.md; while the current stream captures a CUDA graph, the bound and the
    fence make no CUDA call). ``optimizers``: an optimizer or several, paused before each step.
    ``ahead_ms``: GPU time of this process's work that may stay queued while a higher class is on
    the device (None: 8 ms under MPS client priority, where queued work yields block by block,
    else 4 ms). ``points``: about how many pause points to place in each module tree. ``bound``:
    when the run-ahead is bounded while a higher class is on the device: ``"present"`` always,
    ``"pausable"`` only while the board says a pause may come (``armed``); None: pausable under
    MPS client priority, else present."""

    def __init__(self, client, modules: torch.nn.Module | Iterable[torch.nn.Module],
                 optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (), *,
                 ahead_ms: float | None = None, points: int = 16,
                 device: torch.device | str | None = None, bound: str | None = None) -> None:
        mps_low = _mps_low_priority(client)
        if ahead_ms is None:
            ahead_ms = 8.0 if mps_low else 4.0
        if bound is None:
            bound = "pausable" if mps_low else "present"
        if bound not in ("pausable", "present"):
            raise ValueError(f"bound is 'pausable' or 'present', got {bound!r}")
        self.bound = bound
        if not ahead_ms > 0:
            raise ValueError(f"ahead_ms must be > 0, got {ahead_ms}")
        if points < 1:
            raise ValueError(f"points must be >= 1, got {points}")
        self.client = client
        self.ahead_ms = float(ahead_ms)
        self._segment_ms = 0.0  # EWMA of the GPU time between two points (0: not measured yet)
        self._last_done = None  # the last event seen complete, for the next segment's time
        modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        first = next((q.device for module in modules for q in module.parameters()), None)
        self._device = torch.device(device) if device is not None else first
        self._cuda = self._device is not None and self._device.type == "cuda"
        self._events: collections.deque = collections.deque()
        self._free: list = []
        self._handles: list = []
        self.points = 0  # pause points placed
        self.waited_s = 0.0  # time held at points: paced (the board) or bounding run-ahead (events)
        self.bounded_s = 0.0  # of which waiting for the run-ahead bound
        for root in modules:
            for module in pause_modules(root, points):
                self._handles.append(module.register_forward_pre_hook(self._hook))
                param = next((q for q in module.parameters() if q.requires_grad), None)
                if param is not None and hasattr(param, "register_post_accumulate_grad_hook"):
                    self._handles.append(param.register_post_accumulate_grad_hook(self._hook))
                self.points += 1
        for optimizer in optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._hook))
        client.set_fence(self.fence)

    # ------------------------------------------------------------------ api

    def fence(self) -> None:
        """Finish the work this process queued on the device (before the token moves on); not while
        a CUDA graph is being captured (a synchronise would invalidate the capture)."""
        if self._cuda and not _capturing():
            torch.cuda.synchronize(self._device)
        self._recycle_all()

    def point(self) -> None:
        """A pause point: bound the run-ahead while a higher class is on the device, and wait
        while the daemon paces this session. Call it yourself where hooks do not reach."""
        pacing = self.client.pacing
        if pacing is None:
            return
        pace = pacing.pace()
        if self._cuda:
            if pace.armed if self.bound == "pausable" else pace.present:
                if not _capturing():  # a CUDA graph being captured: no event calls
                    self._bound()
            elif self._events:
                self._recycle_all()
        if pace.throttled:
            held = self.client.pace_point()
            self.waited_s += held
            if held and self._last_done is not None:  # the next segment's time would include the pause
                self._free.append(self._last_done)
                self._last_done = None

    def close(self) -> None:
        """Remove the hooks and the fence."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.client._fence == self.fence:
            self.client.set_fence(None)

    def __enter__(self) -> Pacer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _hook(self, *hook_args) -> None:
        """The forward pre-hook, the gradient hook and the step pre-hook: a point, whatever they pass."""
        self.point()

    def _bound(self) -> None:
        """Record an event here; wait until the queued segments add up to at most ``ahead_ms``."""
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        events = self._events
        events.append(event)
        while events and events[0].query():  # done already: learn the segment time, no wait
            self._retire(events.popleft())
        segment_ms = self._segment_ms or 1.0
        allowed = max(2, int(self.ahead_ms / segment_ms))
        while len(events) > allowed:
            oldest = events[0]
            started = time.perf_counter()
            oldest.synchronize()
            waited = time.perf_counter() - started
            self.bounded_s += waited
            self.waited_s += waited
            self._retire(events.popleft())

    def _retire(self, event) -> None:
        """``event`` completed: its time since the previous completed one is a segment's GPU time."""
        last = self._last_done
        if last is not None:
            ms = last.elapsed_time(event)
            if self._segment_ms:  # a gap (the CPU late, a step boundary) counts as at most 4 segments
                self._segment_ms = 0.9 * self._segment_ms + 0.1 * min(ms, 4 * self._segment_ms)
            elif 0 < ms < 1000:
                self._segment_ms = ms
            self._free.append(last)
        self._last_done = event

    def _recycle_all(self) -> None:
        while self._events:
            self._free.append(self._events.popleft())
        if self._last_done is not None:
            self._free.append(self._last_done)
            self._last_done = None


def pause_modules(root: torch.nn.Module, points: int) -> list[torch.nn.Module]:
    """About ``points`` submodules of ``root`` that split its parameters into similar shares:
    a module holding more than 1/points of them is split into its children, in order.
    Modules without parameters get no point (a pause there would sit between the same
    two kernels as one beside it)."""
    share = sum(q.numel() for q in root.parameters()) / points
    chosen: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        size = sum(q.numel() for q in module.parameters())
        if size == 0:
            return
        if size > share and sum(q.numel() for q in module.parameters(recurse=False)) == 0:
            for child in module.children():  # (those without parameters return at once)
                visit(child)
        else:
            chosen.append(module)

    visit(root)
    return chosen


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False from a torch built without CUDA)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


def _mps_low_priority(client) -> bool:
    """Whether the client runs under MPS at a lower client priority (from its welcome's env)."""
    welcome = getattr(client, "welcome", None)
    env = getattr(welcome, "env", None) or {}
    return env.get("CUDA_MPS_CLIENT_PRIORITY", "0") not in ("", "0")
