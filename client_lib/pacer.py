"""Pause points between layers and a bounded GPU run-ahead, for a trainer that co-runs.

    client = Client("trainer", workload="training")
    pacer = Pacer(client, model, optimizer)     # hooks between layers; a fence before each yield
    with client.slice():
        for batch in loader:
            step(batch)
            client.yield_point()

Under co-run (see :mod:`sharing.corun`) an inference request beside this
trainer is granted at once, and the trainer is asked, through the device's pace
board (:mod:`client_lib.pace`), to hold back while it runs. Two things make
that take effect on the GPU within about a millisecond rather than a training
step:

* **Pause points finer than a step.** Forward pre-hooks on about ``points``
  modules (chosen by parameter count, so that the segments between two points
  are of similar size), a hook on one parameter of each as its gradient is
  accumulated (in backward), and an optimizer step pre-hook. At each point the
  board is read (one memory load); when the trainer is paced, it waits there.
* **A bounded run-ahead.** A training step's CPU side runs ahead of its GPU
  work by up to a whole step, and work already queued cannot be called back.
  While a higher-class session is on the device, each point records a CUDA
  event and waits until the event ``ahead`` points back has completed, so at
  most ``ahead`` segments are queued when a pause begins. With no higher class
  on the device nothing is recorded: a trainer alone pays one read per point.

And a **fence**: before the client hands the token on at a yield or a
suspend (exclusive sharing, training beside training), the device's queued
work is finished, so the next holder gets the GPU rather than a queue of ours.

On the cpu backend there is no run-ahead to bound: the points pause and the
fence does nothing. Hooks are removed by :meth:`Pacer.close`.
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
    (see the module docstring). ``optimizers``: an optimizer or several, paused before each step.
    ``ahead``: segments that may be queued on the GPU beyond the one running. ``points``: about
    how many pause points to place in each module tree."""

    def __init__(self, client, modules: torch.nn.Module | Iterable[torch.nn.Module],
                 optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (), *,
                 ahead: int = 2, points: int = 16, device: torch.device | str | None = None) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {ahead}")
        if points < 1:
            raise ValueError(f"points must be >= 1, got {points}")
        self.client = client
        self.ahead = int(ahead)
        modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        self._device = torch.device(device) if device is not None else _device_of(modules)
        self._cuda = self._device is not None and self._device.type == "cuda"
        self._events: collections.deque = collections.deque()
        self._free: list = []
        self._handles: list = []
        self.points = 0  # pause points placed
        self.waited_s = 0.0  # time held at points: paced (the board) or bounding run-ahead (events)
        self.bounded_s = 0.0  # of which waiting for the run-ahead bound
        for root in modules:
            for module in pause_modules(root, points):
                self._handles.append(module.register_forward_pre_hook(self._forward_point))
                param = next((q for q in module.parameters() if q.requires_grad), None)
                if param is not None and hasattr(param, "register_post_accumulate_grad_hook"):
                    self._handles.append(param.register_post_accumulate_grad_hook(self._backward_point))
                self.points += 1
        for optimizer in optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._step_point))
        client.set_fence(self.fence)

    # ------------------------------------------------------------------ api

    def fence(self) -> None:
        """Finish the work this process queued on the device (before the token moves on)."""
        if self._cuda:
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
            if pace.present:
                self._bound()
            elif self._events:
                self._recycle_all()
        if pace.throttled:
            self.waited_s += self.client.pace_point()

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

    def _forward_point(self, module, args) -> None:
        self.point()

    def _backward_point(self, param) -> None:
        self.point()

    def _step_point(self, optimizer, args, kwargs) -> None:
        self.point()

    def _bound(self) -> None:
        """Record an event here; wait until at most ``ahead`` recorded segments are unfinished."""
        event = self._free.pop() if self._free else torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        events = self._events
        events.append(event)
        while len(events) > self.ahead + 1:
            oldest = events[0]
            if not oldest.query():
                started = time.perf_counter()
                oldest.synchronize()
                waited = time.perf_counter() - started
                self.bounded_s += waited
                self.waited_s += waited
            self._free.append(events.popleft())

    def _recycle_all(self) -> None:
        while self._events:
            self._free.append(self._events.popleft())


def pause_modules(root: torch.nn.Module, points: int) -> list[torch.nn.Module]:
    """About ``points`` submodules of ``root`` that split its parameters into similar shares:
    a module holding more than 1/points of them is split into its children, in order.
    Modules without parameters get no point (a pause there would sit between the same
    two kernels as one beside it)."""
    total = sum(q.numel() for q in root.parameters())
    if total == 0:
        return []
    share = total / points
    chosen: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        size = sum(q.numel() for q in module.parameters())
        if size == 0:
            return
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        direct = sum(q.numel() for q in module.parameters(recurse=False))
        if size > share and children and direct == 0:
            for child in children:
                visit(child)
        else:
            chosen.append(module)

    visit(root)
    return chosen


def _device_of(modules: list[torch.nn.Module]) -> torch.device | None:
    for module in modules:
        for q in module.parameters():
            return q.device
    return None
