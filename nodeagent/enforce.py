"""Stopping and continuing client processes, and only ones whose identity was verified.

A library client's pid comes from the kernel (SO_PEERCRED) and is held as a
pidfd, so a signal sent through it can only reach that process, never one
that reused its pid. A program launched by ``nodeagent run`` is signalled as
its process group, which the daemon accepts only when the group is led by a
child of the verified launcher. A pid claimed in a hello is never signalled.
"""

from __future__ import annotations

import logging
import os
import signal

from nodeagent import procwatch
from nodeagent.daemon.sessions import Session

log = logging.getLogger("nodeagent.enforce")


def verify_managed_pgid(pgid: int, parent_pid: int) -> str | None:
    """Why ``pgid`` may not be signalled for the verified process ``parent_pid``, or None."""
    stat = procwatch.read_stat(pgid)
    if stat is None:
        return f"no process {pgid}"
    if stat.ppid != parent_pid:
        return f"process {pgid} is not a child of the connecting process {parent_pid}"
    if stat.pgrp != pgid:
        return f"process {pgid} does not lead its own process group (its group is {stat.pgrp})"
    return None


def can_signal(s: Session) -> bool:
    """True when the daemon may stop this session's process (its identity is verified)."""
    return s.managed_pidfd is not None or s.pidfd is not None


def send(s: Session, sig: int) -> bool:
    """Send ``sig`` to the session's verified process (or managed group). False if it is gone."""
    try:
        if s.managed_pidfd is not None:
            # The leader's pidfd proves the group is still the one we verified.
            signal.pidfd_send_signal(s.managed_pidfd, 0)
            os.killpg(s.managed_pgid, sig)
        elif s.pidfd is not None:
            signal.pidfd_send_signal(s.pidfd, sig)
        else:
            raise PermissionError(f"session {s.id} has no verified process; refusing to signal")
    except ProcessLookupError:
        return False
    # debug only: this runs on the handoff path; the daemon logs the decision after the grant.
    log.debug("[enforce] %s session=%s %s=%d", signal.Signals(sig).name, s.id,
              "pgid" if s.managed_pidfd is not None else "pid",
              s.managed_pgid if s.managed_pidfd is not None else s.pid)
    return True
