"""nodeagent client library: what inference services and training jobs import.

Light by default (pyzmq, msgspec); torch only in :mod:`client_lib.torch`.
"""

from client_lib.client import Client, query_status
from client_lib.errors import (DaemonError, DaemonUnavailableError, GrantTimeoutError,
                               HandshakeTimeoutError, NodeAgentError, NoSessionError,
                               ProtocolMismatchError)
from client_lib.protocol import PROTOCOL_VERSION, ErrorCode

__all__ = [
    "Client", "query_status", "PROTOCOL_VERSION", "ErrorCode",
    "NodeAgentError", "DaemonError", "DaemonUnavailableError", "GrantTimeoutError",
    "HandshakeTimeoutError", "NoSessionError", "ProtocolMismatchError",
]
