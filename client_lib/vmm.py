"""Device memory whose virtual addresses outlive its physical memory (CUDA's virtual memory
management): a :class:`Region` is reserved once, unmapped to give the memory back and remapped
at the same addresses, so tensors over it keep their ``data_ptr()``. Detail: docs/internals.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("client_lib.vmm")

VERIFY_BLOCK_BYTES = 64 << 10  # one checksum per 64 KiB: a corrupted block is located, a swap of blocks is seen

# cuda.h (CUDA 10.2 to 13: unchanged)
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_NONE = 0x0
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


_p = ctypes.POINTER
_u64, _size, _int = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
# Exported names: cuda.h maps cuCtxPushCurrent, cuCtxPopCurrent to their _v2; the cuMem* calls have one version.
_SIGNATURES: dict[str, list] = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [_p(_int), _int],
    "cuDeviceGetAttribute": [_p(_int), _int, _int],
    "cuDevicePrimaryCtxRetain": [_p(ctypes.c_void_p), _int],
    "cuCtxPushCurrent_v2": [ctypes.c_void_p],
    "cuCtxPopCurrent_v2": [_p(ctypes.c_void_p)],
    "cuGetErrorName": [_int, _p(ctypes.c_char_p)],
    "cuGetErrorString": [_int, _p(ctypes.c_char_p)],
    "cuMemGetAllocationGranularity": [_p(_size), _p(CUmemAllocationProp), _int],
    "cuMemAddressReserve": [_p(_u64), _size, _size, _u64, _u64],
    "cuMemAddressFree": [_u64, _size],
    "cuMemCreate": [_p(_u64), _size, _p(CUmemAllocationProp), _u64],
    "cuMemRelease": [_u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, _p(CUmemAccessDesc), _size],
}


class DriverError(RuntimeError):
    """A CUDA driver call failed; names the call, its arguments and the CUresult."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({code}): {text}")
        self.call, self.code, self.name = call, code, name


class CudaDriver:
    """``libcuda.so.1`` through ctypes, each call checked (:class:`DriverError`). ``lib``: an
    object with the driver's functions as attributes, instead (tests)."""

    def __init__(self, lib: Any = None) -> None:
        self._lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self._lib, name)  # AttributeError: a driver without VMM (older than CUDA 10.2)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int  # kept: a CDLL caches each function it looked up
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self.call("cuInit", 0)

    def call(self, name: str, *args: Any, what: str = "") -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != 0:
            raise DriverError(f"{name}({what})" if what else name, rc, self._error_text("cuGetErrorName", rc),
                              self._error_text("cuGetErrorString", rc))

    def _error_text(self, name: str, rc: int) -> str:
        text = ctypes.c_char_p()
        if getattr(self._lib, name)(rc, ctypes.byref(text)) != 0 or not text.value:
            return "unknown CUresult"
        return text.value.decode(errors="replace")

    def device(self, index: int) -> int:
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), index, what=f"ordinal {index}")
        return dev.value

    def attribute(self, attribute: int, index: int) -> int:
        value = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(value), attribute, self.device(index),
                  what=f"attribute {attribute}, cuda:{index}")
        return value.value

    def push(self, index: int) -> None:
        """Make ``cuda:index``'s primary context (torch's) current on this thread, whatever was before."""
        ctx = self._contexts.get(index)
        if ctx is None:
            ctx = ctypes.c_void_p()
            self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.device(index), what=f"cuda:{index}")
            self._contexts[index] = ctx  # kept (retained) for the process: torch holds it too
        self.call("cuCtxPushCurrent_v2", ctx, what=f"cuda:{index}")

    def pop(self) -> None:
        self.call("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))


class VmmBackend:
    """The calls a :class:`Region` makes, one per driver call (``device`` a ``torch.device``), and
    the regions alive. Subclasses: :class:`CudaVmm`; tests provide one over host memory."""

    device_type = ""

    def __init__(self) -> None:
        self.regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()
        self._graveyard: list[_Mapping] = []
        self._lock = threading.Lock()

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why regions cannot be made on ``device``, or None when they can."""
        raise NotImplementedError

    def granularity(self, device: torch.device) -> int: raise NotImplementedError
    def reserve(self, nbytes: int, device: torch.device) -> int: raise NotImplementedError
    def free(self, va: int, nbytes: int, device: torch.device) -> None: raise NotImplementedError
    def create(self, nbytes: int, device: torch.device) -> int: raise NotImplementedError
    def release(self, handle: int, device: torch.device) -> None: raise NotImplementedError
    def map(self, va: int, nbytes: int, handle: int, device: torch.device) -> None: raise NotImplementedError
    def set_access(self, va: int, nbytes: int, device: torch.device) -> None: raise NotImplementedError
    def unmap(self, va: int, nbytes: int, device: torch.device) -> None: raise NotImplementedError
    def as_tensor(self, va: int, nbytes: int, device: torch.device, owner: Any) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` at ``va`` that keeps ``owner`` alive while any view of it lives."""
        raise NotImplementedError

    def synchronize(self, device: torch.device) -> None: raise NotImplementedError

    def capturing(self, device: torch.device) -> bool:
        """Whether a CUDA graph is being captured on the current stream (no synchronising now)."""
        return False

    def region_at(self, va: int) -> Region | None:
        return self.regions.get(va)

    # ------------------------------------------------------- end of life

    def bury(self, mapping: _Mapping) -> None:
        """A region died: free its memory now, or at the next :meth:`drain` if it cannot be now."""
        if sys.is_finalizing():
            return  # the process's end frees it; the driver may be gone already
        with self._lock:
            self._graveyard.append(mapping)
        try:
            capturing = self.capturing(mapping.device)
        except Exception:  # interpreter shutdown: the process's end frees it
            return
        if not capturing:
            self.drain()

    def drain(self) -> int:
        """Free the memory of regions that died (after synchronising their devices); returns bytes freed."""
        with self._lock:
            dead, self._graveyard = self._graveyard, []
        freed = 0
        for device in {m.device for m in dead}:
            try:
                self.synchronize(device)  # queued kernels may still use the memory
            except Exception as exc:
                log.warning("[vmm] synchronising %s before freeing dead regions failed: %s", device, exc)
                with self._lock:
                    self._graveyard.extend(m for m in dead if m.device == device)
                dead = [m for m in dead if m.device != device]
        for m in dead:
            try:
                if m.unmap(self):
                    freed += m.nbytes
                self.free(m.va, m.nbytes, m.device)
            except Exception as exc:
                log.warning("[vmm] freeing a region of %d bytes at %#x on %s failed: %s", m.nbytes, m.va,
                            m.device, exc)
        if dead:
            log.debug("[vmm] freed %d dead regions (%d bytes)", len(dead), freed)
        return freed


class CudaVmm(VmmBackend):
    """Regions on CUDA devices through the driver's VMM calls (``libcuda.so.1``, loaded at first use),
    each made with the device's primary context (torch's) pushed, whatever the thread has current."""

    device_type = "cuda"

    def __init__(self, driver: CudaDriver | None = None) -> None:
        super().__init__()
        self._driver = driver
        self._granularity: dict[int, int] = {}

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return (f"the state is on {device.type}, where there is no device address to keep (address keeping "
                    "maps CUDA device memory through CUDA's virtual memory management)")
        try:
            import numpy  # noqa: F401  (torch reads __cuda_array_interface__ through numpy)
        except ImportError:
            return "numpy is not installed: torch needs it to make tensors over a region (__cuda_array_interface__)"
        try:
            driver = self.driver()
            if not driver.attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, _index(device)):
                return f"{device} does not support CUDA's virtual memory management (cuMemCreate, cuMemMap)"
        except (OSError, AttributeError, DriverError) as exc:
            return f"the CUDA driver's virtual memory calls are not usable here: {exc}"
        return None

    def driver(self) -> CudaDriver:
        if self._driver is None:
            self._driver = CudaDriver()
        return self._driver

    def _call(self, device: torch.device, name: str, *args: Any, what: str = "") -> None:
        driver = self.driver()
        driver.push(_index(device))
        try:
            driver.call(name, *args, what=what)
        finally:
            driver.pop()

    @staticmethod
    def _prop(device: torch.device) -> CUmemAllocationProp:
        return CUmemAllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED, requestedHandleTypes=CU_MEM_HANDLE_TYPE_NONE,
                                   location=CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, _index(device)))

    def granularity(self, device: torch.device) -> int:
        index = _index(device)
        if index not in self._granularity:
            size = ctypes.c_size_t()
            self._call(device, "cuMemGetAllocationGranularity", ctypes.byref(size),
                       ctypes.byref(self._prop(device)), CU_MEM_ALLOC_GRANULARITY_MINIMUM, what=str(device))
            self._granularity[index] = size.value
        return self._granularity[index]

    def reserve(self, nbytes: int, device: torch.device) -> int:
        va = ctypes.c_uint64()
        self._call(device, "cuMemAddressReserve", ctypes.byref(va), nbytes, self.granularity(device), 0, 0,
                   what=f"{nbytes} bytes for {device}")
        return va.value

    def free(self, va: int, nbytes: int, device: torch.device) -> None:
        self._call(device, "cuMemAddressFree", va, nbytes, what=f"{va:#x}, {nbytes} bytes")

    def create(self, nbytes: int, device: torch.device) -> int:
        handle = ctypes.c_uint64()
        self._call(device, "cuMemCreate", ctypes.byref(handle), nbytes, ctypes.byref(self._prop(device)), 0,
                   what=f"{nbytes} bytes on {device}")
        return handle.value

    def release(self, handle: int, device: torch.device) -> None:
        self._call(device, "cuMemRelease", handle, what=f"handle {handle:#x} on {device}")

    def map(self, va: int, nbytes: int, handle: int, device: torch.device) -> None:
        self._call(device, "cuMemMap", va, nbytes, 0, handle, 0, what=f"{va:#x}, {nbytes} bytes on {device}")

    def set_access(self, va: int, nbytes: int, device: torch.device) -> None:
        desc = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, _index(device)),
                               CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._call(device, "cuMemSetAccess", va, nbytes, ctypes.byref(desc), 1,
                   what=f"{va:#x}, {nbytes} bytes, read-write for {device}")

    def unmap(self, va: int, nbytes: int, device: torch.device) -> None:
        self._call(device, "cuMemUnmap", va, nbytes, what=f"{va:#x}, {nbytes} bytes on {device}")

    def as_tensor(self, va: int, nbytes: int, device: torch.device, owner: Any) -> torch.Tensor:
        tensor = torch.as_tensor(_CudaArray(va, nbytes, owner), device=device)
        if tensor.data_ptr() != va or tensor.device != device or tensor.numel() != nbytes:
            raise RuntimeError(f"torch.as_tensor over the region at {va:#x} ({nbytes} bytes on {device}) gave a "
                               f"tensor at {tensor.data_ptr():#x} on {tensor.device} of {tensor.numel()} bytes: "
                               "a copy, not a view")
        return tensor

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def capturing(self, device: torch.device) -> bool:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class _CudaArray:
    """What ``torch.as_tensor`` reads: ``nbytes`` of device memory at ``ptr`` (CUDA array interface
    v3, no stream: nothing to wait for). torch keeps this object, and so ``owner``, while the tensor lives."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}
        self.owner = owner


@dataclass
class _Mapping:
    """A region's addresses and physical memory, apart from the region so that its finaliser can free them."""

    device: torch.device
    nbytes: int
    va: int = 0
    handle: int | None = None  # None while nothing is mapped

    def unmap(self, vmm: VmmBackend) -> bool:
        """Give the physical memory back (the addresses stay reserved); False if none was mapped."""
        if self.handle is None:
            return False
        vmm.unmap(self.va, self.nbytes, self.device)
        handle, self.handle = self.handle, None
        vmm.release(handle, self.device)
        return True


class Region:
    """``used_bytes`` (rounded up to the device's granularity) of device memory at addresses that stay
    reserved for the region's life, mapped at once. Made with :meth:`create`, which also returns the
    one tensor over it: the tensor (and its views) keep the region alive, the region does not keep them."""

    def __init__(self, vmm: VmmBackend, device: torch.device, used_bytes: int) -> None:
        self.vmm = vmm
        self.device = device
        self.used_bytes = used_bytes
        self.span_bytes = round_up(used_bytes, VERIFY_BLOCK_BYTES)  # what a park copies and checks
        nbytes = round_up(max(used_bytes, 1), max(vmm.granularity(device), VERIFY_BLOCK_BYTES))
        self._m = _Mapping(device, nbytes)
        self._m.va = vmm.reserve(nbytes, device)
        try:
            self.remap()
        except BaseException:
            vmm.free(self._m.va, nbytes, device)
            raise
        finalizer = weakref.finalize(self, vmm.bury, self._m)
        finalizer.atexit = False  # at exit the process's end frees it; the driver may be gone already
        vmm.regions[self._m.va] = self

    @classmethod
    def create(cls, vmm: VmmBackend, device: torch.device, used_bytes: int) -> tuple[Region, torch.Tensor]:
        region = cls(vmm, device, used_bytes)
        return region, vmm.as_tensor(region.va, region.nbytes, device, owner=region)

    @property
    def va(self) -> int:
        return self._m.va

    @property
    def nbytes(self) -> int:
        """Bytes of device memory mapped while the region is mapped (the granularity's multiple)."""
        return self._m.nbytes

    @property
    def mapped(self) -> bool:
        return self._m.handle is not None

    def unmap(self) -> None:
        """Give the physical memory back; the addresses stay reserved (and must not be touched)."""
        self._m.unmap(self.vmm)

    def remap(self) -> None:
        """Map new physical memory (contents undefined) at the same addresses."""
        if self._m.handle is not None:
            return
        m, vmm = self._m, self.vmm
        handle = vmm.create(m.nbytes, self.device)
        try:
            vmm.map(m.va, m.nbytes, handle, self.device)
            try:
                vmm.set_access(m.va, m.nbytes, self.device)
            except BaseException:
                vmm.unmap(m.va, m.nbytes, self.device)
                raise
        except BaseException:
            vmm.release(handle, self.device)
            raise
        m.handle = handle


def block_sums(data: torch.Tensor) -> torch.Tensor:
    """Checksums of ``data`` (flat uint8) on its device: per 64 KiB block the wrapping int64 sum of its
    8-byte words, then one for the tail (its bytes' sum). Any change of a word is seen (unless another
    change in the same block cancels it), and so is a block moved, which a single sum would miss."""
    n = data.numel()
    full = n - n % VERIFY_BLOCK_BYTES
    parts = []
    if full:
        parts.append(data[:full].view(torch.int64).view(-1, VERIFY_BLOCK_BYTES // 8).sum(dim=1))
    if n > full:
        parts.append(data[full:].to(torch.int64).sum().reshape(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0] if parts else torch.zeros(0, dtype=torch.int64)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


@functools.cache
def default_backend() -> CudaVmm:
    """The process's one :class:`CudaVmm` (every Yielder sees every region)."""
    return CudaVmm()
