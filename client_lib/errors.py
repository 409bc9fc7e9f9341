"""Typed errors raised by the client library. Each carries a stable ``code``."""

from __future__ import annotations

from client_lib.protocol import ErrorCode


class NodeAgentError(Exception):
    """Base of every client-library error; ``code`` is an :class:`ErrorCode` string."""

    code = "E_CLIENT"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class DaemonError(NodeAgentError):
    """The daemon refused a request; ``code`` says why."""


class ProtocolMismatchError(DaemonError):
    code = ErrorCode.PROTOCOL


class NoSessionError(DaemonError):
    code = ErrorCode.NO_SESSION


class DaemonUnavailableError(NodeAgentError):
    """No answer from the daemon at ``endpoint`` (not running, restarted, or hung)."""

    code = "E_UNAVAILABLE"

    def __init__(self, endpoint: str, detail: str) -> None:
        super().__init__(f"nodeagent daemon at {endpoint} is unavailable: {detail}")
        self.endpoint = endpoint
        self.detail = detail  # why, without the endpoint: "nothing listens there (...)"


class HandshakeTimeoutError(DaemonUnavailableError):
    """No ``welcome`` within the handshake deadline."""

    code = "E_TIMEOUT"


class GrantTimeoutError(NodeAgentError):
    """The token was not granted within the caller's timeout."""

    code = "E_TIMEOUT"


class CudaTooEarlyError(NodeAgentError):
    """CUDA started in this process before its session's welcome, whose settings it reads only at start (the
    message says which and what to do); the session was closed again. ``variables``: the settings it did not
    get; ``detected_by``: how the early start was seen."""

    code = "E_CUDA_TOO_EARLY"

    def __init__(self, variables: dict[str, str], detected_by: str) -> None:
        names = ", ".join(f"{k}={v}" for k, v in sorted(variables.items()))
        super().__init__(
            f"CUDA was initialised in this process before its nodeagent session opened ({detected_by}), so the "
            f"session's settings {names} cannot take effect and the process would run outside its MPS partition. "
            "Create the Client before any torch.cuda call (torch.cuda.is_available() initialises CUDA too, unless "
            "PYTORCH_NVML_BASED_CUDA_CHECK=1 is set), or set CUDA_MPS_PIPE_DIRECTORY and the other variables "
            "yourself before CUDA starts (`nodeagent run` does this for its program)")
        self.variables = dict(variables)
        self.detected_by = detected_by


class ModelError(DaemonError):
    """A model could not be registered (bad factory path, weights file, shapes); nothing was registered."""

    code = ErrorCode.MODEL


class NoModelError(DaemonError):
    code = ErrorCode.NO_MODEL


class InferenceError(DaemonError):
    """The model raised inside the daemon's worker; the worker lives on."""

    code = ErrorCode.INFERENCE


class WorkerDeadError(DaemonError):
    """The worker running the request died; a replacement serves the next request."""

    code = ErrorCode.WORKER_DEAD


class ServingUnavailableError(DaemonError):
    """No workers to run the request (server-side inference off, or none alive)."""

    code = ErrorCode.UNAVAILABLE


class RequestTimeoutError(DaemonError):
    """The request did not finish within the timeout the caller gave; the daemon gave up on it
    (a worker still running it is replaced). Raise the timeout, or look at the model."""

    code = ErrorCode.TIMEOUT


_BY_CODE = {cls.code: cls for cls in (ProtocolMismatchError, NoSessionError, ModelError, NoModelError, InferenceError,
                                      WorkerDeadError, ServingUnavailableError, RequestTimeoutError)}


def from_reply(code: str, message: str) -> DaemonError:
    """The exception for an ``error`` reply."""
    cls = _BY_CODE.get(code, DaemonError)
    return cls(f"{code}: {message}", code)
