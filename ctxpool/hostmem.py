"""Host memory the copy path depends on: the cpu backend's "device" pool (:class:`HostArena`)
and cuda page-locking in place (:class:`PinRegistry`, :func:`move_to_private_pages`).
Why pages must hold nothing but the model: docs/internals.md.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("ctxpool.hostmem")

ALIGN_BYTES = 512  # block offsets, and where every atom starts on the device (ctxpool.layout)


def align_up(value: int, alignment: int = ALIGN_BYTES) -> int:
    return (value + alignment - 1) // alignment * alignment


class HostArena:
    """A pre-faulted pool of host memory handing out uint8 tensors (thread-safe)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes} bytes")
        self.nbytes = align_up(nbytes, mmap.PAGESIZE)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)  # fewer TLB misses; harmless where THP is off
        base = torch.frombuffer(self._map, dtype=torch.uint8)
        base.fill_(0)  # fault every page in now, not during a swap-in
        self.base_address = base.data_ptr()
        del base
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted, merged
        self.in_use_bytes = 0

    def alloc(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of ``nbytes`` (512-byte aligned offset), or None when no free run fits."""
        size = align_up(max(1, nbytes))
        with self._lock:
            for i, (off, run) in enumerate(self._free):
                if run >= size:
                    if run == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, run - size)
                    self.in_use_bytes += size
                    break
            else:
                return None
        view = memoryview(self._map)[off:off + size]
        tensor = torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
        # The tensor's storage holds ``view``; when the storage dies, so does ``view``.
        weakref.finalize(view, self._release, off, size)
        return tensor

    def _release(self, off: int, size: int) -> None:
        with self._lock:
            self.in_use_bytes -= size
            i = bisect.bisect_left(self._free, (off, 0))
            self._free.insert(i, (off, size))
            # Merge with the right, then the left neighbour.
            if i + 1 < len(self._free) and off + size == self._free[i + 1][0]:
                size += self._free.pop(i + 1)[1]
                self._free[i] = (off, size)
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                prev_off, prev_size = self._free.pop(i - 1)
                self._free[i - 1] = (prev_off, prev_size + size)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)


# ------------------------------------------------------------------ page locking


_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


def _cuda_rc(rc) -> int:
    try:
        return int(rc)
    except TypeError:
        return int(rc.value)


def _cuda_error_string(cudart, rc: int) -> str:
    try:
        return cudart.cudaGetErrorString(cudart.cudaError(rc))
    except (TypeError, ValueError):
        return "no description"


def loaded_library(prefix: str, sonames: tuple[str, ...] = ()):
    """A ctypes handle on a shared library this process has ALREADY loaded, or None: ``sonames``, then
    the mapped files named ``prefix``..., each tried with ``RTLD_NOLOAD``, so that none is ever loaded."""
    mapped = [path for _, _, path in _mapped_files() if os.path.basename(path).startswith(prefix)]
    for name in dict.fromkeys([*sonames, *mapped]):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
    return None


def _torch_cudart():
    """The libcudart torch uses (its per-thread last error is the one torch's checks read)."""
    major = (torch.version.cuda or "").partition(".")[0]
    return loaded_library("libcudart.so", (f"libcudart.so.{major}",) if major else ())


_cudart_lib = None


def _clear_cuda_last_error() -> None:
    """A failed runtime call leaves its error as the thread's "last error", which
    torch's next kernel-launch check would raise; take it back off, through torch's
    own libcudart (best effort: a torch that links cudart statically exports none)."""
    global _cudart_lib
    if _cudart_lib is None:
        _cudart_lib = _torch_cudart()
    if _cudart_lib is None:
        log.warning("[ctxpool] no loaded libcudart found: the CUDA last-error of a failed cudaHostRegister "
                    "stays set, and torch may report it at its next kernel launch")
        return
    _cudart_lib.cudaGetLastError()


@dataclass
class _PinnedRange:
    start: int
    end: int
    owners: set[str] = field(default_factory=set)


class PinRegistry:
    """Page-locked host ranges, each registered once and owned by the models that use it."""

    def __init__(self, cudart=None, clear_error: Callable[[], None] | None = None) -> None:
        self._cudart = cudart  # torch.cuda.cudart() unless given (tests pass a fake)
        self._clear_error = clear_error or _clear_cuda_last_error  # through the same libcudart as cudart's calls
        self._ranges: list[_PinnedRange] = []  # sorted by start, disjoint

    def _rt(self):
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def pin(self, owner: str, ranges: list[tuple[int, int]]) -> int:
        """Page-lock [start, end) byte ranges for ``owner``; returns the bytes newly locked.

        On failure nothing stays locked for ``owner`` and RuntimeError names the CUDA error."""
        cudart = self._rt()
        wanted = merge_ranges([page_span(s, e) for s, e in ranges if e > s])
        newly = 0
        try:
            for start, end in wanted:
                for gap_start, gap_end in self._gaps(start, end):
                    rc = _cuda_rc(cudart.cudaHostRegister(gap_start, gap_end - gap_start, 0))
                    if rc != 0:
                        self._clear_error()
                        raise RuntimeError(
                            f"cudaHostRegister of {gap_end - gap_start} bytes at {gap_start:#x} failed with "
                            f"CUDA error {rc} ({_cuda_error_string(cudart, rc)}); "
                            + ("the memory is already page-locked by someone else (another engine "
                               "in this process?)" if rc == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
                               else "is the host memory still mapped?"))
                    bisect.insort(self._ranges, _PinnedRange(gap_start, gap_end), key=lambda r: r.start)
                    newly += gap_end - gap_start
                for r in self._ranges:
                    if r.start < end and start < r.end:
                        r.owners.add(owner)
        except BaseException:
            self.unpin(owner)
            raise
        return newly

    def unpin(self, owner: str) -> int:
        """Drop ``owner`` from every range; unlock ranges nobody owns. Returns bytes unlocked."""
        freed = 0
        keep: list[_PinnedRange] = []
        for r in self._ranges:
            r.owners.discard(owner)
            if r.owners:
                keep.append(r)
                continue
            rc = _cuda_rc(self._rt().cudaHostUnregister(r.start))
            if rc != 0:
                self._clear_error()
                log.warning("[ctxpool] cudaHostUnregister at %#x failed with CUDA error %d", r.start, rc)
            freed += r.end - r.start
        self._ranges = keep
        return freed

    def pinned_bytes(self) -> int:
        return sum(r.end - r.start for r in self._ranges)

    def _gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) that no registered range covers."""
        gaps, cursor = [], start
        for r in self._ranges:
            if r.end <= cursor or r.start >= end:
                continue
            if r.start > cursor:
                gaps.append((cursor, r.start))
            cursor = max(cursor, r.end)
        if cursor < end:
            gaps.append((cursor, end))
        return gaps


# ------------------------------------------------------------------ pages that hold only a model


@dataclass(frozen=True)
class PrivatePages:
    """One anonymous mapping that :func:`move_to_private_pages` filled: [start, end), whole pages."""

    start: int
    end: int
    moved_bytes: int
    storages: int


def file_backed_mappings(maps_path: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """[start, end) of every mapping of a file in this process (pages no allocator writes into), sorted
    and merged; empty when the map cannot be read (then everything is moved: slower, never wrong)."""
    return merge_ranges([(start, end) for start, end, _ in _mapped_files(maps_path)])


def _mapped_files(maps_path: str = "/proc/self/maps") -> list[tuple[int, int, str]]:
    """(start, end, path) of every mapping of a file in this process; empty when the map cannot be read
    (gVisor and others may lack it)."""
    out = []
    try:
        with open(maps_path) as maps:
            for line in maps:
                fields = line.rstrip("\n").split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/"):  # not anonymous, [heap], [stack], [vdso], ...
                    lo, _, hi = fields[0].partition("-")
                    out.append((int(lo, 16), int(hi, 16), fields[5]))
    except (OSError, ValueError):
        return []
    return out


def inside(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) lies wholly inside one of ``ranges`` (sorted, merged)."""
    i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= start and end <= ranges[i][1]


def page_span(start: int, end: int) -> tuple[int, int]:
    page = mmap.PAGESIZE
    return start // page * page, align_up(end, page)


def move_to_private_pages(module: torch.nn.Module, keep: list[tuple[int, int]]) -> PrivatePages | None:
    """Move every parameter and buffer storage of ``module`` whose pages do not lie wholly inside ``keep``
    (sorted, merged) into one new anonymous mapping, each tensor keeping its identity, offset, shape and
    strides, and tensors that shared a storage sharing the new one. None when nothing had to move."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for t in table.values():
                if t is None or t.device.type != "cpu":
                    continue
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0 or inside(keep, *page_span(ptr, ptr + nbytes)):
                    continue
                storages[ptr] = storage
                by_storage.setdefault(ptr, []).append(t)
    if not storages:
        return None
    offsets: dict[int, int] = {}
    cursor = 0
    for ptr in sorted(storages):  # the old order: neighbours stay neighbours, atoms stay mergeable
        offsets[ptr] = cursor
        cursor = align_up(cursor + storages[ptr].nbytes())
    mapping = mmap.mmap(-1, align_up(cursor, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    moved = 0
    with torch.no_grad():
        for ptr, storage in storages.items():
            fresh = torch.frombuffer(mapping, dtype=torch.uint8, count=storage.nbytes(),
                                     offset=offsets[ptr]).untyped_storage()
            fresh.copy_(storage)
            for t in by_storage[ptr]:
                t.set_(fresh, t.storage_offset(), t.size(), t.stride())
            moved += storage.nbytes()
    del storages, by_storage
    return PrivatePages(base, base + len(mapping), moved, len(offsets))


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping and touching ranges joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
