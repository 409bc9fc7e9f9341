"""Where the daemon listens: one rule shared by the daemon and its clients."""

from __future__ import annotations

import grp
import os
import tempfile
from contextlib import suppress

ENV_ENDPOINT = "NODEAGENT_ENDPOINT"
SYSTEM_SOCKET = "/run/nodeagent/agent.sock"
SOCKET_GROUP = "nodeagent"  # the group a root daemon gives its socket (nodeagent.runtime)


def user_socket_path() -> str:
    """Socket path for a daemon run by an ordinary user."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isdir(runtime_dir):
        return os.path.join(runtime_dir, "nodeagent", "agent.sock")
    return os.path.join(tempfile.gettempdir(), f"nodeagent-{os.getuid()}", "agent.sock")


def daemon_endpoint() -> str:
    """The endpoint ``nodeagent serve`` binds when none is given."""
    return os.environ.get(ENV_ENDPOINT) or "ipc://" + (SYSTEM_SOCKET if os.geteuid() == 0 else user_socket_path())


def client_endpoint() -> str:
    """The endpoint a client connects to when none is given: the environment,
    else the system daemon's socket if one exists, else the one the daemon would bind."""
    # The directory, not the socket: a user outside group nodeagent cannot see
    # into it, and should get a permission error, not a silent per-user socket.
    if not os.environ.get(ENV_ENDPOINT) and os.path.isdir(os.path.dirname(SYSTEM_SOCKET)):
        return "ipc://" + SYSTEM_SOCKET
    return daemon_endpoint()


def ipc_path(endpoint: str) -> str | None:
    """Filesystem path of an ``ipc://`` endpoint, else None."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def socket_group(endpoint: str) -> str | None:
    """The group whose members may connect to ``endpoint`` ("group 'NAME'", or "group gid N"
    for a gid with no name here), None when only root may (the group is root's): the
    socket's, else that of its directory (which a user outside the group may not look
    into), else the one a root daemon gives it."""
    path = ipc_path(endpoint)
    for candidate in filter(None, (path, os.path.dirname(path or ""))):
        with suppress(OSError):
            gid = os.stat(candidate).st_gid
            break
    else:
        return f"group {SOCKET_GROUP!r}"
    if gid == 0:
        return None
    try:
        return f"group {grp.getgrgid(gid).gr_name!r}"
    except KeyError:
        return f"group gid {gid}"
