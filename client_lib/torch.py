"""Park a training job's state in host memory and bring it back, in place.

    client = Client("trainer", workload="training")
    yielder = Yielder(client, modules=[model], optimizers=[opt])
    with client.slice():
        for batch in loader:
            step(batch)
            client.yield_point()   # on a daemon's ``suspend``: park, report, wait, unpark

When the daemon asks for the whole device, :meth:`Yielder.park` copies every
parameter, gradient, buffer and optimizer-state tensor into one host buffer
(:class:`HostBuffer`) and frees the device memory; :meth:`Yielder.unpark`
copies it all back into the same tensors. Both are public and need no daemon
(tests, other schedulers).

The host buffer, on CUDA: exactly the size of the state, page-locked with
``cudaHostRegister``, and reserved when the Yielder is made (and again after
each optimizer's first step, when Adam-like state appears), so that pinning
(seconds for tens of GB) happens outside the suspend deadline. It is not
``torch.empty(n, pin_memory=True)``: torch's pinned cache rounds every request
up to a power of two (17 GB of state would lock 32 GB of host memory) and keeps
the old block when a buffer grows. State that grows later grows the buffer at
the next park (logged: call :meth:`Yielder.reserve` after such changes). On the
cpu backend the buffer is plain memory, allocated at the first park.

What a park frees, and what stays on the device: the parked storages, then
torch's cuBLAS workspaces, then every cached block that is now empty
(``empty_cache``). The CUDA context (0.3-0.6 GB), NCCL's buffers, CUDA graphs
and their memory pools, and blocks of cached segments that other live tensors
(activations, tensors not registered) still use stay. ``bytes_parked`` counts
only what was released: on CUDA the drop of torch's reserved device memory;
``bytes_copied`` is the size of the state moved to the host.

What "in place" means, and why: each tensor's *storage* is emptied with
``untyped_storage().resize_(0)`` and later grown back and refilled, so the
storage object itself survives. Every reference stays valid, the ones we know
(the Parameter objects, ``.grad``, the optimizer's ``state`` tensors) and the
ones we do not (views of the same storage elsewhere: tied weights, flat
parameter buffers, DDP's gradient buckets), and training continues bit for bit.
Swapping ``t.data`` for a new tensor would keep the Python objects but strand
such views on the old memory (never freed, and stale after the resume). While
parked, the tensors we know are also pointed at an empty tensor (``numel() ==
0``), so touching one by mistake gives a shape error rather than reading freed
memory; unpark points them back at their storage with the same offset, size
and stride. Views it does not know of keep their shape over empty memory:
nothing may touch them until the unpark (the training thread is blocked in
``yield_point()`` meanwhile).

Which tensors are parked: those on an accelerator (e.g. ``cuda:0``); anything
already on the CPU there (Adam's ``step`` counters) is host memory and stays.
When every tensor is on the CPU (the ``cpu`` backend) the CPU tensors are
parked, so the same code path runs and can be tested without a GPU. Pass
``device=`` to park only one device's tensors.

Call :meth:`Client.yield_point` where no autograd graph is alive (between
steps): activations and a retained graph are not parked and keep their memory.
Not supported, refused by :meth:`park` with a :class:`ParkError` naming the
tensor before anything changes: tensors in shared memory or wrapping foreign
memory (their storage cannot be resized), sparse tensors, and tensor
subclasses with their own ``__torch_dispatch__`` (DTensor and other wrapper
subclasses: their storage is not where their data lives; register the plain
tensors they wrap instead). CUDA graphs that captured the old addresses are not
supported either (they cannot be detected).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Union

import torch

from client_lib.pacer import Pacer  # noqa: F401  (co-run pacing: client_lib.torch is where users look)

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


@dataclass
class _ParkedStorage:
    storage: torch.UntypedStorage
    device: torch.device
    nbytes: int
    offset: int  # into the host buffer


@dataclass
class _ParkedTensor:
    tensor: torch.Tensor
    name: str
    storage_index: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class HostBuffer:
    """The host memory parked state lives in: one buffer of exactly the size asked
    (page-aligned, whole pages), page-locked with ``cudaHostRegister`` when pinned.

    Pinning registers pageable memory instead of taking it from torch's pinned
    cache, which would round the size up to a power of two and keep the old block
    when the buffer grows; here growing unregisters and frees the old buffer
    first, and the memory goes back to the system when the buffer is released (or
    garbage-collected). ``cudart`` (default ``torch.cuda.cudart()``) and
    ``clear_error`` (default: reset the CUDA runtime's last error through the
    loaded libcudart) are injectable for tests.
    """

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
        """The buffer, reallocated (exact size) if it is smaller than ``nbytes`` or not pinned as asked.

        A pinning that fails (host memory locked out, ``ulimit -l``) leaves a pageable
        buffer, with a warning: parking still works, its copies are synchronous.
        ``prefault``: touch every page of a pageable buffer now (pinning does that anyway)."""
        if self._view is not None and self._view.numel() >= nbytes and (self._pinned or self._pin_failed or not pin):
            return self._view
        self.release()  # the old one goes first: never both at once
        size = _round_up(nbytes, _PAGE_BYTES)
        # A mapping of its own: whole pages that hold nothing else (a registered page shared with
        # another tensor would make that tensor's copies fail), and a storage that starts where the
        # registration does (torch's is_pinned() asks about a tensor's storage, not its data).
        raw = (torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
               if size else torch.empty(0, dtype=torch.uint8))
        ptr = raw.data_ptr()
        pinned = False
        if pin and size > 0:
            cudart = self._cudart if self._cudart is not None else torch.cuda.cudart()
            rc = cudart.cudaHostRegister(ptr, size, 0)
            if int(rc) == 0:
                pinned = True
                self._finalizer = weakref.finalize(self, _unregister, cudart, ptr, raw)
            else:
                self._clear_error()  # or torch's next kernel launch check would report it
                log.warning("[park] page-locking a host buffer of %d bytes failed (%s); parking with pageable "
                            "memory instead (slower copies): raise the locked-memory limit (ulimit -l)",
                            size, _error_string(cudart, rc))
        if not pinned and prefault:
            raw.zero_()  # fault the pages in now, not inside a suspend deadline
        self._view = raw[:nbytes]
        self._pinned = pinned
        self._pin_failed = pin and not pinned
        log.debug("[park] host buffer bytes=%d pinned=%s", nbytes, pinned)
        return self._view

    def release(self) -> None:
        """Unregister (if pinned) and free the buffer."""
        if self._finalizer is not None:
            self._finalizer()  # unregisters while the memory is still ours
            self._finalizer = None
        self._view = None
        self._pinned = self._pin_failed = False


class Yielder:
    """Parks ``modules``' parameters, gradients and buffers, ``optimizers``'
    state, and whatever :meth:`register_state` adds, in host memory.

    With a ``client`` it registers :meth:`park`/:meth:`unpark` as the client's
    suspend handlers, so ``client.yield_point()`` runs them when the daemon
    asks. ``pin_memory``: pin the host buffer (default: when a parked tensor is
    on CUDA); a pinned buffer is reserved at once, and again after each
    optimizer's first step. ``host_buffer``: the :class:`HostBuffer` to use.
    """

    def __init__(self, client=None, modules: Iterable[torch.nn.Module] = (),
                 optimizers: Iterable[torch.optim.Optimizer] = (), *,
                 device: torch.device | str | None = None, pin_memory: bool | None = None,
                 host_buffer: HostBuffer | None = None) -> None:
        self._modules = list(modules)
        self._optimizers = list(optimizers)
        self._extra: list[StateSource] = []
        self._device = torch.device(device) if device is not None else None
        self._pin_memory = pin_memory
        self._host = host_buffer if host_buffer is not None else HostBuffer()
        self._storages: list[_ParkedStorage] = []
        self._tensors: list[_ParkedTensor] = []
        self._parked = False
        self.bytes_parked = 0  # of the last park: device memory it released
        self.bytes_copied = 0  # of the last park: the state's bytes moved to the host
        self.client = client
        self._first_step_hooks: list = []
        try:
            storages, _ = self._plan()
        except ParkError as exc:  # raised again, with the same words, by park()
            log.warning("[park] this state cannot be parked: %s", exc)
            storages = None
        if storages is not None and self._pin_for(storages):
            # Pinning takes seconds for tens of GB: now, not inside a suspend deadline.
            self._reserve(storages, prefault=True)
            self._first_step_hooks = [opt.register_step_post_hook(self._after_first_step)
                                      for opt in self._optimizers]
        if client is not None:
            client.set_suspend_handlers(self.park, self.unpark)

    # ------------------------------------------------------------------ api

    def register_state(self, state: StateSource) -> None:
        """Park more state: a tensor, a module, an optimizer, or a callable with
        no arguments returning tensors (alone or in nested dicts, lists and
        tuples; other values are ignored). A callable is called at every park,
        so state created later is found. The tensors must be the live ones, not
        copies: parking works in place (``state_dict()`` of most objects other
        than modules and optimizers returns copies)."""
        if not isinstance(state, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)) and not callable(state):
            raise TypeError("register_state takes a tensor, a module, an optimizer or a callable returning "
                            f"tensors, got {type(state).__name__}")
        self._extra.append(state)

    @property
    def parked(self) -> bool:
        return self._parked

    @property
    def host_buffer(self) -> torch.Tensor | None:
        """The host buffer (uint8) the state is parked in; None before it is first needed."""
        return self._host.tensor

    def park(self) -> int:
        """Copy the state into host memory and free it on the device; returns the
        device bytes released (:attr:`bytes_parked`; see the module docstring).

        Nothing is changed when it raises (:class:`AlreadyParkedError`, a
        :class:`ParkError` for a tensor that cannot be parked, or out of host memory)."""
        if self._parked:
            raise AlreadyParkedError("the state is already parked; call unpark() first")
        storages, tensors = self._plan()
        total = sum(s.nbytes for s in storages)
        devices = sorted({s.device for s in storages}, key=str)
        for device in devices:
            _synchronize(device)  # the last step's kernels write what we are about to copy
        if _needed(storages) > self._host.nbytes and self._host.tensor is not None:
            log.warning("[park] the state grew to %d bytes since the host buffer was reserved (%d): growing it "
                        "inside the suspend; call Yielder.reserve() after creating new state", _needed(storages),
                        self._host.nbytes)
        host = self._reserve(storages)
        non_blocking = self._host.pinned
        reserved_before = {d: _reserved_bytes(d) for d in devices}
        for s in storages:
            host[s.offset:s.offset + s.nbytes].copy_(_bytes_of(s.storage, s.device), non_blocking=non_blocking)
        for device in devices:
            _synchronize(device)  # the copies are done before the memory goes
        for t in tensors:
            t.tensor.data = torch.empty(0, dtype=t.tensor.dtype, device=t.tensor.device)
        for s in storages:
            s.storage.resize_(0)
        for device_type in {d.type for d in devices}:
            _release_cached(device_type)
        released = 0
        for device in devices:
            before = reserved_before[device]
            # Where the allocator cannot say (cpu backend), the freed storages are what was released.
            released += (sum(s.nbytes for s in storages if s.device == device) if before is None
                         else max(0, before - (_reserved_bytes(device) or 0)))
        self._storages, self._tensors = storages, tensors
        self._parked = True
        self.bytes_parked, self.bytes_copied = released, total
        log.debug("[park] storages=%d tensors=%d bytes_copied=%d bytes_released=%d", len(storages), len(tensors),
                  total, released)
        return released

    def unpark(self) -> None:
        """Copy the parked state back into the same storages and tensors.

        If the device is out of memory, what was regrown is freed again and the
        state stays parked (call it again later)."""
        if not self._parked:
            raise NotParkedError("nothing is parked: unpark() needs a park() first")
        host = self._host.tensor
        grown: list[_ParkedStorage] = []
        try:
            for s in self._storages:
                s.storage.resize_(s.nbytes)
                grown.append(s)
        except RuntimeError:  # out of device memory, typically: stay parked, try again later
            for s in grown:
                s.storage.resize_(0)
            for device_type in {s.device.type for s in grown}:
                _release_cached(device_type)
            raise
        for s in self._storages:
            _bytes_of(s.storage, s.device).copy_(host[s.offset:s.offset + s.nbytes], non_blocking=self._host.pinned)
        for t in self._tensors:
            s = self._storages[t.storage_index]
            view = torch.empty(0, dtype=t.tensor.dtype, device=s.device)
            view.set_(s.storage, t.storage_offset, t.size, t.stride)
            t.tensor.data = view
        for device in sorted({s.device for s in self._storages}, key=str):
            _synchronize(device)  # the host buffer may be reused (next park) only once read
        log.debug("[unpark] storages=%d bytes=%d", len(self._storages), self.bytes_copied)
        self._storages, self._tensors = [], []
        self._parked = False

    def reserve(self) -> int:
        """Allocate (and pin, on CUDA) the host buffer now, sized exactly for the
        current state, so that the next suspend does not pay for it; returns its bytes."""
        if self._parked:
            return self._host.nbytes  # the parked state's buffer is in use and already fits
        return self._reserve(self._plan()[0], prefault=True).numel()

    # ------------------------------------------------------------- internals

    def _pin_for(self, storages: list[_ParkedStorage]) -> bool:
        if self._pin_memory is not None:
            return self._pin_memory
        # Asked in this order so that a state without CUDA tensors never initialises CUDA.
        return any(s.device.type == "cuda" for s in storages) and torch.cuda.is_available()

    def _reserve(self, storages: list[_ParkedStorage], prefault: bool = False) -> torch.Tensor:
        return self._host.ensure(_needed(storages), self._pin_for(storages), prefault=prefault)

    def _after_first_step(self, optimizer, args, kwargs) -> None:
        """Optimizers create their state (Adam's moments) in their first step: grow the buffer now."""
        for i, opt in enumerate(self._optimizers):
            if opt is optimizer and self._first_step_hooks[i] is not None:
                self._first_step_hooks[i].remove()
                self._first_step_hooks[i] = None
        if not self._parked:
            try:
                self.reserve()
            except ParkError:
                pass  # park() says it, when asked to park

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

    def _plan(self) -> tuple[list[_ParkedStorage], list[_ParkedTensor]]:
        """Which storages to park (each once, however many tensors share it) and
        where each goes in the host buffer; refuses before anything changes."""
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
        storages: list[_ParkedStorage] = []
        by_key: dict[tuple[str, int], int] = {}
        tensors: list[_ParkedTensor] = []
        offset = 0
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
            index = by_key.get(key)
            if index is None:
                # Shared host memory would come back private: other processes would stop seeing it.
                # (is_shared() is always true for CUDA storages, which are not shared that way.)
                if not storage.resizable() or (t.device.type == "cpu" and storage.is_shared()):
                    raise ParkError(f"cannot park {described}: its storage is not resizable (shared memory, "
                                    "or memory torch does not own)")
                index = by_key[key] = len(storages)
                storages.append(_ParkedStorage(storage, t.device, storage.nbytes(), offset))
                offset += _aligned(storage.nbytes())
            tensors.append(_ParkedTensor(t, name, index, t.storage_offset(), tuple(t.size()), tuple(t.stride())))
        return storages, tensors


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


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _aligned(nbytes: int) -> int:
    return _round_up(nbytes, _ALIGN_BYTES)


def _round_up(nbytes: int, unit: int) -> int:
    return (nbytes + unit - 1) // unit * unit


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
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    return None


def _release_cached(device_type: str) -> None:
    """Hand what is now free back to the driver, so the memory is free for others:
    cuBLAS's workspaces (one per handle and stream, kept by torch) first, then
    every cached block left empty."""
    if device_type == "cuda":
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
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


def _clear_cuda_error(maps_path: str = "/proc/self/maps") -> bool:
    """Reset the CUDA runtime's last error after a failed call we handled; True if done.

    torch checks ``cudaGetLastError`` after every kernel launch, so an error left
    there would be blamed on the next kernel. ``torch.cuda.cudart()`` has no
    ``cudaGetLastError``: it is called in the libcudart torch loaded, found by its
    path in the process's mappings (``RTLD_NOLOAD``: the same library, never a second one)."""
    path = _mapped_library("libcudart.so", maps_path)
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
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(prefix):
                    return fields[5].strip()
    except OSError:
        return None
    return None
