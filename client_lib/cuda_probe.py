"""Whether this process has initialised CUDA already, asked without initialising it
(:func:`cuda_initialised_by`): MPS settings are read once, at CUDA's init, so a session's
welcome must come first. The two looks it takes: docs/internals.md.
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import suppress
from typing import Any, Callable

DRIVER_SONAME = "libcuda.so.1"
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
    get_count = getattr(driver, "cuDeviceGetCount", None)  # None: no driver loaded, or not one with it
    if get_count is None:
        return False
    count = ctypes.c_int(0)
    return get_count(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def cuda_initialised_by(load_driver: Callable[[], Any | None] | None = None) -> str | None:
    """How CUDA was seen to be initialised in this process already, or None if it was not.
    ``load_driver`` (default :func:`loaded_driver`) is for tests."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None:
        with suppress(Exception):  # a half-imported torch: the driver probe still answers
            if cuda.is_initialized():
                return "torch.cuda.is_initialized() is true"
    if driver_initialised((load_driver or loaded_driver)()):
        return "the CUDA driver answers cuDeviceGetCount: cuInit has run, e.g. through torch.cuda.is_available()"
    return None
