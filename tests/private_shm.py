"""A python script run where /dev/shm is a private tmpfs of a given size (a full /dev/shm on cue)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run_with_private_dev_shm(size: str, script: str, timeout: float) -> subprocess.CompletedProcess:
    """Run python ``script`` in a mount namespace of its own whose /dev/shm is a private
    tmpfs of ``size``; skips the test where that cannot be mounted (not root, no unshare)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private tmpfs on /dev/shm")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs: {probe.stderr.strip()[:200]}")
    return subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "{sys.executable}" -c "$0"', script],
        capture_output=True, text=True, timeout=timeout, cwd=REPO)
