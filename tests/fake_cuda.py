"""A stand-in CUDA driver for cpu hosts: ``libcuda.so.1`` (by soname) with the two
entry points the early-CUDA probe relies on. ``cuDeviceGetCount`` answers
CUDA_ERROR_NOT_INITIALIZED (3) until ``cuInit`` has run, as the real driver does."""

from __future__ import annotations

import os
import shutil
import subprocess

_SOURCE = r"""
static int initialised = 0;
int cuInit(unsigned int flags) { (void)flags; initialised = 1; return 0; }
int cuDeviceGetCount(int *count) { if (!initialised) return 3; *count = 1; return 0; }
"""


def build_fake_libcuda(directory: str) -> str | None:
    """Compile the stand-in into ``directory``; its path, or None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = os.path.join(directory, "fake_libcuda.c")
    with open(source, "w") as f:
        f.write(_SOURCE)
    library = os.path.join(directory, "libcuda.so.1")
    subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", library, source],
                   check=True, capture_output=True, timeout=60)
    return library
