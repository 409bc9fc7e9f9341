"""Whether this process has initialised CUDA already, asked without initialising it.

The settings of an MPS session (``CUDA_MPS_PIPE_DIRECTORY``, its SM share and
memory limit, ``CUDA_VISIBLE_DEVICES``) are read by the CUDA driver once, in
``cuInit``; a process that reached it before its session's welcome keeps
whatever it started with. Two looks, neither of which initialises anything:

1. torch's lazy-init state, ``torch.cuda.is_initialized()``: true once torch
   has set up CUDA for itself (first tensor, first ``torch.cuda.*`` call that
   needs a device). Not enough alone: ``torch.cuda.is_available()`` calls
   ``cudaGetDeviceCount`` (unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), which
   runs ``cuInit`` and leaves that flag false; torch keeps the count it got in
   C++, where Python cannot see it (``torch.cuda.device_count()`` caches only
   after lazy init), and its fork poisoning is visible only in a child.
2. The driver itself: ``libcuda.so.1`` opened with ``RTLD_NOLOAD`` (which
   never loads it: not loaded means never initialised, the runtime loads it in
   its first call), then ``cuDeviceGetCount``, which answers
   ``CUDA_ERROR_NOT_INITIALIZED`` until ``cuInit`` has run and does not run it.
   This catches every route to the driver (torch, CuPy, JAX, numba, a C
   extension). A failed ``cuInit`` counts as initialised: it is final too.

torch is looked at only if something already imported it: this module imports
neither torch nor the driver.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Callable

DRIVER_SONAME = "libcuda.so.1"
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3


def loaded_driver(soname: str = DRIVER_SONAME) -> Any | None:
    """The CUDA driver library if this process has loaded it already, else None (never loads it)."""
    mode = getattr(os, "RTLD_NOLOAD", None)
    if mode is None:  # not Linux or another dlopen: there is no way to ask without loading it
        return None
    try:
        return ctypes.CDLL(soname, mode=mode | getattr(os, "RTLD_LAZY", 1))
    except OSError:
        return None


def driver_initialised(driver: Any | None) -> bool:
    """Whether cuInit has run (or failed) in this process, given the loaded driver library."""
    if driver is None:
        return False
    try:
        get_count = driver.cuDeviceGetCount
    except AttributeError:
        return False
    count = ctypes.c_int(0)
    return get_count(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def cuda_initialised_by(load_driver: Callable[[], Any | None] | None = None) -> str | None:
    """How CUDA was seen to be initialised in this process already, or None if it was not.
    ``load_driver`` (default :func:`loaded_driver`) is for tests."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is not None:
        try:
            if cuda.is_initialized():
                return "torch.cuda.is_initialized() is true"
        except Exception:  # a half-imported torch: the driver probe still answers
            pass
    if driver_initialised((load_driver or loaded_driver)()):
        return "the CUDA driver answers cuDeviceGetCount: cuInit has run, e.g. through torch.cuda.is_available()"
    return None
