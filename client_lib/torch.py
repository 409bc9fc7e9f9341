"""Park a training job's state in host memory and bring it back, in place.

    client = Client("trainer", workload="training")
    yielder = Yielder(client, modules=[model], optimizers=[opt])
    with client.slice():
        for batch in loader:
            step(batch)
            client.yield_point()   # on a daemon's ``suspend``: park, report, wait, unpark

When the daemon asks for the whole device, :meth:`Yielder.park` copies every
parameter, gradient, buffer and optimizer-state tensor into one host buffer
(pinned when CUDA is there; allocated on the first park and reused), and frees
the device memory; :meth:`Yielder.unpark` copies it all back into the same
tensors. Both are public and need no daemon (tests, other schedulers).

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
Not supported: tensors in shared memory or wrapping foreign memory (their
storage cannot be resized; :meth:`park` refuses them before changing
anything), sparse tensors, and CUDA graphs that captured the old addresses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Union

import torch

log = logging.getLogger("client_lib.torch")

_ALIGN_BYTES = 512  # each storage's slice of the host buffer starts aligned (DMA-friendly)

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
    storage_index: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Yielder:
    """Parks ``modules``' parameters, gradients and buffers, ``optimizers``'
    state, and whatever :meth:`register_state` adds, in host memory.

    With a ``client`` it registers :meth:`park`/:meth:`unpark` as the client's
    suspend handlers, so ``client.yield_point()`` runs them when the daemon
    asks. ``pin_memory``: pin the host buffer (default: when a parked tensor is
    on CUDA).
    """

    def __init__(self, client=None, modules: Iterable[torch.nn.Module] = (),
                 optimizers: Iterable[torch.optim.Optimizer] = (), *,
                 device: torch.device | str | None = None, pin_memory: bool | None = None) -> None:
        self._modules = list(modules)
        self._optimizers = list(optimizers)
        self._extra: list[StateSource] = []
        self._device = torch.device(device) if device is not None else None
        self._pin_memory = pin_memory
        self._host: torch.Tensor | None = None
        self._host_pinned = False
        self._storages: list[_ParkedStorage] = []
        self._tensors: list[_ParkedTensor] = []
        self._parked = False
        self.bytes_parked = 0  # of the last park
        self.client = client
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
        """The host buffer (uint8) the state is parked in; None before the first park."""
        return self._host

    def park(self) -> int:
        """Copy the state into host memory and free it on the device; returns the bytes parked.

        Nothing is changed when it raises (:class:`AlreadyParkedError`, a
        :class:`ParkError` for a tensor that cannot be parked, or out of host memory)."""
        if self._parked:
            raise AlreadyParkedError("the state is already parked; call unpark() first")
        storages, tensors = self._plan()
        total = sum(s.nbytes for s in storages)
        devices = sorted({s.device for s in storages}, key=str)
        for device in devices:
            _synchronize(device)  # the last step's kernels write what we are about to copy
        host = self._host_buffer_for(storages)
        for s in storages:
            host[s.offset:s.offset + s.nbytes].copy_(_bytes_of(s.storage, s.device), non_blocking=self._host_pinned)
        for device in devices:
            _synchronize(device)  # the copies are done before the memory goes
        for t in tensors:
            t.tensor.data = torch.empty(0, dtype=t.tensor.dtype, device=t.tensor.device)
        for s in storages:
            s.storage.resize_(0)
        for device_type in {d.type for d in devices}:
            _empty_cache(device_type)
        self._storages, self._tensors = storages, tensors
        self._parked = True
        self.bytes_parked = total
        log.debug("[park] storages=%d tensors=%d bytes=%d", len(storages), len(tensors), total)
        return total

    def unpark(self) -> None:
        """Copy the parked state back into the same storages and tensors.

        If the device is out of memory, what was regrown is freed again and the
        state stays parked (call it again later)."""
        if not self._parked:
            raise NotParkedError("nothing is parked: unpark() needs a park() first")
        host = self._host
        grown: list[_ParkedStorage] = []
        try:
            for s in self._storages:
                s.storage.resize_(s.nbytes)
                grown.append(s)
        except RuntimeError:  # out of device memory, typically: stay parked, try again later
            for s in grown:
                s.storage.resize_(0)
            for device_type in {s.device.type for s in grown}:
                _empty_cache(device_type)
            raise
        for s in self._storages:
            _bytes_of(s.storage, s.device).copy_(host[s.offset:s.offset + s.nbytes], non_blocking=self._host_pinned)
        for t in self._tensors:
            s = self._storages[t.storage_index]
            view = torch.empty(0, dtype=t.tensor.dtype, device=s.device)
            view.set_(s.storage, t.storage_offset, t.size, t.stride)
            t.tensor.data = view
        for device in sorted({s.device for s in self._storages}, key=str):
            _synchronize(device)  # the host buffer may be reused (next park) only once read
        log.debug("[unpark] storages=%d bytes=%d", len(self._storages), self.bytes_parked)
        self._storages, self._tensors = [], []
        self._parked = False

    def reserve(self) -> int:
        """Allocate (and pin) the host buffer now, sized for the current state,
        so that the first suspend does not pay for it; returns its bytes."""
        storages, _ = self._plan()
        host = self._host_buffer_for(storages)
        if not self._host_pinned:
            host.zero_()  # fault its pages in now (pinning already does)
        return host.numel()

    # ------------------------------------------------------------- internals

    def _sources(self) -> Iterator[torch.Tensor]:
        """Every tensor of the state, in a stable order (duplicates possible)."""
        for module in self._modules:
            yield from _module_tensors(module)
        for opt in self._optimizers:
            yield from _optimizer_tensors(opt)
        for state in self._extra:
            if isinstance(state, torch.Tensor):
                yield state
            elif isinstance(state, torch.nn.Module):
                yield from _module_tensors(state)
            elif isinstance(state, torch.optim.Optimizer):
                yield from _optimizer_tensors(state)
            else:
                yield from _walk(state())

    def _plan(self) -> tuple[list[_ParkedStorage], list[_ParkedTensor]]:
        """Which storages to park (each once, however many tensors share it) and
        where each goes in the host buffer; refuses before anything changes."""
        candidates: list[torch.Tensor] = []
        seen: set[int] = set()
        for t in self._sources():
            if id(t) not in seen and t.device.type != "meta":
                seen.add(id(t))
                candidates.append(t)
        if self._device is not None:
            only = self._device  # "cuda" means every CUDA device, "cuda:1" that one
            wanted = lambda d: d.type == only.type and only.index in (None, d.index)  # noqa: E731
        elif any(t.device.type != "cpu" for t in candidates):
            wanted = lambda d: d.type != "cpu"  # noqa: E731
        else:
            wanted = lambda d: True  # noqa: E731  (cpu backend: host memory is the device)
        storages: list[_ParkedStorage] = []
        by_key: dict[tuple[str, int], int] = {}
        tensors: list[_ParkedTensor] = []
        offset = 0
        for t in candidates:
            if not wanted(t.device):
                continue
            if t.layout != torch.strided:
                raise ParkError(f"cannot park a {t.layout} tensor of shape {tuple(t.shape)}: only dense ones")
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = (str(t.device), storage.data_ptr())
            index = by_key.get(key)
            if index is None:
                # Shared host memory would come back private: other processes would stop seeing it.
                # (is_shared() is always true for CUDA storages, which are not shared that way.)
                if not storage.resizable() or (t.device.type == "cpu" and storage.is_shared()):
                    raise ParkError(f"cannot park a tensor of shape {tuple(t.shape)} on {t.device}: its storage "
                                    "is not resizable (shared memory, or memory torch does not own)")
                index = by_key[key] = len(storages)
                storages.append(_ParkedStorage(storage, t.device, storage.nbytes(), offset))
                offset += _aligned(storage.nbytes())
            tensors.append(_ParkedTensor(t, index, t.storage_offset(), tuple(t.size()), tuple(t.stride())))
        return storages, tensors

    def _host_buffer_for(self, storages: list[_ParkedStorage]) -> torch.Tensor:
        """The host buffer, grown (reallocated) only if this state no longer fits."""
        need = storages[-1].offset + storages[-1].nbytes if storages else 0
        if self._host is not None and self._host.numel() >= need:
            return self._host
        pin = self._pin_memory
        if pin is None:
            pin = torch.cuda.is_available() and any(s.device.type == "cuda" for s in storages)
        self._host = None  # let the old one go before allocating the larger one
        self._host = torch.empty(need, dtype=torch.uint8, pin_memory=pin)
        self._host_pinned = pin
        log.debug("[park] host buffer bytes=%d pinned=%s", need, pin)
        return self._host


def _module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    for p in module.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from module.buffers()


def _optimizer_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in opt.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
            yield from _walk(opt.state.get(p, {}))
        yield from _walk({k: v for k, v in group.items() if k != "params"})  # e.g. a tensor lr


def _walk(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in nested dicts, lists and tuples (anything else is skipped)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _walk(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk(value)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            accelerator.synchronize(device)


def _empty_cache(device_type: str) -> None:
    """Hand the freed blocks back to the driver, so the memory is free for others."""
    if device_type == "cuda":
        torch.cuda.empty_cache()
    elif device_type == "mps":
        torch.mps.empty_cache()
