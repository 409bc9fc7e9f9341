"""The MPS control daemon's stand-in (tests/fake_mps_control.py) under the real program's name."""

from __future__ import annotations

import os
import sys
from pathlib import Path


FAKE = Path(__file__).resolve().parent / "fake_mps_control.py"


def write_fake_control(directory: str) -> str:
    """An executable named like the real program that runs the stand-in; its path."""
    bindir = os.path.join(directory, "bin")
    os.makedirs(bindir, exist_ok=True)
    path = os.path.join(bindir, "nvidia-cuda-mps-control")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    os.chmod(path, 0o755)
    return path
