"""Which errors kill a CUDA context (ctxpool.device_errors), and a worker that meets one is replaced."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from client_lib import protocol as p
from ctxpool.device_errors import STICKY_CUDA_ERROR_CODES, DeviceLost, is_fatal
from ctxpool.messages import ModelSpec
from ctxpool.pool import RequestDone, RequestFailed, WorkerReady, WorkerReplaced
from tests import models_for_tests as m
from tests.ctxpool.pool_driver import start_pool

# Texts as torch, the driver and the libraries print them (first lines).
FATAL = [
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported",
    "CUDA error: unspecified launch failure",
    "CUDA error: misaligned address",
    "CUDA error: an illegal instruction was encountered",
    "CUDA error: unknown error",
    "CUDA driver error: unknown error",
    "CUDA error: uncorrectable ECC error encountered",
    "CUDA error: the launch timed out and was terminated",
    "CUDA error: hardware stack error",
    "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, a, lda, b, ldb)`",
    "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
    "cuDNN error: CUDNN_STATUS_MAPPING_ERROR",
    "Triton Error [CUDA]: an illegal memory access was encountered",
]
NOT_FATAL = [
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total capacity)",
    "CUDA error: invalid argument",
    "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)",
    "the model refused this input",
    "CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx`",
    "unknown error in the user's tokenizer",  # "unknown error" alone is not CUDA's
]


@pytest.mark.parametrize("text", FATAL)
def test_sticky_errors_are_fatal(text):
    assert is_fatal(RuntimeError(text))


@pytest.mark.parametrize("text", NOT_FATAL)
def test_recoverable_errors_are_not(text):
    assert not is_fatal(RuntimeError(text))


def test_the_error_code_of_an_accelerator_error_counts_whatever_the_words():
    class AcceleratorError(RuntimeError):  # torch >= 2.8 raises these with the cudaError_t attached
        def __init__(self, text: str, code: int) -> None:
            super().__init__(text)
            self.error_code = code

    assert 700 in STICKY_CUDA_ERROR_CODES and 2 not in STICKY_CUDA_ERROR_CODES
    assert is_fatal(AcceleratorError("CUDA error: (words of a newer toolkit)", 700))
    assert not is_fatal(AcceleratorError("CUDA error: out of memory", 2))


def test_what_an_error_was_raised_from_counts_and_device_lost_always_does():
    try:
        try:
            raise RuntimeError("CUDA error: unspecified launch failure")
        except RuntimeError as inner:
            raise ValueError("model 'm' cannot run its example inputs") from inner
    except ValueError as outer:
        assert is_fatal(outer)
    try:
        try:
            raise RuntimeError("CUDA error: misaligned address")
        except RuntimeError:
            raise KeyError("raised while handling it")
    except KeyError as during:
        assert is_fatal(during)
    assert is_fatal(DeviceLost("synchronising failed"))
    assert not is_fatal(None)


# ------------------------------------------------------------------ a real worker


STICKY_WORDS = "CUDA error: unknown error"


class Sticky(nn.Module):
    """Like the raising test model, with the words of an error that leaves a CUDA context dead."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.reshape(-1)[0]) == m.FAIL_CUE:
            raise RuntimeError(STICKY_WORDS)
        return self.fc(x)


def sticky() -> nn.Module:
    return Sticky()


@pytest.mark.slow
def test_a_worker_whose_run_meets_a_sticky_error_is_replaced(loop, examples):
    pool = start_pool(loop, workers_per_device=1)
    old = loop.wait_ready(pool, 1)[0].pid
    spec = ModelSpec(name="sticky", factory="tests.ctxpool.test_device_errors:sticky", example_input=examples(torch.ones(1, 8)))
    loop.register(pool, spec)
    bad = torch.ones(1, 8)
    bad[0, 0] = m.FAIL_CUE
    failed, _ = loop.infer(pool, 1, "sticky", [bad])
    assert isinstance(failed, RequestFailed) and failed.code == p.ErrorCode.INFERENCE
    assert STICKY_WORDS in failed.message
    replaced = loop.wait(WorkerReplaced, old_pid=old)
    assert replaced.new_pid not in (None, old)
    loop.wait(WorkerReady, pid=replaced.new_pid)
    done, outputs = loop.infer(pool, 2, "sticky", [torch.ones(1, 8)])
    assert isinstance(done, RequestDone) and outputs[0].shape == (1, 4)
