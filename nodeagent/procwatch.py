"""Verified identities of local peers (never a pid claimed in ``hello``) and their processes
watched through pidfds; the process trees the memory watcher reads (:class:`PidTranslator`,
:func:`ancestors`). Detail: docs/internals.md.
"""

from __future__ import annotations

import functools
import logging
import os
import select
from dataclasses import dataclass
from typing import Final

import zmq

log = logging.getLogger("nodeagent.procwatch")

INIT_PID_NAMESPACE: Final = f"pid:[{0xEFFFFFFC}]"
"""readlink of /proc/PID/ns/pid for the initial (host) pid namespace: its inode is a
kernel constant (PROC_PID_INIT_INO), the same on every boot and host."""

MAX_ANCESTRY: Final = 64  # parents walked per process: deeper trees are cut off there


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    uid: int
    gid: int
    pid: int
    # What the kernel says of the peer's pid, user and mount namespaces (namespaces_of), read
    # when it connected; None where they could not be read (then it is never taken for root).
    namespaces: tuple | None = None


def peer_credentials(frame) -> PeerCredentials | None:
    """Kernel-verified credentials of the peer that sent ``frame``, if known:
    a local connection (:class:`nodeagent.daemon.loop.Peer`) carries them; a
    ZeroMQ frame may (libzmq's ``Peer-Address`` of an ipc peer)."""
    creds = getattr(frame, "creds", False)
    if creds is not False:
        return creds
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
    flags: int  # the kernel's PF_* flags of the process
    start_ticks: int  # clock ticks since boot: with the pid, identifies a process across pid reuse


def read_stat(pid: int, proc_root: str = "/proc") -> ProcStat | None:
    """The fields of /proc/PID/stat the daemon uses, or None if there is no such process."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return ProcStat(state=fields[0].decode(), ppid=int(fields[1]), pgrp=int(fields[2]), flags=int(fields[6]),
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


def read_nspid(pid: int, proc_root: str = "/proc") -> tuple[int, ...] | None:
    """``NSpid:`` of /proc/PID/status: the process's pid in each pid namespace from the
    one ``proc_root`` was mounted in (first) down to its own (last); None if unreadable."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return tuple(int(field) for field in line.split()[1:]) or None
    except (OSError, ValueError):
        return None
    return None


def namespaces_of(pid: int | str, pidfd: int | None = None, proc_root: str = "/proc") -> tuple | None:
    """What the kernel says of ``pid``'s pid, user and mount namespaces, in files any process
    may read (/proc/PID/ns/* would need CAP_SYS_PTRACE over a peer with capabilities the daemon
    dropped): how many pid namespaces it is below the one /proc belongs to (``NSpid:``, 0 in the
    same), its ``uid_map`` as this process sees it (the identity map in the same user namespace),
    and the mount id of its root (each mount belongs to one mount namespace). Equal for two
    processes in the same three namespaces; different for a container's. None if unreadable, or
    if ``pidfd``, the pidfd of the process meant, says it exited meanwhile (the pid may name
    another process now)."""
    nspid = read_nspid(pid, proc_root)
    try:
        with open(f"{proc_root}/{pid}/uid_map", "rb") as f:
            uid_map = b" ".join(f.read(4096).split()).decode()
        root_mount = None
        with open(f"{proc_root}/{pid}/mountinfo", "rb") as f:
            for line in f:
                fields = line.split(b" ", 5)
                if len(fields) > 4 and fields[4] == b"/":
                    root_mount = int(fields[0])  # any mount names its namespace: the first "/" will do
                    break
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        log.debug("[procwatch] namespaces of pid=%s unreadable: %s", pid, exc)
        return None
    if nspid is None or root_mount is None or (pidfd is not None and pidfd_exited(pidfd)):
        return None
    return (len(nspid) - 1, uid_map, root_mount)


def own_namespaces() -> tuple | None:
    """This process's namespaces (:func:`namespaces_of`)."""
    return namespaces_of("self")


@functools.cache
def home_namespaces() -> frozenset[tuple]:
    """The namespaces a local root is at home in, read once: this process's own and those of its
    pid namespace's init (pid 1: the host's, where systemd gave the daemon private mounts or a
    DaemonSet its own container)."""
    return frozenset(ns for ns in (own_namespaces(), namespaces_of(1)) if ns is not None)


def pid_namespace(pid: int | str = "self", proc_root: str = "/proc") -> str | None:
    """The pid namespace of ``pid`` as the kernel names it (``pid:[INODE]``), or None."""
    try:
        return os.readlink(f"{proc_root}/{pid}/ns/pid")
    except OSError:
        return None


def ancestors(pid: int, proc_root: str = "/proc") -> tuple[int, ...]:
    """Parent, grandparent, ... of ``pid`` up to the namespace's root (pid 1, included), at most
    MAX_ANCESTRY; () when ``pid`` is gone. A parent that exits while we read cuts the chain there."""
    chain = [pid]
    while len(chain) <= MAX_ANCESTRY:
        stat = read_stat(chain[-1], proc_root)
        if stat is None or stat.ppid <= 0 or stat.ppid in chain:  # a loop: pids reused while we read
            break
        chain.append(stat.ppid)
    return tuple(chain[1:])


class PidTranslator:
    """NVML's process ids in the daemon's pid namespace, where sessions' pids are (``mode``:
    host, host_proc or same, as :meth:`describe` says; why three: docs/internals.md)."""

    def __init__(self, proc_root: str = "/proc", host_proc_root: str | None = None,
                 own_namespace: str | None = None) -> None:
        self._proc = proc_root
        self._host_proc = host_proc_root or None
        self.own_namespace = own_namespace if own_namespace is not None else pid_namespace("self", proc_root)
        self.mode = ("host" if self.own_namespace == INIT_PID_NAMESPACE
                     else "host_proc" if self._host_proc is not None else "same")

    def describe(self) -> str:
        """One sentence for the log: how NVML's pids are read, and what to do if that is wrong."""
        if self.mode == "host":
            return "the daemon runs in the host's pid namespace: NVML's pids are its own"
        if self.mode == "host_proc":
            return (f"the daemon runs in pid namespace {self.own_namespace}: NVML's host pids are "
                    f"translated through {self._host_proc}/PID/status NSpid")
        return (f"the daemon runs in pid namespace {self.own_namespace}, not the host's: NVML's pids are "
                "taken as its own, which holds only for drivers that translate them; if nvidia-smi here "
                "shows pids that ps does not, mount the host's /proc and set memory.host_proc to it "
                "(or run the daemon in the host's pid namespace)")

    def to_local(self, nvml_pid: int) -> int | None:
        """``nvml_pid`` in the daemon's namespace, or None if that process is not visible there."""
        if nvml_pid <= 0:
            return None
        if self.mode != "host_proc":
            return nvml_pid
        if pid_namespace(nvml_pid, self._host_proc) != self.own_namespace:
            return None  # in another container (or gone): no pid of ours names it
        nspid = read_nspid(nvml_pid, self._host_proc)
        if nspid is None:
            return None
        local = nspid[-1]
        # The process may have exited and its local pid been reused between the two reads.
        host_stat, local_stat = read_stat(nvml_pid, self._host_proc), read_stat(local, self._proc)
        if host_stat is None or local_stat is None or host_stat.start_ticks != local_stat.start_ticks:
            return None
        return local


_PF_EXITING = 0x4  # <linux/sched.h>: set as a process starts to exit, before its files are closed


def exiting(pidfd: int | None, pid: int | None) -> bool:
    """True if the process behind ``pidfd`` has exited or is exiting. A connection it held
    closes while it exits, before its pidfd becomes readable: so the flags of
    /proc/PID/stat too (the pidfd not yet readable, ``pid`` is still that process)."""
    if pidfd is None or pid is None:
        return False
    if pidfd_exited(pidfd):
        return True
    stat = read_stat(pid)
    return (stat is not None and bool(stat.flags & _PF_EXITING)) or pidfd_exited(pidfd)


def pidfd_exited(pidfd: int | None) -> bool:
    """True if the process behind ``pidfd`` has exited (its pidfd is readable)."""
    if pidfd is None:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return False
