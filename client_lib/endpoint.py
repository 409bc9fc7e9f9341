"""Where the daemon listens: one rule shared by the daemon and its clients."""

from __future__ import annotations

import os
import tempfile

ENV_ENDPOINT = "NODEAGENT_ENDPOINT"
SYSTEM_SOCKET = "/run/nodeagent/agent.sock"


def user_socket_path() -> str:
    """Socket path for a daemon run by an ordinary user."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isdir(runtime_dir):
        return os.path.join(runtime_dir, "nodeagent", "agent.sock")
    return os.path.join(tempfile.gettempdir(), f"nodeagent-{os.getuid()}", "agent.sock")


def daemon_endpoint() -> str:
    """The endpoint ``nodeagent serve`` binds when none is given."""
    env = os.environ.get(ENV_ENDPOINT)
    if env:
        return env
    if os.geteuid() == 0:
        return "ipc://" + SYSTEM_SOCKET
    return "ipc://" + user_socket_path()


def client_endpoint() -> str:
    """The endpoint a client connects to when none is given: the environment,
    else the system daemon's socket if one exists, else this user's."""
    env = os.environ.get(ENV_ENDPOINT)
    if env:
        return env
    # The directory, not the socket: a user outside group nodeagent cannot see
    # into it, and should get a permission error, not a silent per-user socket.
    if os.geteuid() == 0 or os.path.isdir(os.path.dirname(SYSTEM_SOCKET)):
        return "ipc://" + SYSTEM_SOCKET
    return "ipc://" + user_socket_path()


def ipc_path(endpoint: str) -> str | None:
    """Filesystem path of an ``ipc://`` endpoint, else None."""
    if endpoint.startswith("ipc://"):
        return endpoint[len("ipc://"):]
    return None
