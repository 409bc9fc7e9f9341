"""Model factories the daemon-level serving tests register (importable by the
daemon's workers because the daemon runs from the repository root)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def small_cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 10)).eval()


def wide_mlp() -> nn.Module:
    """About 4 MiB of weights: two of them do not fit a 6 MiB residency budget."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        if float(x.sum()) < 0:
            raise RuntimeError("negative input refused by the model")
        return self.lin(x)


def fails_on_negative() -> nn.Module:
    torch.manual_seed(4)
    return _Fails()


class _Busy(nn.Module):
    """Writes its worker's pid to $NA_TEST_BUSY_MARKER, then computes (real work) until the file
    $NA_TEST_BUSY_RELEASE appears (a cue from the test), or for a while without one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        marker = os.environ.get("NA_TEST_BUSY_MARKER")
        if marker and float(x.sum()) > 0:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            release = os.environ.get("NA_TEST_BUSY_RELEASE")
            y = torch.randn(256, 256)
            for n in range(20000):  # seconds of matmuls, unless the test says it is done
                if release and n % 16 == 0 and os.path.exists(release):
                    break
                y = torch.tanh(self.lin(y))
        return self.lin(x)


def busy() -> nn.Module:
    torch.manual_seed(3)
    return _Busy()


class _SleepsForInput(nn.Module):
    """Sleeps as many seconds as its input's first element says (at most 30), after
    touching $NA_TEST_SLEEP_MARKER; returns the input doubled. No weights: cheap to load."""

    def forward(self, x):
        seconds = min(float(x.reshape(-1)[0]), 30.0) if x.numel() else 0.0
        if seconds > 0:
            marker = os.environ.get("NA_TEST_SLEEP_MARKER")
            if marker:
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(seconds)
        return x * 2


def sleeps_for_input() -> nn.Module:
    return _SleepsForInput()


def not_a_module():
    return 42


def slow_factory() -> nn.Module:
    """Touches $NA_TEST_SLOW_MARKER, then takes $NA_TEST_SLOW_FACTORY_S seconds (default 60) to
    build: a registration that stays pending while a test looks."""
    marker = os.environ.get("NA_TEST_SLOW_MARKER")
    if marker:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(float(os.environ.get("NA_TEST_SLOW_FACTORY_S", "60")))
    return _SleepsForInput()
