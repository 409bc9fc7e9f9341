"""Stopping and continuing client processes, and only ones whose identity was verified (through
a pidfd, or a launched program's verified group or cgroup). Detail: docs/internals.md.
"""

from __future__ import annotations

import functools
import logging
import os
import signal

from nodeagent import cgroup, procwatch
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


@functools.cache
def hierarchy() -> cgroup.Hierarchy | None:
    """The cgroup v2 mount the daemon sees (read once)."""
    return cgroup.v2_hierarchy()


def open_managed_cgroup(pgid: int, launcher_pid: int, launcher_uid: int | None) -> tuple[cgroup.Cgroup | None, str]:
    """The cgroup of the launched group's leader ``pgid`` (already verified as the child of
    ``launcher_pid``), if it is the launcher's own for it; else (None, why)."""
    return cgroup.open_verified(pgid, launcher_pid, launcher_uid, hierarchy())


def describe_hold(s: Session) -> str:
    """How the daemon would stop the session's launched program (for its log)."""
    if s.managed_cgroup is not None:
        return f"cgroup:{s.managed_cgroup.name}"
    return "pgroup" if s.managed_pidfd is not None else "-"


def can_signal(s: Session) -> bool:
    """True when the daemon may stop this session's process (its identity is verified)."""
    return s.managed_pidfd is not None or s.pidfd is not None


def send(s: Session, sig: int) -> bool:
    """Send ``sig`` to the session's verified process (or managed group). False if it is gone.
    A launched program in a verified cgroup is frozen for SIGSTOP and thawed for SIGCONT."""
    try:
        if s.managed_cgroup is not None and sig in (signal.SIGSTOP, signal.SIGCONT):
            # Not waiting for "frozen 1": this runs on the handoff path, as a SIGSTOP is not waited on.
            # The daemon's own freezer (the launcher's is below it): a thaw leaves the launcher's hold.
            if not cgroup.act(s.managed_cgroup, "freeze" if sig == signal.SIGSTOP else "thaw"):
                return False
        elif s.managed_pidfd is not None:
            # The leader's pidfd proves the group is still the one we verified.
            signal.pidfd_send_signal(s.managed_pidfd, 0)
            if sig == signal.SIGCONT:
                # A process group has one stop for two holders: a SIGCONT here would run what its
                # launcher stopped. The launcher continues it when it may (a grant, back to unmanaged).
                log.debug("[enforce] SIGCONT session=%s left to its launcher (pgroup)", s.id)
                return True
            os.killpg(s.managed_pgid, sig)
        elif s.pidfd is not None:
            signal.pidfd_send_signal(s.pidfd, sig)
        else:
            raise PermissionError(f"session {s.id} has no verified process; refusing to signal")
    except ProcessLookupError:
        return False
    # debug only: this runs on the handoff path; the daemon logs the decision after the grant.
    log.debug("[enforce] %s session=%s %s", signal.Signals(sig).name, s.id,
              describe_hold(s) if s.managed_pidfd is not None else f"pid={s.pid}")
    return True


def end_launched(s: Session) -> bool:
    """The launcher of ``s`` died: kill the program it launched (its verified cgroup, or its
    group while the leader's pidfd proves it is the one verified). False if nothing was done."""
    try:
        if s.managed_cgroup is not None:
            done = cgroup.act(s.managed_cgroup, "kill")
        elif s.managed_pidfd is not None:
            signal.pidfd_send_signal(s.managed_pidfd, 0)
            os.killpg(s.managed_pgid, signal.SIGKILL)
            done = True
        else:
            return False
    except ProcessLookupError:
        return False
    if done:
        log.warning("[enforce] launcher of session=%s died; killed its program (%s)", s.id, describe_hold(s))
    return done
