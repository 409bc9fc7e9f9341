"""Small model factories for the model store and worker pool tests.

Workers import these by factory path (``tests.models_for_tests:mlp``), so
they must stay importable from the repository root and cheap to build.
"""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

FAIL_CUE = -777.0  # raising(): forward raises when the input's first element is this
BLOCK_CUE = 4242.0  # blocking(): forward blocks when the input's first element is this
BLOCK_DIR_ENV = "NODEAGENT_TEST_BLOCK_DIR"  # blocking() writes <dir>/<pid> once it blocks


def mlp() -> nn.Module:
    """Linear(8, 16) -> ReLU -> Linear(16, 4)."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def mlp_wider() -> nn.Module:
    """Same names as :func:`mlp`, other shapes: does not fit mlp's weights."""
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


class ConvBN(nn.Module):
    """Conv + BatchNorm (running stats and an int64 counter as buffers) and a
    non-persistent buffer, so every kind of tensor a module holds is covered."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("scale", torch.tensor([0.5, 1.0, 1.5, 2.0]).view(1, 4, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) * self.scale


def conv_bn() -> nn.Module:
    return ConvBN()


class Tied(nn.Module):
    """An embedding and an output projection sharing one weight; two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed(ids)
        return self.head(hidden), hidden


def tied() -> nn.Module:
    return Tied()


class Raising(nn.Module):
    """Like :func:`mlp`, but raises when the input's first element is FAIL_CUE."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.reshape(-1)[0]) == FAIL_CUE:
            raise ValueError("the model refused this input (FAIL_CUE)")
        return self.fc(x)


def raising() -> nn.Module:
    return Raising()


class Blocking(nn.Module):
    """Like :func:`mlp`, but on BLOCK_CUE it writes ``$NODEAGENT_TEST_BLOCK_DIR/<pid>``
    and blocks, so that a test can kill the worker while it is mid-request."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.reshape(-1)[0]) == BLOCK_CUE:
            with open(os.path.join(os.environ[BLOCK_DIR_ENV], str(os.getpid())), "w"):
                pass
            if not threading.Event().wait(timeout=60.0):  # nothing sets it: wait to be killed
                raise RuntimeError("blocking model was not killed within 60 s")
        return self.fc(x)


def blocking() -> nn.Module:
    return Blocking()


def factory_raises() -> nn.Module:
    raise RuntimeError("factory failed on purpose")


def not_a_module() -> int:
    return 42


NOT_CALLABLE = "a string, not a factory"


DIE_CUE = -999.0  # dying(): forward SIGKILLs its own process when the input's first element is this


class Dying(nn.Module):
    """Like :func:`mlp`, but kills its own process on DIE_CUE (a crash inside the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.reshape(-1)[0]) == DIE_CUE:
            os.kill(os.getpid(), 9)
        return self.fc(x)


def dying() -> nn.Module:
    return Dying()


def dies_in_factory() -> nn.Module:
    os.kill(os.getpid(), 9)
    raise AssertionError("unreachable")


class DictOut(nn.Module):
    """Returns a dict, which cannot cross back as a list of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict:
        return {"y": self.fc(x)}


def dict_out() -> nn.Module:
    return DictOut()


ECHOED_ENV = ("NODEAGENT_DEVICE_UUID", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_MPS_PIPE_DIRECTORY",
              "CUDA_MPS_LOG_DIRECTORY")


class EnvEcho(nn.Module):
    """Returns, as UTF-8 bytes of JSON, the variables of :data:`ECHOED_ENV` its worker process has
    (what the pool started it with), the device its input is on (``device``) and, on cuda, that
    device's UUID as CUDA reports it (``cuda_uuid``); :func:`read_env_echo` decodes them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import json

        self.fc(x)  # a layer that owns bytes, as the engine expects of a model
        seen = {name: os.environ[name] for name in ECHOED_ENV if name in os.environ}
        seen["device"] = str(x.device)
        if x.is_cuda:
            seen["cuda_uuid"] = f"GPU-{torch.cuda.get_device_properties(x.device).uuid}"
        return torch.tensor(list(json.dumps(seen).encode()), dtype=torch.uint8)


def env_echo() -> nn.Module:
    return EnvEcho()


def read_env_echo(output: torch.Tensor) -> dict:
    import json

    return json.loads(bytes(output.tolist()).decode())


class Net(torch.nn.Module):
    """Small, but with every kind of state: conv and linear weights, BatchNorm buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))
