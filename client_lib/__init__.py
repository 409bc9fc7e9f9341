"""nodeagent client library: what inference services and training jobs import.

Light by default: msgspec and the standard library (pyzmq only for the cluster
client, :mod:`client_lib.placement`); torch only in :mod:`client_lib.torch`.
"""

from client_lib.client import Client, query_status, resume_session, set_partition, suspend_session
from client_lib.errors import (CudaTooEarlyError, DaemonError, DaemonUnavailableError, GrantTimeoutError,
                               HandshakeTimeoutError, InferenceError, ModelError, NoModelError, NodeAgentError,
                               NoSessionError, ProtocolMismatchError, RequestTimeoutError, ServingUnavailableError,
                               WorkerDeadError)
from client_lib.protocol import PROTOCOL_VERSION, ErrorCode

__all__ = [
    "Client", "query_status", "suspend_session", "resume_session", "set_partition", "PROTOCOL_VERSION", "ErrorCode",
    "NodeAgentError", "DaemonError", "DaemonUnavailableError", "GrantTimeoutError",
    "HandshakeTimeoutError", "NoSessionError", "ProtocolMismatchError",
    "ModelError", "NoModelError", "InferenceError", "WorkerDeadError", "ServingUnavailableError",
    "RequestTimeoutError", "CudaTooEarlyError",
]
