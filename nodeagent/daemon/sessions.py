"""Sessions as the daemon sees them (:class:`Session`: who the client is and how to reach it), and
:class:`SessionTable`, which holds them. A session lives from a ``welcome`` until ``bye``, its process
exiting (pidfd), its connection closing, its heartbeats stopping (sessions the daemon cannot watch) or
shutdown. Its token state is its scheduler's and :class:`nodeagent.daemon.tokens.Tokens`', a
whole-device suspension and the host memory kept for it :class:`nodeagent.daemon.suspension.Suspensions`'.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterator
from dataclasses import dataclass

from nodeagent import procwatch
from sharing import Workload


@dataclass(slots=True, eq=False)
class Session:
    id: str
    key: str
    route: object | None  # its client's connection (a local Peer); None until a restored session reattaches
    name: str
    claimed_pid: int  # what hello said: never used to signal anything
    verified_pid: int | None  # from the kernel (SO_PEERCRED); None over tcp
    start_ticks: int | None  # with verified_pid, identifies the process across pid reuse
    uid: int | None
    workload: Workload
    weight: float
    device: int
    memory_mb: int
    last_seen: float
    namespaces: tuple | None = None  # its peer's, at hello (procwatch.PeerCredentials.namespaces)
    pidfd: int | None = None
    managed_pgid: int | None = None  # verified process group of a program launched by nodeagent run
    managed_pidfd: int | None = None  # pidfd of that group's leader
    managed_cgroup: object | None = None  # nodeagent.cgroup.Cgroup: the leader's own cgroup, verified and held open
    memory_used_bytes: int | None = None  # measured by the memory watcher (cuda)
    borrower: str | None = None  # hello.borrower: the training job it belongs to (cluster lending)
    mps: bool = False  # its welcome put it on its device's MPS server (it shares that server's fault domain)
    slo_ms: float | None = None  # hello.slo_ms: the slice time a higher class asks co-run pacing to keep it to

    @property
    def pid(self) -> int:
        return self.verified_pid if self.verified_pid is not None else self.claimed_pid


class SessionTable:
    """The daemon's sessions by id, by connection (``route``) and by the pidfd of their process; it
    owns those pidfds and the epoll set of them (:meth:`fileno`). Read it as a mapping by id; change
    it through :meth:`add`, :meth:`attach`, :meth:`detach`, :meth:`remove` and :meth:`close_pidfds`."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_route: dict[object, Session] = {}
        self._by_pidfd: dict[int, Session] = {}
        self._pidfds = select.epoll()

    # ------------------------------------------------------------- reading

    def get(self, session_id: str, default=None) -> Session | None:
        return self._by_id.get(session_id, default)

    def __getitem__(self, session_id: str) -> Session:
        return self._by_id[session_id]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def values(self):
        return self._by_id.values()

    def by_route(self, route) -> Session | None:
        """The session whose client speaks on ``route`` (a connection), if any."""
        return self._by_route.get(route)

    def fileno(self) -> int:
        """The epoll set of the sessions' pidfds: readable when one of their processes exited."""
        return self._pidfds.fileno()

    def exited(self) -> list[Session]:
        """Sessions whose process has exited (their pidfd is readable)."""
        return [s for fd, _ in self._pidfds.poll(0) if (s := self._by_pidfd.get(fd)) is not None]

    # ------------------------------------------------------------ changing

    def touch(self, session: Session, now: float) -> None:
        """``session`` was heard from (or could not be: it was stopped until now): its
        heartbeat timeout counts from ``now``."""
        session.last_seen = now

    def add(self, session: Session) -> None:
        """Take ``session`` in; a verified one gets a pidfd for its process, watched from now on."""
        self._by_id[session.id] = session
        if session.route is not None:
            self._by_route[session.route] = session
        if session.verified_pid is not None:
            session.pidfd = procwatch.open_pidfd(session.verified_pid)
            if session.pidfd is not None:
                self._by_pidfd[session.pidfd] = session
                self._pidfds.register(session.pidfd, select.EPOLLIN)

    def attach(self, session: Session, route) -> None:
        """``session``'s client now speaks on ``route`` (it reconnected)."""
        self.detach(session)
        session.route = route
        self._by_route[route] = session

    def detach(self, session: Session) -> None:
        """``session``'s connection is gone; it stays (restored ones start so) until it reattaches or ends."""
        if session.route is not None and self._by_route.get(session.route) is session:
            del self._by_route[session.route]
        session.route = None

    def remove(self, session: Session) -> bool:
        """Take ``session`` out (its pidfds stay open until :meth:`close_pidfds`). False if it was not in."""
        if self._by_id.pop(session.id, None) is None:
            return False
        if session.route is not None and self._by_route.get(session.route) is session:
            del self._by_route[session.route]
        return True

    def close_pidfds(self, session: Session) -> None:
        """Stop watching ``session``'s process (and its launched group's leader and cgroup)."""
        if session.managed_pidfd is not None:
            os.close(session.managed_pidfd)
            session.managed_pidfd = None
        if session.managed_cgroup is not None:
            session.managed_cgroup.close()
            session.managed_cgroup = None
        if session.pidfd is None:
            return
        self._by_pidfd.pop(session.pidfd, None)
        try:
            self._pidfds.unregister(session.pidfd)
        except (KeyError, OSError):
            pass
        os.close(session.pidfd)
        session.pidfd = None

    def close(self) -> None:
        for session in list(self._by_id.values()):
            self.close_pidfds(session)
        self._pidfds.close()
