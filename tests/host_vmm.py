"""CUDA's virtual memory management over host memory (HostVmm), for parking with addresses kept
on cpu; and, on a GPU, another process that fills the device memory a park freed."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import torch

from client_lib.vmm import DriverError, VmmBackend


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_NONE, PROT_RW = 0, 1 | 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000
GARBAGE = 0xA5


class HostVmm(VmmBackend):
    """Regions in host memory, made as CUDA's VMM makes them on a device: addresses reserved
    inaccessible, a memfd (the physical memory) mapped there, filled with garbage when access is
    set (what its last user left), unmapped back to inaccessible. Touching an unmapped region
    faults. Records calls; ``fail[name] = n`` lets n calls of ``name`` through, then fails one."""

    device_type = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail: dict[str, int] = {}
        self.handles: dict[int, int] = {}  # live physical allocations: fd -> bytes
        self.reserved: dict[int, int] = {}  # live address ranges: va -> bytes
        self.capturing_now = False

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            self.fail[name] -= 1
            if self.fail[name] < 0:
                del self.fail[name]
                raise DriverError(f"{name}(test)", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")

    def unavailable_reason(self, device):
        return None if device.type == "cpu" else "HostVmm makes host regions only"

    def granularity(self, device):
        return 64 << 10

    def reserve(self, nbytes, device):
        self._call("reserve")
        va = _libc.mmap(None, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        assert va not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        self.reserved[va] = nbytes
        return va

    def free(self, va, nbytes, device):
        self._call("free")
        assert self.reserved.pop(va) == nbytes and _libc.munmap(va, nbytes) == 0

    def create(self, nbytes, device):
        self._call("create")
        fd = os.memfd_create("region")
        os.ftruncate(fd, nbytes)
        self.handles[fd] = nbytes
        return fd

    def release(self, handle, device):
        self._call("release")
        os.close(handle)
        del self.handles[handle]

    def map(self, va, nbytes, handle, device):
        self._call("map")
        assert _libc.mmap(va, nbytes, PROT_NONE, MAP_SHARED | MAP_FIXED, handle, 0) == va

    def set_access(self, va, nbytes, device):
        self._call("set_access")
        assert _libc.mprotect(va, nbytes, PROT_RW) == 0
        ctypes.memset(va, GARBAGE, nbytes)

    def unmap(self, va, nbytes, device):
        self._call("unmap")
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE
        assert _libc.mmap(va, nbytes, PROT_NONE, flags, -1, 0) == va  # the range stays reserved

    def as_tensor(self, va, nbytes, device, owner):
        view = (ctypes.c_uint8 * nbytes).from_address(va)
        view.owner = owner  # torch keeps the buffer object while the tensor lives
        return torch.frombuffer(view, dtype=torch.uint8)

    def synchronize(self, device):
        self.calls.append("synchronize")

    def capturing(self, device):
        return self.capturing_now


_FILL_FREE_MEMORY = """
import torch
free, _ = torch.cuda.mem_get_info()
n = max(0, free - (768 << 20))  # all but room for this process's context
garbage = torch.empty(n, dtype=torch.uint8, device="cuda")
garbage.fill_(0xA5)
torch.cuda.synchronize()
print(n)
"""


def fill_freed_memory_from_another_process() -> int:
    """Another process takes (nearly) all free device memory, writes garbage in it and exits."""
    out = subprocess.run([sys.executable, "-c", _FILL_FREE_MEMORY], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, f"the other process failed ({out.returncode}): {out.stderr[-3000:]}"
    return int(out.stdout.split()[-1])
