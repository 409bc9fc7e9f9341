"""Descriptors: the daemon's RLIMIT_NOFILE, raised to the hard limit at start, and the connection
limits that fit in it (``local.max_connections`` and, in the same proportion so that one user can
never lock the others out, ``local.max_connections_per_uid``). Why: docs/internals.md.
"""

from __future__ import annotations

import logging
import os
import resource
from typing import NamedTuple

log = logging.getLogger("nodeagent.fdlimit")

FDS_PER_CONNECTION = 2  # its socket and the pidfd of its process (a launcher's group leader: one more, rarely)
SPARE_FDS = 128  # the journal, worker pipes, MPS daemons, ZeroMQ, one-shot status probes, the metrics listener
# A hard limit of a billion (some container runtimes set that) would make a child that closes every
# descriptor it might have inherited (a daemonising MPS control daemon) take minutes: raise to at most this.
MAX_SOFT_LIMIT = 1 << 20


def raise_soft_limit() -> None:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit (at most :data:`MAX_SOFT_LIMIT`), and log it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, MAX_SOFT_LIMIT)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if soft != resource.RLIM_INFINITY and soft >= target:
        log.debug("[serve] RLIMIT_NOFILE soft limit %d (hard %s)", soft, hard_text)  # unchanged: not news
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("[serve] RLIMIT_NOFILE soft limit stays %d (hard %s): cannot raise it (%s)", soft, hard_text, exc)
        return
    log.info("[serve] RLIMIT_NOFILE soft limit raised from %d to %d (hard %s)", soft, target, hard_text)


def soft_limit() -> int | None:
    """RLIMIT_NOFILE's soft limit now; None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def open_descriptors() -> int:
    """Descriptors this process holds now (0 where /proc cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir held
    except OSError:
        return 0


class ConnectionLimits(NamedTuple):
    max_connections: int
    max_connections_per_uid: int
    room: int | None  # connections the descriptors left can hold; None: unlimited
    derived: bool  # the configured values did not fit and these were derived


def connection_limits(max_connections: int, max_connections_per_uid: int, *, soft_limit: int | None,
                      in_use: int, reserved: int = SPARE_FDS) -> ConnectionLimits:
    """The local endpoint's limits: the configured ones if ``max_connections`` fits in
    what the soft limit leaves (after ``in_use`` and ``reserved``), else that room, with
    the per-uid limit cut in the same proportion (at least 1)."""
    if soft_limit is None:
        return ConnectionLimits(max_connections, max_connections_per_uid, None, False)
    room = max(1, (soft_limit - in_use - reserved) // FDS_PER_CONNECTION)
    if room >= max_connections:
        return ConnectionLimits(max_connections, max_connections_per_uid, room, False)
    per_uid = min(max_connections_per_uid, room, max(1, room * max_connections_per_uid // max_connections))
    return ConnectionLimits(room, per_uid, room, True)
