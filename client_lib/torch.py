"""Park a training job's state in host memory and bring it back in place (:class:`Yielder`).

A park copies every registered parameter, gradient, buffer and optimizer tensor into one host
buffer (:class:`HostBuffer`) and frees the device memory; an unpark copies it back into the same
storages, so every reference stays valid. On CUDA the state can keep its device addresses
(:mod:`client_lib.vmm`) and the restore is checksummed. How, and what a park frees: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import mmap
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Union

import torch

from client_lib.nccl import Communicators
from client_lib.pacer import Pacer  # noqa: F401  (co-run pacing: client_lib.torch is where users look)
from client_lib.vmm import VERIFY_BLOCK_BYTES, DriverError, Region, VmmBackend, block_sums, default_backend, round_up

log = logging.getLogger("client_lib.torch")

_ALIGN_BYTES = 512  # each storage's slice of the host buffer starts aligned (DMA-friendly)
_PAGE_BYTES = mmap.PAGESIZE

StateSource = Union[torch.Tensor, torch.nn.Module, torch.optim.Optimizer, Callable[[], Any]]


class ParkError(RuntimeError):
    """Parking or unparking was refused; the state is as it was before the call."""


class AlreadyParkedError(ParkError):
    """:meth:`Yielder.park` while the state is already parked."""


class NotParkedError(ParkError):
    """:meth:`Yielder.unpark` with nothing parked."""


class KeepAddressesError(ParkError):
    """``keep_addresses=True``, and the addresses cannot be kept (no CUDA, no VMM, a region refused)."""


class RestoreVerifyError(RuntimeError):
    """:meth:`Yielder.unpark` restored bytes that differ from those parked. The state is unparked,
    with the difference: do not train on; restore from a checkpoint."""


@dataclass
class _ParkedStorage:
    storage: torch.UntypedStorage
    device: torch.device
    nbytes: int  # bytes parked: the storage's, or a region's span
    offset: int = 0  # into the host buffer
    kind: str = "resize"  # "resize": freed and grown back; "region": unmapped, remapped; "adopt": into a new region
    region: Region | None = None
    grad: bool = True  # only gradients use it (they get regions of their own)
    name: str = ""  # of its first tensor, for messages


@dataclass
class _ParkedTensor:
    tensor: torch.Tensor
    name: str
    storage_index: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class HostBuffer:
    """The host memory parked state lives in: one buffer of exactly the size asked (whole pages),
    page-locked with ``cudaHostRegister`` when pinned, not taken from torch's pinned cache (see
    docs/internals.md). ``cudart`` and ``clear_error`` (``torch.cuda.cudart()``, :func:`_clear_cuda_error`)
    are injectable for tests."""

    def __init__(self, cudart: Any = None, clear_error: Callable[[], bool] | None = None) -> None:
        self._cudart = cudart
        self._clear_error = clear_error if clear_error is not None else _clear_cuda_error
        self._view: torch.Tensor | None = None
        self._pinned = False
        self._pin_failed = False  # this buffer could not be pinned: not tried again until it grows
        self._finalizer: weakref.finalize | None = None

    @property
    def tensor(self) -> torch.Tensor | None:
        """The buffer (uint8, exactly the size last asked for), or None before the first allocation."""
        return self._view

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def nbytes(self) -> int:
        return 0 if self._view is None else self._view.numel()

    def ensure(self, nbytes: int, pin: bool, prefault: bool = False) -> torch.Tensor:
        """The buffer, reallocated (exact size) if smaller than ``nbytes`` or not pinned as asked. A pinning
        that fails (``ulimit -l``) leaves a pageable buffer, with a warning: parking works, its copies are
        synchronous. ``prefault``: touch every page of a pageable buffer now (pinning does that anyway)."""
        if self._view is not None and self._view.numel() >= nbytes and (self._pinned or self._pin_failed or not pin):
            return self._view
        self.release()  # the old one goes first: never both at once
        size = round_up(nbytes, _PAGE_BYTES)
        # A mapping of its own: whole pages that hold nothing else (a registered page shared with
        # another tensor would make that tensor's copies fail), and a storage that starts where the
        # registration does (torch's is_pinned() asks about a tensor's storage, not its data).
        raw = (torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
               if size else torch.empty(0, dtype=torch.uint8))
        ptr = raw.data_ptr()
        if pin and size > 0:  # (release() left _pinned False)
            cudart = self._cudart if self._cudart is not None else torch.cuda.cudart()
            rc = cudart.cudaHostRegister(ptr, size, 0)
            if int(rc) == 0:
                self._pinned = True
                self._finalizer = weakref.finalize(self, _unregister, cudart, ptr, raw)
            else:
                self._clear_error()  # or torch's next kernel launch check would report it
                log.warning("[park] page-locking a host buffer of %d bytes failed (%s); parking with pageable "
                            "memory instead (slower copies): raise the locked-memory limit (ulimit -l)",
                            size, _error_string(cudart, rc))
        if not self._pinned and prefault:
            raw.zero_()  # fault the pages in now, not inside a suspend deadline
        self._view = raw[:nbytes]
        self._pin_failed = pin and not self._pinned
        log.debug("[park] host buffer bytes=%d pinned=%s", nbytes, self._pinned)
        return self._view

    def release(self) -> None:
        """Unregister (if pinned) and free the buffer."""
        if self._finalizer is not None:
            self._finalizer()  # unregisters while the memory is still ours
            self._finalizer = None
        self._view = None
        self._pinned = self._pin_failed = False


class Yielder:
    """Parks ``modules``' parameters, gradients and buffers, ``optimizers``' state, and whatever
    :meth:`register_state` adds, in host memory; with a ``client``, as its suspend handlers, which
    ``client.yield_point()`` runs when the daemon asks (see docs/internals.md).

    ``pin_memory``: pin the host buffer (default: when a parked tensor is on CUDA), reserved at once
    and again after each optimizer's first step. ``keep_addresses``: ``"auto"`` (where the state is
    on CUDA and the driver's virtual memory calls work), ``True`` (a :class:`ParkError` where they
    do not) or ``False``; :attr:`keeps_addresses` says which, :attr:`address_note` why not. ``verify``
    (default: when keeping addresses): check the restored state against checksums taken at the park.
    ``vmm``: the backend regions are made with (default CUDA's). ``process_groups``: suspend the NCCL
    communicators of this process's groups with the state (default True; :attr:`nccl_note` says why
    where they cannot), False to leave them, or a callable giving the groups."""

    def __init__(self, client=None, modules: Iterable[torch.nn.Module] = (),
                 optimizers: Iterable[torch.optim.Optimizer] = (), *,
                 device: torch.device | str | None = None, pin_memory: bool | None = None,
                 host_buffer: HostBuffer | None = None, keep_addresses: bool | str = "auto",
                 verify: bool | None = None, vmm: VmmBackend | None = None,
                 process_groups: bool | Callable[[], list] = True) -> None:
        if keep_addresses not in (True, False, "auto"):
            raise ValueError(f"keep_addresses is True, False or 'auto', not {keep_addresses!r}")
        self._modules = list(modules)
        self._optimizers = list(optimizers)
        self._extra: list[StateSource] = []
        self._device = torch.device(device) if device is not None else None
        self._pin_memory = pin_memory
        self._host = host_buffer if host_buffer is not None else HostBuffer()
        self._keep_addresses = keep_addresses
        self._keep: bool | None = False if keep_addresses is False else None  # None: decided at the first state
        self.address_note: str | None = "keep_addresses=False" if keep_addresses is False else None
        self._vmm = vmm
        self._verify = verify
        # NCCL's communicators, suspended with the state where torch and NCCL can (client_lib.nccl).
        self._comms = (None if process_groups is False else
                       Communicators() if process_groups is True else Communicators(process_groups))
        self._storages: list[_ParkedStorage] = []
        self._tensors: list[_ParkedTensor] = []
        self._sums: list[torch.Tensor] | None = None  # checksums of the parked bytes, per storage
        self._adoption_error: Exception | None = None
        self._parked = False
        self._warned_left = 0
        self.bytes_parked = 0  # of the last park: device memory it released
        self.bytes_copied = 0  # of the last park: the state's bytes moved to the host
        self.bytes_left_on_device = 0  # of the last plan: state in CUDA graphs' pools, never parked
        self.checksum_ms = 0.0  # of the last park: taking the checksums (0 without verify)
        self.verify_ms = 0.0  # of the last unpark: checking the restored bytes against them
        self.client = client
        self._first_step_hooks: list = []
        try:
            storages, _ = self._plan()
        except ParkError as exc:  # raised again, with the same words, by park()
            log.warning("[park] this state cannot be parked: %s", exc)
        else:
            if self._keeping(storages):
                self._adopt()  # before any graph is captured: from here on the state's addresses stay
            elif self._pin_for(storages):
                # Pinning takes seconds for tens of GB: now, not inside a suspend deadline.
                self._reserve(storages, prefault=True)
            if self._keep or self._pin_for(storages):
                self._first_step_hooks = [opt.register_step_post_hook(self._after_first_step)
                                          for opt in self._optimizers]
        if client is not None:
            client.set_suspend_handlers(self.park, self.unpark, held=lambda: (self._host.nbytes, self._host.pinned))

    # ------------------------------------------------------------------ api

    def register_state(self, state: StateSource) -> None:
        """Park more state: a tensor, a module, an optimizer, or a callable with no arguments returning
        tensors (alone or in nested dicts, lists and tuples), called at every park so that state made
        later is found. The tensors must be the live ones, not copies (``state_dict()`` of most objects
        returns copies); when keeping addresses, call :meth:`reserve` afterwards (before capturing graphs)."""
        if not isinstance(state, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)) and not callable(state):
            raise TypeError("register_state takes a tensor, a module, an optimizer or a callable returning "
                            f"tensors, got {type(state).__name__}")
        self._extra.append(state)

    @property
    def parked(self) -> bool:
        return self._parked

    @property
    def keeps_addresses(self) -> bool:
        """Whether parks keep the state's device addresses (decided once the state is seen)."""
        return bool(self._keep)

    @property
    def host_buffer(self) -> torch.Tensor | None:
        """The host buffer (uint8) the state is parked in; None before it is first needed."""
        return self._host.tensor

    def park(self) -> int:
        """Copy the state into host memory and free it on the device; returns the device bytes released
        (:attr:`bytes_parked`). Nothing is changed when it raises (:class:`AlreadyParkedError`, a
        :class:`ParkError` for a tensor that cannot be parked, out of host memory), except for a
        :class:`client_lib.vmm.DriverError` from unmapping a region: parked, that region still mapped."""
        if self._parked:
            raise AlreadyParkedError("the state is already parked; call unpark() first")
        storages, tensors = self._plan_now()
        if _needed(storages) > self._host.nbytes and self._host.tensor is not None:
            log.warning("[park] the state grew to %d bytes since the host buffer was reserved (%d): growing it "
                        "inside the suspend; call Yielder.reserve() after creating new state", _needed(storages),
                        self._host.nbytes)
        released = self._park_planned(storages, tensors)  # (a DriverError from it leaves the communicators)
        if self._comms is not None and storages:
            devices = sorted({s.device for s in storages}, key=lambda d: (d.type != "cuda", str(d)))
            if self._comms.suspend(devices[0]):  # the device is idle: the park synchronized it
                released += self._comms.released_bytes
                self.bytes_parked = released
        return released

    @property
    def nccl_suspended(self) -> int:
        """NCCL communicators suspended by the last park (0: none, or none could be)."""
        return self._comms.suspended if self._comms is not None else 0

    @property
    def nccl_note(self) -> str | None:
        """Why NCCL's communicators keep their buffers through a park here (None: they do not, or none)."""
        return self._comms.note if self._comms is not None else None

    def unpark(self) -> None:
        """Copy the parked state back, into the same storages or at the same addresses. Out of device
        memory, it stays parked (call it again later); a :class:`RestoreVerifyError` comes after the
        state is back in place."""
        if not self._parked:
            raise NotParkedError("nothing is parked: unpark() needs a park() first")
        storages, tensors = self._storages, self._tensors
        if any(s.kind != "resize" for s in storages):
            self._backend().drain()
        fresh = self._new_regions(storages)  # storage index -> (region tensor, offset in it)
        remapped: list[_ParkedStorage] = []
        grown: list[_ParkedStorage] = []
        try:
            for i, s in enumerate(storages):
                if s.kind == "region":
                    s.region.remap()
                    remapped.append(s)
                elif i not in fresh:
                    s.storage.resize_(s.nbytes)
                    grown.append(s)
        except RuntimeError:  # out of device memory, typically: stay parked, try again later
            for s in remapped:
                s.region.unmap()
            for s in grown:
                s.storage.resize_(0)
            fresh.clear()  # their regions go with their tensors
            for device_type in {s.device.type for s in grown}:
                _release_cached(device_type, workspaces=not self._keep)
            raise
        host = self._host.tensor
        targets = [fresh[i][0][fresh[i][1]:fresh[i][1] + s.nbytes] if i in fresh
                   else _bytes_of(s.storage, s.device)[:s.nbytes] for i, s in enumerate(storages)]
        for s, target in zip(storages, targets):
            target.copy_(host[s.offset:s.offset + s.nbytes], non_blocking=self._host.pinned)
        mismatch = None
        if self._sums is not None:
            t0 = time.perf_counter()
            mismatch = _first_mismatch(storages, self._sums, _checksums(targets))  # waits for the copies
            self.verify_ms = (time.perf_counter() - t0) * 1000.0
        for t in tensors:
            s = storages[t.storage_index]
            storage, offset = s.storage, t.storage_offset
            if t.storage_index in fresh:
                region_tensor, start = fresh[t.storage_index]
                storage, offset = region_tensor.untyped_storage(), start // t.tensor.element_size() + offset
            view = torch.empty(0, dtype=t.tensor.dtype, device=s.device)
            t.tensor.data = view.set_(storage, offset, t.size, t.stride)
        for device in sorted({s.device for s in storages}, key=str):
            _synchronize(device)  # the host buffer may be reused (next park) only once read
        log.debug("[unpark] storages=%d bytes=%d regions_remapped=%d regions_new=%d verify_ms=%.2f", len(storages),
                  self.bytes_copied, len(remapped), len({id(v[0]) for v in fresh.values()}), self.verify_ms)
        self._storages, self._tensors, self._sums = [], [], None
        self._parked = False
        resume_error = None
        if self._comms is not None and self._comms.suspended:
            try:
                self._comms.resume()
            except Exception as exc:  # after the state is back: raised below
                resume_error = exc
        if mismatch is not None:
            raise RestoreVerifyError(mismatch)
        if resume_error is not None:
            raise resume_error

    def reserve(self) -> int:
        """Allocate (and pin, on CUDA) the host buffer for the current state now, not in the next suspend;
        when keeping addresses, first move state made since into a region (its addresses change now,
        not at the next park). Returns the host buffer's bytes."""
        if self._parked:
            return self._host.nbytes  # the parked state's buffer is in use and already fits
        storages, _ = self._plan_now()
        if self._keep:
            self._adopt()
            return self._host.nbytes
        return self._reserve(storages, prefault=True).numel()

    # ------------------------------------------------------------- internals

    def _backend(self) -> VmmBackend:
        return self._vmm if self._vmm is not None else default_backend()

    def _verifying(self) -> bool:
        return self._verify if self._verify is not None else bool(self._keep)

    def _keeping(self, storages: list[_ParkedStorage]) -> bool:
        """Whether to keep addresses, decided (once) from where the state is."""
        if self._keep is None and storages:
            vmm = self._backend()
            reasons = [vmm.unavailable_reason(d) for d in sorted({s.device for s in storages}, key=str)]
            reason = next((r for r in reasons if r), None)
            if reason is None:
                self._keep, self.address_note = True, None
            elif self._keep_addresses is True:
                raise KeepAddressesError(f"keep_addresses=True, but {reason}")
            else:
                self._keep, self.address_note = False, reason
                log.info("[park] parking without keeping addresses: %s", reason)
        return bool(self._keep)

    def _plan_now(self) -> tuple[list[_ParkedStorage], list[_ParkedTensor]]:
        if self._keep is None:
            storages, tensors = self._plan()
            if not self._keeping(storages):
                return storages, tensors
        return self._plan(keep=bool(self._keep))

    def _pin_for(self, storages: list[_ParkedStorage]) -> bool:
        if self._pin_memory is not None:
            return self._pin_memory
        # Asked in this order so that a state without CUDA tensors never initialises CUDA.
        return any(s.device.type == "cuda" for s in storages) and torch.cuda.is_available()

    def _reserve(self, storages: list[_ParkedStorage], prefault: bool = False) -> torch.Tensor:
        return self._host.ensure(_needed(storages), self._pin_for(storages), prefault=prefault)

    def _adopt(self) -> None:
        """Move the state that is in no region yet into new ones (through the host buffer, so the
        device never holds it twice), then size the host buffer for all of it."""
        storages, tensors = self._plan(keep=True)
        if any(s.kind == "adopt" for s in storages) and not _capturing(storages):
            # Sized (and pinned) once, for all of the state: each new region adds at most a block's rounding.
            new_regions = len({(s.device, s.grad) for s in storages if s.kind == "adopt"})
            self._host.ensure(_needed(storages) + new_regions * VERIFY_BLOCK_BYTES, self._pin_for(storages),
                              prefault=True)
            stats = self.bytes_parked, self.bytes_copied, self.checksum_ms, self.verify_ms
            adopt, adopt_tensors = _subset(storages, tensors, "adopt")
            self._adoption_error = None
            self._park_planned(adopt, adopt_tensors)
            self.unpark()  # into new regions (in place, with a warning, if they cannot be made)
            self.bytes_parked, self.bytes_copied, self.checksum_ms, self.verify_ms = stats
            if self._keep_addresses is True and self._adoption_error is not None:
                raise KeepAddressesError(f"keep_addresses=True, but {self.address_note}") from self._adoption_error
            storages, _ = self._plan(keep=bool(self._keep))
        self._reserve(storages, prefault=True)

    def _park_planned(self, storages: list[_ParkedStorage], tensors: list[_ParkedTensor]) -> int:
        devices = sorted({s.device for s in storages}, key=str)
        if _capturing(storages):
            raise ParkError("cannot park while a CUDA graph is being captured on this thread's stream")
        for device in devices:
            _synchronize(device)  # the last step's kernels write what we are about to copy
        if any(s.kind != "resize" for s in storages):
            self._backend().drain()
        host = self._reserve(storages)
        reserved_before = {d: _reserved_bytes(d) for d in devices}
        sources = [_bytes_of(s.storage, s.device)[:s.nbytes] for s in storages]
        sums = None
        if self._verifying():
            t0 = time.perf_counter()
            sums = _checksums(sources)
            self.checksum_ms = (time.perf_counter() - t0) * 1000.0
        for s, source in zip(storages, sources):
            host[s.offset:s.offset + s.nbytes].copy_(source, non_blocking=self._host.pinned)
        del sources
        for device in devices:
            _synchronize(device)  # the copies are done before the memory goes
        for t in tensors:
            t.tensor.data = torch.empty(0, dtype=t.tensor.dtype, device=t.tensor.device)
        unmapped, unmap_error = 0, None
        for s in storages:
            if s.kind != "region":
                s.storage.resize_(0)
                continue
            try:
                s.region.unmap()
                unmapped += s.region.nbytes
            except DriverError as exc:  # the state is safe in host memory; this region's memory stays
                unmap_error = unmap_error or exc
        for device_type in {d.type for d in devices}:
            _release_cached(device_type, workspaces=not self._keep)  # captured graphs may use cuBLAS's
        released = unmapped
        for device in devices:
            before = reserved_before[device]
            # Where the allocator cannot say (cpu backend), the freed storages are what was released.
            released += (sum(s.nbytes for s in storages if s.device == device and s.kind != "region")
                         if before is None else max(0, before - (_reserved_bytes(device) or 0)))
        total = sum(s.nbytes for s in storages)
        self._storages, self._tensors, self._sums = storages, tensors, sums
        self._parked = True
        self.bytes_parked, self.bytes_copied = released, total
        log.debug("[park] storages=%d tensors=%d bytes_copied=%d bytes_released=%d regions=%d checksum_ms=%.2f",
                  len(storages), len(tensors), total, released, sum(s.kind == "region" for s in storages),
                  self.checksum_ms if sums is not None else 0.0)
        if unmap_error is not None:
            raise unmap_error
        return released

    def _new_regions(self, storages: list[_ParkedStorage]) -> dict[int, tuple[torch.Tensor, int]]:
        """Regions for the storages being adopted, one per device and kind (gradients apart: they
        come and go with ``zero_grad(set_to_none=True)``, and a region goes when all it holds does)."""
        groups: dict[tuple[torch.device, bool], list[int]] = {}
        for i, s in enumerate(storages):
            if s.kind == "adopt":
                groups.setdefault((s.device, s.grad), []).append(i)
        fresh: dict[int, tuple[torch.Tensor, int]] = {}
        for (device, _), indices in groups.items():
            starts, end = [], 0
            for i in indices:
                start = round_up(end, _ALIGN_BYTES)
                starts.append(start)
                end = start + storages[i].nbytes
            try:
                _, region_tensor = Region.create(self._backend(), device, end)
            except Exception as exc:  # a driver that refuses, torch that will not alias the memory
                if device.type == "cuda":
                    _clear_cuda_error()  # torch's next kernel-launch check would blame it on the kernel
                self._adoption_failed(device, end, exc)
                continue  # restored in place instead
            for i, start in zip(indices, starts):
                fresh[i] = (region_tensor, start)
        return fresh

    def _adoption_failed(self, device: torch.device, nbytes: int, exc: Exception) -> None:
        self._adoption_error = exc
        log.warning("[park] making an address-keeping region of %d bytes on %s failed (%s); that state is "
                    "restored in place, its addresses changed%s", nbytes, device, exc,
                    "" if self._keep_addresses is True else "; parking without keeping addresses from now on")
        self.address_note = f"making a region failed: {exc}"
        if self._keep_addresses is not True:
            self._keep = False

    def _after_first_step(self, optimizer, args, kwargs) -> None:
        """Optimizers create their state (Adam's moments) in their first step: adopt it, grow the buffer."""
        for opt, hook in zip(self._optimizers, self._first_step_hooks):
            if opt is optimizer:
                hook.remove()  # (removing a removed hook does nothing)
        if not self._parked:
            try:
                self.reserve()
            except KeepAddressesError:
                raise
            except ParkError as exc:
                log.debug("[park] after the first step: %s", exc)  # park() says it, when asked to park

    def _sources(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the state with a name for messages, in a stable order (duplicates possible)."""
        names: dict[int, str] = {}
        for i, module in enumerate(self._modules):
            for name, param in module.named_parameters():
                names.setdefault(id(param), f"modules[{i}].{name}")
        for i, module in enumerate(self._modules):
            yield from _module_tensors(module, f"modules[{i}]")
        for i, opt in enumerate(self._optimizers):
            yield from _optimizer_tensors(opt, f"optimizers[{i}]", names)
        for i, state in enumerate(self._extra):
            label = f"register_state[{i}]"
            if isinstance(state, torch.Tensor):
                yield label, state
            elif isinstance(state, torch.nn.Module):
                yield from _module_tensors(state, label)
            elif isinstance(state, torch.optim.Optimizer):
                yield from _optimizer_tensors(state, label, names)
            else:
                yield from _walk(state(), label + "()")

    def _plan(self, keep: bool = False) -> tuple[list[_ParkedStorage], list[_ParkedTensor]]:
        """Which storages to park (each once, however many tensors share it), how, and where each
        goes in the host buffer; refuses before anything changes. ``keep``: state outside a region
        is to be adopted into one at the unpark, and state in a CUDA graph's pool stays."""
        candidates: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for name, t in self._sources():
            if id(t) not in seen and t.device.type != "meta":
                seen.add(id(t))
                candidates.append((name, t))
        if self._device is not None:
            only = self._device  # "cuda" means every CUDA device, "cuda:1" that one
            wanted = lambda d: d.type == only.type and only.index in (None, d.index)  # noqa: E731
        elif any(t.device.type != "cpu" for _, t in candidates):
            wanted = lambda d: d.type != "cpu"  # noqa: E731
        else:
            wanted = lambda d: True  # noqa: E731  (cpu backend: host memory is the device)
        vmm = self._backend()
        pools = _PrivatePools()
        storages: list[_ParkedStorage] = []
        by_key: dict[tuple[str, int], int] = {}
        left: dict[tuple[str, int], tuple[str, int]] = {}
        tensors: list[_ParkedTensor] = []
        for name, t in candidates:
            if not wanted(t.device):
                continue
            described = f"{name} ({type(t).__name__} of shape {tuple(t.shape)} on {t.device})"
            if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
                raise ParkError(f"cannot park {described}: a tensor subclass with its own __torch_dispatch__ "
                                "(DTensor, a wrapper subclass) keeps its data in the tensors it wraps, not in its "
                                "storage; register those plain tensors instead (register_state)")
            if t.layout != torch.strided:
                raise ParkError(f"cannot park {described}: a {t.layout} tensor; only dense ones can be parked")
            try:
                storage = t.untyped_storage()
            except RuntimeError as exc:
                raise ParkError(f"cannot park {described}: its storage cannot be reached ({exc})") from None
            if storage.nbytes() == 0:
                continue
            key = (str(t.device), storage.data_ptr())
            if key in left:
                continue
            index = by_key.get(key)
            if index is None:
                region = vmm.region_at(storage.data_ptr())
                if region is not None and region.device == t.device:
                    item = _ParkedStorage(storage, t.device, region.span_bytes, kind="region", region=region,
                                          name=name)
                else:
                    # Shared host memory would come back private: other processes would stop seeing it.
                    # (is_shared() is always true for CUDA storages, which are not shared that way.)
                    if not storage.resizable() or (t.device.type == "cpu" and storage.is_shared()):
                        raise ParkError(f"cannot park {described}: its storage is not resizable (shared memory, "
                                        "or memory torch does not own)")
                    if keep and pools.holds(t.device, storage.data_ptr()):
                        left[key] = (name, storage.nbytes())  # a CUDA graph's: moving it would break the graph
                        continue
                    item = _ParkedStorage(storage, t.device, storage.nbytes(), name=name)
                index = by_key[key] = len(storages)
                storages.append(item)
            storages[index].grad = storages[index].grad and name.endswith(".grad")
            tensors.append(_ParkedTensor(t, name, index, t.storage_offset(), tuple(t.size()), tuple(t.stride())))
        if keep:
            _mark_adoptable(storages, tensors, vmm)
            self._note_left(left)
        _layout(storages)
        return storages, tensors

    def _note_left(self, left: dict[tuple[str, int], tuple[str, int]]) -> None:
        self.bytes_left_on_device = sum(nbytes for _, nbytes in left.values())
        if left and len(left) != self._warned_left:
            self._warned_left = len(left)
            log.warning("[park] %d bytes of state live in a CUDA graph's memory pool (made during a capture) and "
                        "stay on the device when parked: %s", self.bytes_left_on_device,
                        ", ".join(name for name, _ in list(left.values())[:5]) + (" ..." if len(left) > 5 else ""))


def _module_tensors(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, p in module.named_parameters():
        yield f"{prefix}.{name}", p
        if p.grad is not None:
            yield f"{prefix}.{name}.grad", p.grad
    for name, b in module.named_buffers():
        yield f"{prefix}.{name}", b


def _optimizer_tensors(opt: torch.optim.Optimizer, prefix: str,
                       names: dict[int, str]) -> Iterator[tuple[str, torch.Tensor]]:
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            name = names.get(id(p), f"{prefix}.param_groups[{g}].params[{i}]")
            yield name, p
            if p.grad is not None:
                yield f"{name}.grad", p.grad
            yield from _walk(opt.state.get(p, {}), f"{prefix}.state[{name}]")
        yield from _walk({k: v for k, v in group.items() if k != "params"},
                         f"{prefix}.param_groups[{g}]")  # e.g. a tensor lr


def _walk(obj: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in nested dicts, lists and tuples, with their paths (anything else is skipped)."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, f"{name}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{name}[{i}]")


def _layout(storages: list[_ParkedStorage]) -> None:
    """Each storage's place in the host buffer: one after another, each start aligned."""
    offset = 0
    for s in storages:
        s.offset = offset
        offset = round_up(offset + s.nbytes, _ALIGN_BYTES)


def _subset(storages: list[_ParkedStorage], tensors: list[_ParkedTensor],
            kind: str) -> tuple[list[_ParkedStorage], list[_ParkedTensor]]:
    """The storages of one kind and their tensors, laid out afresh."""
    index: dict[int, int] = {}
    picked: list[_ParkedStorage] = []
    for i, s in enumerate(storages):
        if s.kind == kind:
            index[i] = len(picked)
            picked.append(dataclasses.replace(s))
    _layout(picked)
    return picked, [dataclasses.replace(t, storage_index=index[t.storage_index])
                    for t in tensors if t.storage_index in index]


def _mark_adoptable(storages: list[_ParkedStorage], tensors: list[_ParkedTensor], vmm: VmmBackend) -> None:
    """State outside any region goes into one at the unpark, unless its device has none or something
    else holds its storage (a view we do not know of: moving the storage would strand it on the old
    memory; it is parked in place instead, as without keep_addresses)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # a private API: without it, nothing moves
    known: dict[int, set[int]] = {}
    for t in tensors:
        known.setdefault(t.storage_index, set()).add(id(t.tensor))
    usable: dict[torch.device, bool] = {}
    kept_in_place = []
    for i, s in enumerate(storages):
        if s.kind != "resize":
            continue
        if s.device not in usable:
            usable[s.device] = vmm.unavailable_reason(s.device) is None
        # Held by: our Python storage object (1) and each tensor we know of, if by nothing else.
        if usable[s.device] and use_count is not None and use_count(s.storage._cdata) == 1 + len(known[i]):
            s.kind = "adopt"
        else:
            kept_in_place.append(s.name)
    if kept_in_place:
        log.debug("[park] held elsewhere too, parked in place (addresses not kept): %s", ", ".join(kept_in_place))


class _PrivatePools:
    """Address ranges of torch's private memory pools (CUDA graphs', MemPools'), read when first asked."""

    @functools.cached_property
    def _ranges(self) -> list[tuple[int, int, int]]:
        return [(seg["device"], seg["address"], seg["address"] + seg["total_size"])
                for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0)]

    def holds(self, device: torch.device, ptr: int) -> bool:
        return device.type == "cuda" and any(d == device.index and lo <= ptr < hi for d, lo, hi in self._ranges)


def _capturing(storages: list[_ParkedStorage]) -> bool:
    return (any(s.device.type == "cuda" for s in storages) and torch.cuda.is_initialized()
            and torch.cuda.is_current_stream_capturing())


def _checksums(datas: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`client_lib.vmm.block_sums` of each (flat uint8) tensor, in host memory: one
    transfer per device (which waits for the work queued before)."""
    sums = [block_sums(d) for d in datas]
    out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64)] * len(sums)
    for device in {s.device for s in sums}:
        indices = [i for i, s in enumerate(sums) if s.device == device]
        host = torch.cat([sums[i] for i in indices]).cpu()
        for i, part in zip(indices, host.split([sums[i].numel() for i in indices])):
            out[i] = part
    return out


def _first_mismatch(storages: list[_ParkedStorage], parked: list[torch.Tensor],
                    restored: list[torch.Tensor]) -> str | None:
    """Where the restored state first differs from the parked one, in words; None if nowhere."""
    for s, before, after in zip(storages, parked, restored):
        if not torch.equal(before, after):
            block = int((before != after).nonzero()[0])
            lo, hi = block * VERIFY_BLOCK_BYTES, min((block + 1) * VERIFY_BLOCK_BYTES, s.nbytes)
            return (f"the restored state differs from what was parked: {s.name}'s storage ({s.nbytes} bytes on "
                    f"{s.device}, {'its region' if s.kind == 'region' else s.kind}) at bytes {lo}-{hi} first "
                    f"(block checksum {int(before[block])} parked, {int(after[block])} restored): the host copy or "
                    "the device memory changed while parked; the state is unparked with it")
    return None


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _needed(storages: list[_ParkedStorage]) -> int:
    """Bytes of host buffer the planned storages take."""
    return storages[-1].offset + storages[-1].nbytes if storages else 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            accelerator.synchronize(device)


def _reserved_bytes(device: torch.device) -> int | None:
    """Device memory torch's caching allocator holds on ``device``; None where it cannot say."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else None


def _release_cached(device_type: str, workspaces: bool = True) -> None:
    """Hand what is now free back to the driver: cuBLAS's workspaces (kept by torch) first, unless
    ``workspaces`` is false (a captured CUDA graph may use them), then every cached block left empty."""
    if device_type == "cuda":
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if workspaces and clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
    elif device_type == "mps":
        torch.mps.empty_cache()


def _unregister(cudart: Any, ptr: int, raw: torch.Tensor) -> None:
    """Undo a buffer's cudaHostRegister; ``raw`` is kept alive (by the finaliser) until then."""
    rc = cudart.cudaHostUnregister(ptr)
    if int(rc) != 0:
        _clear_cuda_error()
        log.warning("[park] unregistering the host buffer failed (%s)", _error_string(cudart, rc))


def _error_string(cudart: Any, rc: Any) -> str:
    try:
        return str(cudart.cudaGetErrorString(rc))
    except Exception:
        return f"CUDA error {int(rc)}"


def _clear_cuda_error() -> bool:
    """Reset the CUDA runtime's last error after a failed call we handled (torch checks it after every
    kernel launch: the next kernel would be blamed); True if done. ``torch.cuda.cudart()`` has no
    ``cudaGetLastError``: it is called in the libcudart torch loaded (``RTLD_NOLOAD``: never a second one)."""
    path = _mapped_library("libcudart.so")
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1))
        lib.cudaGetLastError()
    except (OSError, AttributeError):
        return False
    return True


def _mapped_library(prefix: str, maps_path: str = "/proc/self/maps") -> str | None:
    """Path of the first file mapped into this process whose name starts with ``prefix``."""
    with contextlib.suppress(OSError), open(maps_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(prefix):
                return fields[5].strip()
    return None
