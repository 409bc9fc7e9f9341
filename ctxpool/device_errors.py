"""Which device errors leave a CUDA context dead (:func:`is_fatal`): one classifier for the
engine and the worker, and :class:`DeviceLost` for a context that is. Detail: docs/internals.md.
"""

from __future__ import annotations

import re

__all__ = ["DeviceLost", "STICKY_CUDA_ERROR_CODES", "is_fatal"]

# cudaError_t values after which the context is unusable (CUDA runtime API, "sticky" errors).
STICKY_CUDA_ERROR_CODES = frozenset({
    3,    # cudaErrorInitializationError
    201,  # cudaErrorDeviceUninitialized ("invalid device context")
    214,  # cudaErrorECCUncorrectable
    220,  # cudaErrorNvlinkUncorrectable
    700,  # cudaErrorIllegalAddress
    702,  # cudaErrorLaunchTimeout
    709,  # cudaErrorContextIsDestroyed
    710,  # cudaErrorAssert
    714,  # cudaErrorHardwareStackError
    715,  # cudaErrorIllegalInstruction
    716,  # cudaErrorMisalignedAddress
    717,  # cudaErrorInvalidAddressSpace
    718,  # cudaErrorInvalidPc
    719,  # cudaErrorLaunchFailure
    999,  # cudaErrorUnknown
})

# The same errors as torch, the driver and the libraries word them (matched case-insensitively).
_FATAL_TEXT = re.compile("|".join([
    r"illegal memory access", r"an illegal address", r"device-side assert", r"unspecified launch failure",
    r"misaligned address", r"illegal instruction", r"hardware stack error", r"invalid program counter",
    r"operation not supported on global/shared address space", r"launch timed out",
    r"uncorrectable ecc", r"ecc error", r"uncorrectable nvlink",
    r"cuda(?: driver)? error: unknown error", r"cudaErrorUnknown", r"CUDA_ERROR_UNKNOWN",
    r"cuda(?: driver)? error: initialization error", r"context is destroyed", r"invalid device context",
    r"fallen off the bus", r"gpu is lost",
    r"CUBLAS_STATUS_EXECUTION_FAILED", r"CUBLAS_STATUS_MAPPING_ERROR",
    r"CUDNN_STATUS_EXECUTION_FAILED", r"CUDNN_STATUS_MAPPING_ERROR",
    r"CUFFT_EXEC_FAILED", r"CUSOLVER_STATUS_EXECUTION_FAILED", r"CUSPARSE_STATUS_EXECUTION_FAILED",
]), re.IGNORECASE)

_MAX_CHAIN = 8  # causes and contexts followed


class DeviceLost(RuntimeError):
    """The device context of this process is dead (a sticky CUDA error): replace the process."""


def is_fatal(exc: BaseException | None) -> bool:
    """True if ``exc`` (or what it was raised from) says the CUDA context is dead."""
    seen = 0
    while exc is not None and seen < _MAX_CHAIN:
        if isinstance(exc, DeviceLost):
            return True
        code = getattr(exc, "error_code", None)  # torch.AcceleratorError carries cudaError_t
        if isinstance(code, int) and code in STICKY_CUDA_ERROR_CODES:
            return True
        if _FATAL_TEXT.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False
