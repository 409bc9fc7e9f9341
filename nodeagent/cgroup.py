"""cgroup v2: a launched program's own cgroup, stopped, continued and ended as one
(:func:`create_child`, :func:`open_verified`); :class:`Unavailable` where no cgroup can be made.
The two freezers, the delegation rules and how the hierarchy is found: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import signal
import time
from dataclasses import dataclass

_FROZEN = b"frozen 1"
_POPULATED = b"populated 1"
_POLL_MS = 10  # longest wait between looks at cgroup.events (poll wakes us sooner on a change)
_GONE = (errno.ENOENT, errno.ENODEV)  # the directory was removed under an open file


class Unavailable(Exception):
    """No cgroup can be made or used here; the message says why."""


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """A mounted cgroup v2 hierarchy: where it is mounted, and which cgroup its root is."""

    mount: str  # e.g. /sys/fs/cgroup or /sys/fs/cgroup/unified
    root: str  # the cgroup path the mount shows at its top ("/" unless bind-mounted from below)

    def fs_path(self, cgroup: str) -> str | None:
        """The directory of ``cgroup`` (a path as /proc/PID/cgroup gives it), or None if
        it is not under this mount (or outside our cgroup namespace: "/..")."""
        if not cgroup.startswith("/") or "/../" in cgroup + "/":
            return None
        root = self.root.rstrip("/")
        if cgroup != root and not cgroup.startswith(root + "/"):
            return None
        return self.mount.rstrip("/") + cgroup[len(root):].rstrip("/")


def v2_hierarchy(mountinfo: str = "/proc/self/mountinfo") -> Hierarchy | None:
    """The cgroup v2 mount this process sees, or None (cgroup v1 only, or none at all)."""
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or right.split()[:1] != ["cgroup2"]:
            continue
        found.append(Hierarchy(mount=_unescape(fields[4]), root=_unescape(fields[3])))
    return min(found, key=lambda h: h.root != "/", default=None)  # the whole tree before a bind mount of part of it


def cgroup_of(pid: int | str = "self", proc_root: str = "/proc") -> str | None:
    """``pid``'s cgroup v2 path (the ``0::`` line of /proc/PID/cgroup), or None."""
    try:
        with open(f"{proc_root}/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].rstrip("\n")
    except OSError:
        return None
    return None


class Cgroup:
    """One cgroup v2 directory, held open: its freeze and events files, and the
    directory itself for the rest (a rename cannot redirect what is open)."""

    def __init__(self, path: str, name: str) -> None:
        self.path = path  # where it is in this process's filesystem
        self.name = name  # its cgroup path, as /proc/PID/cgroup shows it
        self._dirfd = self._freeze_fd = self._events_fd = None
        try:
            self._dirfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            self._freeze_fd = os.open("cgroup.freeze", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self._dirfd)
            self._events_fd = os.open("cgroup.events", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._dirfd)
        except OSError:
            self.close()
            raise

    def fds(self) -> tuple[int, ...]:
        """The descriptors it holds (a forked keeper keeps them)."""
        return tuple(fd for fd in (self._dirfd, self._freeze_fd, self._events_fd) if fd is not None)

    def owner_uid(self) -> int:
        return os.fstat(self._dirfd).st_uid

    # ------------------------------------------------------------ reading

    def _events(self) -> bytes:
        return os.pread(self._events_fd, 256, 0)

    def frozen(self) -> bool:
        return _FROZEN in self._events()

    def populated(self) -> bool:
        return _POPULATED in self._events()

    def procs(self) -> list[int]:
        fd = os.open("cgroup.procs", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._dirfd)
        try:
            data = b""
            while chunk := os.read(fd, 65536):
                data += chunk
        finally:
            os.close(fd)
        return [int(x) for x in data.split()]

    def wait(self, done, timeout_s: float) -> bool:
        """Wait until ``done()`` (a look at cgroup.events) is true; False at the timeout.
        The kernel wakes a poll on cgroup.events when it changes."""
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        poller.register(self._events_fd, select.POLLPRI | select.POLLERR)
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(min(_POLL_MS, max(1, int(left * 1000))))
        return True

    # ------------------------------------------------------------ acting

    def adopt(self, pid: int) -> None:
        """Move ``pid`` (all its threads) in; OSError as the kernel refuses it."""
        _write_fd_at(self._dirfd, "cgroup.procs", str(pid))

    def eject(self, pid: int) -> None:
        """Move ``pid`` back to the parent cgroup (it was adopted, and must not stay)."""
        with open(os.path.join(os.path.dirname(self.path), "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def freeze(self) -> None:
        """Start freezing (every process, every thread); :meth:`stop` also waits for it."""
        os.write(self._freeze_fd, b"1")

    def thaw(self) -> None:
        os.write(self._freeze_fd, b"0")

    def stop(self, timeout_s: float) -> bool:
        """Freeze and wait until the kernel says frozen; False if it took longer (a task
        in an uninterruptible wait freezes when it leaves it)."""
        self.freeze()
        return self.wait(self.frozen, timeout_s)

    def kill(self) -> None:
        """SIGKILL everything in it (thawed after, so nothing is left frozen)."""
        try:
            _write_fd_at(self._dirfd, "cgroup.kill", "1")
        except FileNotFoundError:  # before Linux 5.14: frozen, nothing can fork; kill what is there
            self.freeze()
            self.wait(self.frozen, 1.0)
            for _ in range(100):
                pids = self.procs()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.wait(lambda: not self.populated(), 0.05)
        self.thaw()

    def sub(self, name: str) -> "Cgroup":
        """Make and open the cgroup ``name`` inside this one (OSError as the kernel refuses)."""
        path = os.path.join(self.path, name)
        os.mkdir(path)
        try:
            return Cgroup(path, self.name.rstrip("/") + "/" + name)
        except OSError:
            os.rmdir(path)
            raise

    def remove(self) -> bool:
        """Thaw, close and remove the directory, and every cgroup made inside it (a program may
        make its own); False if processes are still in one."""
        with contextlib.suppress(OSError):
            self.thaw()
        self.close()
        inside = [os.path.join(below, name) for below, dirs, _ in os.walk(self.path, topdown=False) for name in dirs]
        removed = True
        for path in (*inside, self.path):  # the deepest first
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                removed = False
        return removed

    def close(self) -> None:
        for name in ("_freeze_fd", "_events_fd", "_dirfd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)


def create_child(name: str, hierarchy: Hierarchy | None = None) -> Cgroup:
    """Make and open cgroup ``name`` under this process's own cgroup; :class:`Unavailable`
    if it cannot be made or cannot be frozen."""
    hierarchy = hierarchy or v2_hierarchy()
    if hierarchy is None:
        raise Unavailable("no cgroup v2 hierarchy is mounted (cgroup v1 only)")
    own = cgroup_of("self")
    parent = hierarchy.fs_path(own) if own is not None else None
    if parent is None:
        raise Unavailable(f"this process's cgroup v2 path {own!r} is not under {hierarchy.mount}")
    path = os.path.join(parent, name)
    try:
        os.mkdir(path)
    except FileExistsError:  # left by a launcher whose pid we now have: empty, or not ours to take
        try:
            os.rmdir(path)
            os.mkdir(path)
        except OSError as exc:
            raise Unavailable(f"cannot create {path}: {exc.strerror}") from None
    except OSError as exc:
        raise Unavailable(f"cannot create {path}: {exc.strerror} (cgroup v2 delegation: the launcher "
                          f"needs write access to its own cgroup {parent})") from None
    try:
        return Cgroup(path, own.rstrip("/") + "/" + name)
    except FileNotFoundError:
        os.rmdir(path)
        raise Unavailable("the kernel has no cgroup.freeze (cgroup v2 freezer: Linux 5.2)") from None
    except OSError as exc:
        os.rmdir(path)
        raise Unavailable(f"cannot open {path}: {exc.strerror}") from None


def ways_out(cg: Cgroup, hierarchy: Hierarchy | None = None) -> list[str]:
    """The files by which a process in ``cg`` running as this process's user could undo its hold:
    the ``cgroup.freeze`` of ``cg`` and of its ancestors (a thaw), and the ``cgroup.procs`` of its
    ancestors (a move out of the frozen cgroup), as far as the kernel's write permission goes.
    Empty: this user cannot; a launcher's own cgroups are its user's, so it always can."""
    hierarchy = hierarchy or v2_hierarchy()
    top = hierarchy.mount.rstrip("/") if hierarchy is not None else os.path.dirname(cg.path)
    found = []
    path = cg.path.rstrip("/")
    if os.access(os.path.join(path, "cgroup.freeze"), os.W_OK):
        found.append(os.path.join(path, "cgroup.freeze"))
    while path != top and path.startswith(top + "/"):
        path = os.path.dirname(path)
        for name in ("cgroup.freeze", "cgroup.procs"):
            file = os.path.join(path, name)
            if os.path.exists(file) and os.access(file, os.W_OK):
                found.append(file)
    return found


def open_verified(child_pid: int, launcher_pid: int, launcher_uid: int | None,
                  hierarchy: Hierarchy | None) -> tuple[Cgroup | None, str]:
    """The cgroup the daemon holds ``child_pid`` by, if the kernel says the launcher made it for
    that child: a direct child of ``launcher_pid``'s cgroup, owned by ``launcher_uid``, with the
    child in a cgroup below it (the launcher's own freeze: two freezers, so that neither thaws
    what the other froze). Else (None, why). The caller verified ``child_pid`` as the launcher's child."""
    if hierarchy is None:
        return None, "no cgroup v2 hierarchy is mounted"
    if launcher_uid is None:
        return None, "the launcher's uid is not known"
    theirs, mine = cgroup_of(launcher_pid), cgroup_of(child_pid)
    if theirs is None or mine is None:
        return None, "no cgroup v2 path for the launcher or its child"
    if mine == theirs:
        return None, "the child shares its launcher's cgroup"
    if not mine.startswith(theirs.rstrip("/") + "/"):
        return None, f"the child's cgroup {mine} is not below its launcher's {theirs}"
    held = theirs.rstrip("/") + "/" + mine[len(theirs.rstrip("/")) + 1:].split("/")[0]
    if held == mine:  # a launcher that freezes the cgroup the daemon would hold (older than this daemon)
        return None, f"the child is in {mine} itself, not in a cgroup of its launcher's below it"
    path = hierarchy.fs_path(held)
    if path is None:
        return None, f"cgroup {held} is not under {hierarchy.mount}"
    try:
        cg = Cgroup(path, held)
    except OSError as exc:
        return None, f"cannot open {path}: {exc.strerror}"
    try:
        why = ""
        if cg.owner_uid() != launcher_uid:
            why = f"{path} is owned by uid {cg.owner_uid()}, not the launcher's {launcher_uid}"
        elif not (cgroup_of(child_pid) or "").startswith(held + "/"):  # moved while we opened it
            why = f"the child left {held}"
    except OSError as exc:
        why = f"cannot read {path}: {exc.strerror}"
    if why:
        cg.close()
        return None, why
    return cg, ""


def act(cg: Cgroup, what: str) -> bool:
    """freeze, thaw or kill ``cg``; False if it is gone (removed once its program ended)."""
    try:
        getattr(cg, what)()
    except OSError as exc:
        if exc.errno in _GONE or exc.errno == errno.EBADF:
            return False
        raise
    return True


def _write_fd_at(dirfd: int, name: str, value: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
