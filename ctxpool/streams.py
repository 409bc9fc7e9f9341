"""The copy path of a swap-in: a :class:`CopyJob` of groups of :class:`Span`, the copy thread
(:class:`CopyWorker`), and the cpu and cuda backends' ways to copy and to wait
(:class:`CpuBackend`, :class:`CudaBackend`). The ordering rules on cuda: docs/internals.md.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ctxpool import hostmem
from ctxpool.hostmem import HostArena, PinRegistry

log = logging.getLogger("ctxpool.streams")

_PROBE_BYTES = 64 << 20  # bandwidth probe size
_PROBE_REPEATS = 3


class CopyError(RuntimeError):
    """Copying a model's weights to the device failed; the model is not resident."""


@dataclass
class Span:
    """One copy: ``nbytes`` at host address ``host_ptr`` to ``dev_offset`` in the device buffer."""

    host_ptr: int
    nbytes: int
    dev_offset: int
    host_u8: torch.Tensor  # uint8 view of the same host bytes (what the cuda copy reads)


class CpuBackend:
    """The "device" is host memory; copies are ``memmove`` on the copy thread."""

    kind = "cpu"
    issues_async = False  # each copy is a memcpy by the CPU: the copy thread makes it while compute runs

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.arena: HostArena | None = None
        self._warned_fresh = False

    def _nothing(self, *_: object) -> None:
        """A hook with nothing to do on the cpu: the copy thread's event already means the bytes are
        there, and its copies write only blocks no compute uses (so they need no ordering after it)."""

    thread_init = prepare = synchronize = synchronize_device = _nothing
    wait_copied = block_until_copied = order_after_compute = _nothing

    def reserve(self, pool_bytes: int) -> None:
        """Fault in a pool of ``pool_bytes`` that later swap-ins copy into (replaces an idle one)."""
        if pool_bytes <= 0:
            return
        if self.arena is not None and (self.arena.nbytes >= pool_bytes or self.arena.in_use_bytes):
            return
        self.arena = HostArena(pool_bytes)

    def alloc(self, nbytes: int) -> torch.Tensor:
        if self.arena is not None:
            block = self.arena.alloc(nbytes)
            if block is not None:
                return block
        if not self._warned_fresh:
            self._warned_fresh = True
            log.warning("[ctxpool] cpu swap-in of %d bytes outside the reserved pool (%d bytes free): fresh "
                        "pages, slower copies; reserve more with warm_up(pool_bytes=...)", nbytes,
                        self.arena.free_bytes() if self.arena else 0)
        return torch.empty(max(1, nbytes), dtype=torch.uint8)

    def copy_group(self, spans: list[Span], dev_buf: torch.Tensor) -> tuple[float, float]:
        base = dev_buf.data_ptr()
        start = time.perf_counter()
        for s in spans:
            ctypes.memmove(base + s.dev_offset, s.host_ptr, s.nbytes)
        return start, time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_s(self, begin: Any, end: Any) -> float:
        return end - begin

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def adopt_host(self, owner: str, module: torch.nn.Module) -> int:
        return 0  # nothing is page-locked, so the host memory may stay where it is

    def pin(self, owner: str, layout: Any) -> int:
        return 0  # nothing to page-lock (and no is_pinned() query, which would start CUDA on a GPU host)

    def unpin(self, owner: str) -> int:
        return 0

    def release_cached(self, keep_bytes: int) -> int:
        return 0  # evicted buffers are freed as they go (the arena takes its blocks back)

    def warm_up_compute(self) -> None:
        a = torch.randn(256, 256)
        (a @ a).sum().item()
        x = torch.randn(1, 16, 32, 32)
        torch.nn.functional.conv2d(x, torch.randn(16, 16, 3, 3), padding=1).sum().item()

    def measure_bytes_per_s(self) -> float:
        src = torch.ones(_PROBE_BYTES, dtype=torch.uint8)  # touched, like a model's host weights
        rates = []
        for _ in range(_PROBE_REPEATS):  # a block of the pool each time, given back at once
            start, end = self.copy_group([Span(src.data_ptr(), _PROBE_BYTES, 0, src)], self.alloc(_PROBE_BYTES))
            rates.append(_PROBE_BYTES / max(end - start, 1e-9))
        return sorted(rates)[len(rates) // 2]


class CudaBackend:
    """A copy stream, an event per group, page-locked host memory (run on an H100: bench/results)."""

    kind = "cuda"
    issues_async = True  # the calling thread queues every copy at once: a copy thread would add a wake-up

    def __init__(self, device_index: int) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda' asked for, but torch finds no CUDA device "
                               f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
        if not 0 <= device_index < torch.cuda.device_count():
            raise ValueError(f"cuda device {device_index} does not exist ({torch.cuda.device_count()} visible with "
                             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")
        self.device = torch.device("cuda", device_index)
        torch.cuda.set_device(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.pins = PinRegistry()
        self._private: dict[str, hostmem.PrivatePages] = {}  # owner -> the pages adopt_host moved it to

    def thread_init(self) -> None:
        torch.cuda.set_device(self.device)  # the current device is per thread

    def reserve(self, pool_bytes: int) -> None:
        if pool_bytes > 0:  # allocated and freed at once: the caching allocator keeps the segment for swap-ins
            torch.empty(pool_bytes, dtype=torch.uint8, device=self.device)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(1, nbytes), dtype=torch.uint8, device=self.device)

    def prepare(self, dev_buf: torch.Tensor) -> None:
        # The buffer is allocated on the compute stream and written on the copy stream: tell the
        # caching allocator, so the block is not handed out again while a copy may still write it.
        dev_buf.record_stream(self.copy_stream)

    def copy_group(self, spans: list[Span], dev_buf: torch.Tensor) -> tuple[Any, Any]:
        with torch.cuda.stream(self.copy_stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            for s in spans:
                dev_buf[s.dev_offset:s.dev_offset + s.nbytes].copy_(s.host_u8, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.copy_stream)
        return start, end

    def _compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)  # the caller's stream: compute runs there

    def order_after_compute(self) -> None:
        """Compute thread, before a job is submitted: the copy stream waits (on the GPU) for the
        compute work queued so far, which may still use the blocks the job's buffer came from."""
        self.copy_stream.wait_stream(self._compute_stream())

    def wait_copied(self, marks: tuple[Any, Any]) -> None:
        self._compute_stream().wait_event(marks[1])

    def block_until_copied(self, marks: tuple[Any, Any]) -> None:
        """Block the CPU until the copies up to ``marks`` have finished (the sequential baseline)."""
        marks[1].synchronize()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._compute_stream())
        return event

    def elapsed_s(self, begin: Any, end: Any) -> float:
        return begin.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        self._compute_stream().synchronize()

    def synchronize_device(self) -> None:
        """Wait for every stream of the device; raises the device's error if its context is dead."""
        torch.cuda.synchronize(self.device)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """An input on the device, copied on the copy stream ahead of the weights, which compute then
        waits for (not on the compute stream: why, in docs/internals.md)."""
        if tensor.device == self.device:
            return tensor
        compute = self._compute_stream()
        with torch.cuda.stream(self.copy_stream):
            out = tensor.to(self.device, non_blocking=True)  # a pageable source is staged before this returns
        compute.wait_stream(self.copy_stream)
        out.record_stream(compute)  # allocated on the copy stream, used (and freed) on compute
        return out

    def adopt_host(self, owner: str, module: torch.nn.Module) -> int:
        """Make ``module``'s host memory safe to page-lock in place; bytes moved: storages not in a file
        mapping move to pages of their own (:func:`ctxpool.hostmem.move_to_private_pages`)."""
        region = hostmem.move_to_private_pages(module, hostmem.file_backed_mappings())
        if region is None:
            return 0
        self._private[owner] = region
        log.info("[ctxpool] model=%s moved %d bytes in %d storages to pages of its own for page-locking",
                 owner, region.moved_bytes, region.storages)
        return region.moved_bytes

    def pin(self, owner: str, layout: Any) -> int:
        """Page-lock ``layout``'s host memory (a :class:`ctxpool.layout.Layout`) in place, only on pages that
        hold nothing but model bytes (:meth:`adopt_host`; why: docs/internals.md); bytes newly locked."""
        exclusive = hostmem.file_backed_mappings()
        exclusive = hostmem.merge_ranges(exclusive + [(r.start, r.end) for r in self._private.values()])
        ranges, shared = [], 0
        for start, end in layout.host_ranges():
            if hostmem.inside(exclusive, *hostmem.page_span(start, end)):
                ranges.append((start, end))
            else:
                shared += end - start
        if shared:
            log.warning("[ctxpool] model=%s: %d bytes share pages with other memory and are not page-locked "
                        "(their copies are staged, slower)", owner, shared)
        return self.pins.pin(owner, ranges)

    def unpin(self, owner: str) -> int:
        """Unregister ``owner``'s host memory once the copy stream is idle (a copy may still read it)."""
        try:
            self.copy_stream.synchronize()
        except RuntimeError as exc:  # a dead context: no copy runs any more, unregistering is all that is left
            log.warning("[ctxpool] copy stream failed to synchronise before unpinning %s: %s", owner, exc)
        self._private.pop(owner, None)
        return self.pins.unpin(owner)

    def release_cached(self, keep_bytes: int) -> int:
        """Give the blocks the caching allocator holds unused back to the device (for the other worker and
        the sessions) when they exceed ``keep_bytes``, the warm-up pool, topped up after; bytes released."""
        reserved = self._reserved_bytes()
        if reserved - self._allocated_bytes() <= keep_bytes:
            return 0  # what is cached unused is no more than the pool: keep it for the next swap-in
        self._empty_cache()
        after = self._reserved_bytes()
        if after < keep_bytes:
            self.reserve(keep_bytes - after)
        return max(0, reserved - self._reserved_bytes())

    def _reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def _allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def _empty_cache(self) -> None:
        torch.cuda.empty_cache()  # the current device's: set for this thread in __init__

    def warm_up_compute(self) -> None:
        a = torch.randn(1024, 1024, device=self.device)
        (a @ a).sum().item()
        x = torch.randn(8, 64, 56, 56, device=self.device)
        torch.nn.functional.conv2d(x, torch.randn(64, 64, 3, 3, device=self.device), padding=1).sum().item()
        torch.cuda.synchronize(self.device)

    def measure_bytes_per_s(self) -> float:
        src = torch.ones(_PROBE_BYTES, dtype=torch.uint8).pin_memory()
        dst = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=self.device)
        rates = []
        for _ in range(_PROBE_REPEATS):
            start, end = self.copy_group([Span(src.data_ptr(), _PROBE_BYTES, 0, src)], dst)
            end.synchronize()
            rates.append(_PROBE_BYTES / max(self.elapsed_s(start, end), 1e-9))
        return max(rates)


Backend = CpuBackend | CudaBackend


class CopyJob:
    """One swap-in's copies, group by group, and the events compute waits on."""

    def __init__(self, backend: Backend, groups: list[list[Span]], dev_buf: torch.Tensor,
                 attach: Callable[[int], None], label: str) -> None:
        self.backend = backend
        self.groups = groups
        self.dev_buf = dev_buf
        self.attach = attach
        self.label = label
        self.ready = [threading.Event() for _ in groups]
        self.marks: list[Any] = [None] * len(groups)
        self.error: BaseException | None = None
        self.failed_group = len(groups)
        self.done = threading.Event()

    def run(self) -> None:
        """Copy thread: issue each group, attach it, then signal it."""
        try:
            for k, spans in enumerate(self.groups):
                try:
                    self.marks[k] = self.backend.copy_group(spans, self.dev_buf)
                    self.attach(k)
                except BaseException as exc:  # handed to the compute thread by wait()
                    self.error, self.failed_group = exc, k
                    log.warning("[ctxpool] copy of %s group %d failed: %s: %s", self.label, k,
                                type(exc).__name__, exc)
                    for event in self.ready[k:]:
                        event.set()
                    return
                self.ready[k].set()
        finally:
            self.done.set()

    def wait(self, k: int) -> None:
        """Compute thread: return once group ``k`` may be used by compute; CopyError if its copy failed."""
        self.ready[k].wait()
        if k >= self.failed_group:
            raise CopyError(f"copying {self.label} to {self.backend.device} failed in group {k} of "
                            f"{len(self.groups)}: {type(self.error).__name__}: {self.error}") from self.error
        self.backend.wait_copied(self.marks[k])

    def join(self) -> None:
        self.done.wait()

    def transfer_s(self) -> float:
        """Seconds the copy stream/thread spent copying (after the job is done and synchronised)."""
        return sum(self.backend.elapsed_s(*m) for m in self.marks if m is not None)


class CopyWorker:
    """The engine's copy thread: runs one :class:`CopyJob` at a time, in submission order."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._init_error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ctxpool-copy-{backend.kind}", daemon=True)
        self._thread.start()
        self._started.wait()  # so that a thread that failed to start is dead before the first submit

    def submit(self, job: CopyJob) -> None:
        if self._init_error is not None or not self._thread.is_alive():
            why = (f"it failed to start: {type(self._init_error).__name__}: {self._init_error}"
                   if self._init_error else "engine closed?")
            raise RuntimeError(f"the engine's copy thread is not running ({why})")
        self._jobs.put(job)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        try:
            self._backend.thread_init()
        except BaseException as exc:  # reported by submit()
            self._init_error = exc
            log.error("[ctxpool] copy thread failed to start: %s: %s", type(exc).__name__, exc)
            return
        finally:
            self._started.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.run()
            del job  # holds views of the host memory: an idle thread must not keep a removed model's alive
