"""One worker's device (:class:`Engine`): a warm context, resident models under a memory
budget (LRU), and pipelined swap-in (a copy stream moves layer groups while compute runs the ones
already there). A failure that kills the context turns every later call into
:class:`~ctxpool.device_errors.DeviceLost`. How a model moves, and its failure rules: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ctxpool.device_errors import DeviceLost, is_fatal
from ctxpool.grouping import GroupTiming, LayerCost, plan_groups
from ctxpool.layout import Layout, Placement
from ctxpool.profile import profile
from ctxpool.streams import Backend, CopyError, CopyJob, CopyWorker, CpuBackend, CudaBackend

log = logging.getLogger("ctxpool.engine")

MODES = ("pipelined", "sequential")
_MAX_GROUPS = 64  # min_group_bytes = model_bytes / this: bounds per-group overhead when copies cannot hide

__all__ = ["MODES", "BudgetError", "CopyError", "DeviceLost", "Engine", "InferStats", "ModelPlan"]


class BudgetError(ValueError):
    """A model does not fit the engine's memory budget even with nothing else resident."""


@dataclass
class ModelPlan:
    name: str
    model_bytes: int  # unique parameter + buffer bytes
    layers: list[LayerCost]
    groups: list[list[int]]  # indices into layers
    bytes_per_s: float  # copy bandwidth the groups were planned for
    device_bytes: int = 0  # the device buffer (model_bytes plus alignment and merged gaps)
    forward_s: float = 0.0  # the profiled forward pass, synchronised at every layer


@dataclass
class InferStats:
    swap: str  # "ready" | "pipelined" | "sequential"
    swap_bytes: int
    transfer_s: float  # time the copy stream/thread was busy (0 when ready)
    groups: int
    # Per group, seconds from the start of the swap-in: copy window, and when compute passed its wait
    # (sequential: the forward pass). Empty when ready. Device time on cuda, perf_counter on cpu.
    timeline: list[GroupTiming] = field(default_factory=list)


@dataclass
class _Model:
    name: str
    module: torch.nn.Module
    layout: Layout
    plan: ModelPlan
    placement: Placement
    layer_modules: list[tuple[torch.nn.Module, int]]  # (module, group) of layers owning bytes, group > 0
    dev_buf: torch.Tensor | None = None


class Engine:
    """One worker's device: warm context, resident models under a memory budget (LRU), pipelined swap-in."""

    def __init__(self, backend: str | Backend, device_index: int = 0, memory_budget_bytes: int | None = None) -> None:
        """``backend``: "cpu", "cuda", or a backend object (tests pass one that records its calls).
        ``memory_budget_bytes``: what resident models may take on the device (None: no bound;
        0: none may be resident, every model is refused)."""
        if memory_budget_bytes is not None and memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0 (or None: no limit), got {memory_budget_bytes}")
        if backend == "cpu":
            self._backend: Backend = CpuBackend()
        elif backend == "cuda":
            self._backend = CudaBackend(device_index)
        elif isinstance(backend, str):
            raise ValueError(f"unknown backend {backend!r}; use 'cpu' or 'cuda'")
        else:
            self._backend = backend
        self.backend = self._backend.kind
        self.device = self._backend.device
        self.memory_budget_bytes = memory_budget_bytes
        self.bytes_per_s: float = 0.0  # measured by warm_up() or the first add_model()
        self._models: dict[str, _Model] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident models, most recently used last
        self._resident_bytes = 0
        self._pool_bytes = 0  # reserved at warm-up: kept when cached memory is released
        self._left = False  # a model left the device since cached memory was last released
        self._busy = threading.Lock()
        self.lost: str | None = None  # why the device context is dead (DeviceLost raised), else None
        self._worker = CopyWorker(self._backend)

    # ------------------------------------------------------------------ lifecycle

    def warm_up(self, pool_bytes: int = 0) -> float:
        """Run a matmul and a conv once, reserve a memory pool, measure copy bandwidth; seconds taken."""
        t0 = time.perf_counter()
        self._backend.warm_up_compute()
        self._backend.reserve(pool_bytes)
        self._pool_bytes = max(0, pool_bytes)
        self.bytes_per_s = self._backend.measure_bytes_per_s()
        took = time.perf_counter() - t0
        log.info("[ctxpool] warm %s: pool=%d bytes copy=%.2f GB/s took_ms=%.1f", self.device, pool_bytes,
                 self.bytes_per_s / 1e9, took * 1e3)
        return took

    def close(self) -> None:
        """Remove every model (unpinning host memory) and stop the copy thread."""
        for name in list(self._models):
            self.remove_model(name)
        self._worker.close()

    # --------------------------------------------------------------------- models

    def add_model(self, name: str, module: torch.nn.Module, example_inputs: tuple, *,
                  first_group_bytes: int | None = None) -> ModelPlan:
        """Measure ``module`` on ``example_inputs`` and plan its groups. ValueError if it cannot run it."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model {name!r}: expected a torch.nn.Module, got {type(module).__name__}")
        if name in self._models:
            raise ValueError(f"a model named {name!r} is already registered; remove it first")
        module.eval()
        layout = Layout(module)
        provisional = layout.place([0] * len(layout.atoms), 1)
        if self.memory_budget_bytes is not None and provisional.device_bytes > self.memory_budget_bytes:
            raise BudgetError(f"model {name!r} needs {provisional.device_bytes} bytes on {self.device}, more than "
                              f"the engine's memory budget of {self.memory_budget_bytes} bytes")
        with self._exclusive():
            self._check_alive()
            try:
                moved = self._backend.adopt_host(name, module)
            except (RuntimeError, OSError) as exc:  # out of host memory for the move: pin what may be pinned
                moved = -1
                log.warning("[ctxpool] model=%s host memory not moved to pages of its own: %s", name, exc)
            if moved:  # storages moved (or may have): the atoms are elsewhere now
                layout = Layout(module)
                provisional = layout.place([0] * len(layout.atoms), 1)
            try:
                pinned = self._backend.pin(name, layout)
            except RuntimeError as exc:  # still correct without: the driver stages pageable copies, slower
                pinned = 0
                log.warning("[ctxpool] model=%s host memory not page-locked, copies will be staged: %s", name, exc)
            try:
                if not self.bytes_per_s:
                    self.bytes_per_s = self._backend.measure_bytes_per_s()
                self._make_room(provisional.device_bytes)
                prof = self._profile(name, module, layout, provisional, example_inputs)
            except BaseException:
                self._backend.unpin(name)  # on cuda: once the copy stream is idle
                raise
        model_bytes = layout.model_bytes
        layer_bytes = [0] * len(prof.layer_names)
        atom_owner = [min(prof.slot_owner[i] for i in atom.slots) for atom in layout.atoms]
        for atom, owner in zip(layout.atoms, atom_owner):
            layer_bytes[owner] += atom.nbytes
        layers = [LayerCost(n, b, c) for n, b, c in zip(prof.layer_names, layer_bytes, prof.compute_s)]
        groups = plan_groups(layers, self.bytes_per_s, first_group_bytes=first_group_bytes,
                             min_group_bytes=model_bytes // _MAX_GROUPS)
        group_of_layer = {j: g for g, members in enumerate(groups) for j in members}
        placement = layout.place([group_of_layer[o] for o in atom_owner], len(groups))
        if self.memory_budget_bytes is not None and placement.device_bytes > self.memory_budget_bytes:
            self._backend.unpin(name)  # grouped spans pad differently from the single-group check above
            raise BudgetError(f"model {name!r} needs {placement.device_bytes} bytes on {self.device}, more than "
                              f"the engine's memory budget of {self.memory_budget_bytes} bytes")
        modules = dict(module.named_modules())
        layer_modules = [(modules[layers[j].name], group_of_layer[j]) for j in range(1, len(layers))
                         if layers[j].bytes and group_of_layer[j] > 0]
        plan = ModelPlan(name, model_bytes, layers, groups, self.bytes_per_s, placement.device_bytes, prof.forward_s)
        self._models[name] = _Model(name, module, layout, plan, placement, layer_modules)
        log.info("[ctxpool] add model=%s bytes=%d tensors=%d layers=%d groups=%d first_group_bytes=%d "
                 "pinned_bytes=%d forward_ms=%.1f", name, model_bytes, len(layout.slots), len(layers), len(groups),
                 sum(layers[j].bytes for j in groups[0]), pinned, prof.forward_s * 1e3)
        return plan

    def _profile(self, name: str, module: torch.nn.Module, layout: Layout, placement: Placement,
                 example_inputs: tuple):
        """Copy the model to the device, profile the example (two runs), then drop the copy."""
        model = _Model(name, module, layout, None, placement, [])  # type: ignore[arg-type]
        job = self._start_copy(model)
        try:
            job.wait(0)
            inputs = self._to_device(example_inputs)
            with torch.no_grad():
                return profile(module, lambda: module(*inputs), layout.slots, self._backend.synchronize)
        except Exception as exc:
            job.join()
            self._settle_after_failure(exc)  # DeviceLost if the context died
            if isinstance(exc, CopyError):
                raise
            raise ValueError(f"model {name!r} cannot run its example inputs on {self.device}: "
                             f"{type(exc).__name__}: {exc}") from exc
        finally:
            job.join()
            self._detach(model)

    def remove_model(self, name: str) -> None:
        """Forget a model: evict it if resident, unpin its host memory (host tensors untouched) and
        give its device memory back (:meth:`release_cached`)."""
        model = self._get(name)
        with self._exclusive():
            if model.dev_buf is not None:
                self._evict(model)
            self._backend.unpin(name)
            del self._models[name]
        log.info("[ctxpool] remove model=%s", name)
        self.release_cached()

    def plan(self, name: str) -> ModelPlan:
        return self._get(name).plan

    def resident(self) -> list[str]:
        """Resident models, most recently used last."""
        return list(self._lru)

    def evict(self, name: str) -> None:
        """Free a model's device copy (its host copy is untouched) and give its device memory back
        (:meth:`release_cached`); no-op if it is not resident."""
        model = self._get(name)
        with self._exclusive():
            if model.dev_buf is None:
                return
            self._evict(model)
        self.release_cached()

    def release_cached(self) -> int:
        """If a model left the device since the last call, give back what the caching allocator kept
        for it beyond the warm-up pool; bytes released. Blocks until the device is idle on cuda
        (``torch.cuda.empty_cache`` frees only then): call it between requests. DeviceLost if that finds
        the context dead."""
        if not self._left or self.lost is not None:
            return 0
        with self._exclusive():
            self._left = False
            try:
                released = self._backend.release_cached(self._pool_bytes)
            except Exception as exc:
                log.warning("[ctxpool] releasing cached memory on %s failed: %s: %s", self.device,
                            type(exc).__name__, exc)
                self._settle_after_failure(exc)  # DeviceLost if the context died
                return 0
        if released:
            log.info("[ctxpool] released cached bytes=%d on %s (kept pool=%d resident=%d)", released, self.device,
                     self._pool_bytes, self._resident_bytes)
        return released

    # ---------------------------------------------------------------------- infer

    def infer(self, name: str, inputs: tuple, *, mode: str = "pipelined") -> tuple[Any, InferStats]:
        """Run ``name`` on ``inputs``; outputs on the device, ready to read. Swaps in (``mode``) if needed."""
        if mode not in MODES:
            raise ValueError(f"unknown swap mode {mode!r}; use one of {MODES}")
        model = self._get(name)
        with self._exclusive():
            self._check_alive()
            t0 = time.perf_counter()
            if model.dev_buf is not None:
                self._lru.move_to_end(name)
                try:
                    with torch.no_grad():
                        out = model.module(*self._to_device(inputs))
                    self._backend.synchronize()
                except Exception as exc:
                    self._settle_after_failure(exc)
                    raise
                return out, InferStats("ready", 0, 0.0, 0)
            self._make_room(model.plan.device_bytes)
            return self._swap_in_and_run(model, inputs, mode, t0)

    def _swap_in_and_run(self, model: _Model, inputs: tuple, mode: str, t0: float) -> tuple[Any, InferStats]:
        groups = len(model.placement.group_spans)
        base = self._backend.mark()
        # The inputs first: queued after the weights', they would arrive after all of them (one copy
        # engine, in order) and no group could compute before (measured: docs/internals.md, streams).
        try:
            device_inputs = self._to_device(inputs)
        except Exception as exc:
            self._settle_after_failure(exc)
            raise
        job = self._start_copy(model)
        compute_marks: list[Any] = [None] * groups  # when compute went ahead with each group
        waited = [-1]  # highest group compute may use

        def use(g: int) -> None:
            """Wait until groups up to ``g`` have arrived; compute proceeds with them from now."""
            if waited[0] >= g:
                return
            for k in range(waited[0] + 1, g + 1):
                job.wait(k)
            now = self._backend.mark()
            for k in range(waited[0] + 1, g + 1):
                compute_marks[k] = now
            waited[0] = g

        hooks = []
        failure: Exception | None = None
        try:
            if mode == "pipelined":
                use(0)
                for module, g in model.layer_modules:
                    hooks.append(module.register_forward_pre_hook(lambda _m, _a, g=g: use(g)))
            else:
                use(groups - 1)
                self._backend.block_until_copied(job.marks[groups - 1])  # the CPU waits too: no overlap at all
            forward_start = self._backend.mark()
            with torch.no_grad():
                out = model.module(*device_inputs)
            forward_end = self._backend.mark()
            use(groups - 1)  # groups no layer of this run asked for
            self._backend.synchronize()
        except Exception as exc:
            failure = exc
            raise
        finally:
            for handle in hooks:
                handle.remove()
            job.join()
            if job.error is not None or failure is not None and waited[0] < groups - 1:
                self._detach(model)  # the copy failed, or the forward raised before using every group
            else:
                self._make_resident(model)
            if failure is not None:
                self._settle_after_failure(failure)  # DeviceLost, chained to the failure, if the context died
        total_s = time.perf_counter() - t0
        timeline = self._timeline(job, base, compute_marks, forward_start, forward_end, mode)
        stats = InferStats(mode, model.placement.copy_bytes, job.transfer_s(), groups, timeline)
        log.debug("[ctxpool] swap-in model=%s mode=%s groups=%d bytes=%d total_ms=%.2f transfer_ms=%.2f",
                  model.name, mode, groups, stats.swap_bytes, total_s * 1e3, stats.transfer_s * 1e3)
        return out, stats

    def _timeline(self, job: CopyJob, base: Any, compute_marks: list[Any], forward_start: Any, forward_end: Any,
                  mode: str) -> list[GroupTiming]:
        el = self._backend.elapsed_s
        out = []
        for k, (copy_start, copy_end) in enumerate(job.marks):
            if mode == "pipelined":
                start = compute_marks[k]
                end = compute_marks[k + 1] if k + 1 < len(compute_marks) else forward_end
                start_s, end_s = el(base, start), max(el(base, start), el(base, end))
            else:
                start_s, end_s = el(base, forward_start), el(base, forward_end)
            out.append(GroupTiming(el(base, copy_start), el(base, copy_end), start_s, end_s))
        return out

    # -------------------------------------------------------------------- helpers

    def _start_copy(self, model: _Model) -> CopyJob:
        """Allocate the device buffer and hand every group to the copy thread."""
        placement = model.placement
        dev_buf = self._backend.alloc(placement.device_bytes)
        self._backend.prepare(dev_buf)
        model.dev_buf = dev_buf
        layout = model.layout

        def attach(k: int) -> None:  # copy thread: point group k's tensors at their device views
            members = placement.group_slots[k]
            for i, view in zip(members, layout.device_views(placement, dev_buf, members)):
                layout.slots[i].tensor.data = view

        job = CopyJob(self._backend, placement.group_spans, dev_buf, attach, f"model {model.name!r}")
        self._backend.order_after_compute()  # before any copy of the job is issued
        if self._backend.issues_async:
            job.run()  # queued on the copy stream now; compute waits for each group's event on the GPU
        else:
            self._worker.submit(job)
        return job

    def _detach(self, model: _Model) -> None:
        for slot in model.layout.slots:
            slot.tensor.data = slot.host
        if model.dev_buf is not None:
            self._left = True  # its buffer went back to the caching allocator
        model.dev_buf = None

    def _make_resident(self, model: _Model) -> None:
        self._lru[model.name] = None  # last: it was not resident (it was swapped in)
        self._resident_bytes += model.plan.device_bytes

    def _evict(self, model: _Model) -> None:
        self._detach(model)
        self._lru.pop(model.name, None)
        self._resident_bytes -= model.plan.device_bytes
        log.debug("[ctxpool] evict model=%s bytes=%d", model.name, model.plan.device_bytes)

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used residents until ``nbytes`` more fit the budget."""
        if self.memory_budget_bytes is None:
            return
        while self._resident_bytes + nbytes > self.memory_budget_bytes and self._lru:
            self._evict(self._models[next(iter(self._lru))])
        if self._resident_bytes + nbytes > self.memory_budget_bytes:
            raise MemoryError(f"{nbytes} bytes do not fit the memory budget of {self.memory_budget_bytes} bytes "
                              f"on {self.device} ({self._resident_bytes} resident)")

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._backend.to_device(value)
        if isinstance(value, (list, tuple)):
            mapped = [self._to_device(v) for v in value]
            return type(value)(mapped) if not hasattr(value, "_fields") else type(value)(*mapped)
        if isinstance(value, dict):
            return {k: self._to_device(v) for k, v in value.items()}
        return value

    def _settle_after_failure(self, failure: BaseException) -> None:
        """After a failed run or copy: let the device finish what was queued (kernels of the failed
        forward may still use blocks that went back to the caching allocator) and find out whether
        the context survived. Raises DeviceLost if it did not."""
        try:
            self._backend.synchronize_device()
        except Exception as exc:  # a sticky CUDA error surfaces here, whatever the first error said
            self._lose(f"synchronising {self.device} after {type(failure).__name__} failed: "
                       f"{type(exc).__name__}: {exc}", exc)
        if is_fatal(failure):
            self._lose(f"{type(failure).__name__}: {failure}", failure)

    def _lose(self, reason: str, cause: BaseException) -> None:
        self.lost = (reason.strip().splitlines() or [reason])[0]
        log.error("[ctxpool] device context lost on %s: %s", self.device, self.lost)
        raise DeviceLost(f"the device context on {self.device} is lost ({self.lost}); this process must be "
                         "replaced") from cause

    def _check_alive(self) -> None:
        if self.lost is not None:
            raise DeviceLost(f"the device context on {self.device} was lost earlier ({self.lost}); this "
                             "process must be replaced")

    def _get(self, name: str) -> _Model:
        try:
            return self._models[name]
        except KeyError:
            raise KeyError(f"no model named {name!r} is registered (registered: {sorted(self._models)})") from None

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("the engine is single-threaded: another call is still running on it")
        try:
            yield
        finally:
            self._busy.release()
