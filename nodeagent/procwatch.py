"""Verified identities of local peers and event-driven watching of their processes.

A pid claimed in ``hello`` is never trusted. On an ``ipc://`` connection
libzmq reads the peer's credentials with SO_PEERCRED and exposes them as the
frame property ``Peer-Address`` (``host:uid:gid:pid``); that pid is verified.
A verified process is watched through a pidfd, which becomes readable the
moment the process exits, so a dead client loses its token without waiting
for missed heartbeats.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import zmq

log = logging.getLogger("nodeagent.procwatch")


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    uid: int
    gid: int
    pid: int


def peer_credentials(frame: zmq.Frame) -> PeerCredentials | None:
    """Kernel-verified credentials of the peer that sent ``frame``, if known."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    # libzmq writes an ipc peer as "localhost:UID:GID:PID" (SO_PEERCRED). Anything
    # else is a network address, whose colons (IPv6 "fe80::1:2:3") must never read as ids.
    parts = str(address).split(":")
    if len(parts) != 4 or parts[0] not in ("localhost", ""):
        return None
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
    if pid <= 0:
        return None
    return PeerCredentials(uid=uid, gid=gid, pid=pid)


@dataclass(frozen=True, slots=True)
class ProcStat:
    state: str
    ppid: int
    pgrp: int
    start_ticks: int  # clock ticks since boot: with the pid, identifies a process across pid reuse


def read_stat(pid: int) -> ProcStat | None:
    """The fields of /proc/PID/stat the daemon uses, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return ProcStat(state=fields[0].decode(), ppid=int(fields[1]), pgrp=int(fields[2]),
                        start_ticks=int(fields[19]))
    except (IndexError, ValueError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    stat = read_stat(pid)
    return stat.start_ticks if stat is not None else None


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid``, or None where the kernel or sandbox has none."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return pidfd_open(pid)
    except OSError as exc:
        log.debug("[procwatch] pidfd_open pid=%d failed: %s", pid, exc)
        return None
