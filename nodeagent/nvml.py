"""Every NVML call in the daemon goes through `Nvml.query`.

One place decides how NVML starts (lazily, once, under a lock), which errors
mean "this GPU cannot answer that" (the `NA` sentinel, logged once), which
say the GPU itself has failed (`NvmlGpuLost`: lost, or needs a reset) and which
are other real failures (`NvmlError`). The library object is injected so tests can
script a fake one; the default is `pynvml` from the nvidia-ml-py package.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any, Final

log = logging.getLogger("nodeagent.nvml")

# NVML error codes that mean "this device or driver cannot answer this query",
# not "something broke". Looked up by name on the injected library so a fake
# only needs the constants it uses.
_NOT_AVAILABLE_ERRORS: Final = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND",
                                 "NVML_ERROR_NOT_FOUND", "NVML_ERROR_NO_DATA")
# NVML error codes that mean the GPU itself has failed (fell off the bus, needs a
# reset): a device failure to report, never "this GPU cannot answer that".
_LOST_ERRORS: Final = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")


class _NotAvailable(enum.Enum):
    """Type of the `NA` sentinel: an enum member so it stays one object, even across pickling."""

    NA = "NA"

    def __repr__(self) -> str:
        return "NA"

    def __bool__(self) -> bool:
        return False


NA: Final = _NotAvailable.NA
"""Returned by `Nvml.query` when NVML says the query is unsupported or forbidden."""


class NvmlUnavailable(Exception):
    """NVML cannot start here: no driver, no library, or no nvidia-ml-py; the message says which."""


class NvmlError(Exception):
    """An NVML call failed for a reason other than "not available" (see `NA`)."""

    def __init__(self, func_name: str, code: int | None, message: str) -> None:
        super().__init__(f"{func_name} failed: {message} (NVML error {code})")
        self.func_name = func_name
        self.code = code


class NvmlGpuLost(NvmlError):
    """NVML says the GPU is lost or needs a reset: the device has failed, not the query."""


class Nvml:
    """A lazily initialised handle on the NVML library.

    `lib` is the module (or a scripted fake) exposing ``pynvml.nvmlInit``, ``pynvml.nvmlShutdown``,
    ``pynvml.NVMLError`` and the `nvml*` functions; None imports `pynvml` on first use.
    NVML reference-counts init/shutdown, so several instances may coexist.
    """

    def __init__(self, lib: Any = None) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._initialized = False
        self._not_available_codes: frozenset[int] = frozenset()
        self._lost_codes: frozenset[int] = frozenset()
        self._logged_not_available: set[tuple[str, object]] = set()

    @property
    def initialized(self) -> bool:
        return self._initialized

    def init(self) -> None:
        """Start NVML if not yet started; raise NvmlUnavailable with NVML's reason if it cannot."""
        if self._initialized:
            return
        # The lock makes concurrent first queries call nvmlInit exactly once.
        with self._lock:
            if self._initialized:
                return
            if self._lib is None:
                try:
                    import pynvml
                except ImportError as exc:
                    raise NvmlUnavailable(f"pynvml is not importable ({exc}); pip install nvidia-ml-py") from exc
                self._lib = pynvml
            lib = self._lib
            try:
                lib.nvmlInit()
            except (lib.NVMLError, OSError) as exc:
                raise NvmlUnavailable(f"nvmlInit failed: {exc}") from exc
            self._not_available_codes = _codes(lib, _NOT_AVAILABLE_ERRORS)
            self._lost_codes = _codes(lib, _LOST_ERRORS)
            self._initialized = True
            log.debug("[nvml] initialised lib=%s", getattr(lib, "__name__", type(lib).__name__))

    def shutdown(self) -> None:
        """Release NVML; a later query initialises it again."""
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            try:
                self._lib.nvmlShutdown()
            except self._lib.NVMLError as exc:
                log.warning("[nvml] shutdown failed error=%s", exc)

    def query(self, func_name: str, *args: Any) -> Any:
        """Return `lib.<func_name>(*args)`, with bytes decoded to str, or `NA` if NVML cannot answer.

        Raises NvmlUnavailable if NVML cannot start, NvmlGpuLost if the GPU has failed
        (lost, or needs a reset), NvmlError for any other NVML failure.
        """
        self.init()
        lib = self._lib
        func = getattr(lib, func_name, None)
        if func is None:
            # An older nvidia-ml-py without this function: the same as the driver lacking it.
            self._log_not_available_once(func_name, "not in library")
            return NA
        try:
            result = func(*args)
        except lib.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in self._not_available_codes:
                self._log_not_available_once(func_name, exc)
                return NA
            raise self._failure(func_name, exc) from exc
        if isinstance(result, bytes):
            return result.decode("utf-8", errors="replace")
        return result

    def constant(self, name: str, default: Any = None) -> Any:
        """The library's constant ``name`` (an event type, say), or ``default`` where it has none."""
        self.init()
        return getattr(self._lib, name, default)

    def wait_event(self, event_set: Any) -> Any:
        """The next event ``event_set`` holds (``nvmlEventSetWait_v2`` with no wait), or None
        when it holds none; NvmlError for a failure, NA where the library has no such call."""
        self.init()
        lib = self._lib
        func = getattr(lib, "nvmlEventSetWait_v2", None) or getattr(lib, "nvmlEventSetWait", None)
        if func is None:
            return NA
        try:
            return func(event_set, 0)
        except lib.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(lib, "NVML_ERROR_TIMEOUT", object()):
                return None
            raise self._failure("nvmlEventSetWait_v2", exc) from exc

    def _failure(self, func_name: str, exc: Exception) -> NvmlError:
        """NVML's error ``exc`` as NvmlGpuLost (the GPU has failed) or NvmlError."""
        code = getattr(exc, "value", None)
        return (NvmlGpuLost if code in self._lost_codes else NvmlError)(func_name, code, str(exc))

    def _log_not_available_once(self, func_name: str, error: object) -> None:
        key = (func_name, getattr(error, "value", str(error)))
        with self._lock:
            if key in self._logged_not_available:
                return
            self._logged_not_available.add(key)
        log.debug("[nvml] not available func=%s error=%s", func_name, error)


def _codes(lib: Any, names: tuple[str, ...]) -> frozenset[int]:
    """The values of the error constants ``names`` that ``lib`` has."""
    return frozenset(code for name in names if (code := getattr(lib, name, None)) is not None)
