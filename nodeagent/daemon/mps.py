"""MPS for sessions (:class:`MpsPartitions`): a supervised control daemon per listed device, each
session's share handed out in its welcome, and the root-only ``partition`` request. It owns the
control daemons (:class:`nodeagent.mps.MpsControl`) and the partition tables
(:class:`sharing.partition.PartitionTable`).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from client_lib import protocol as p
from nodeagent import memory
from nodeagent.config import ConfigError, ServeConfig
from nodeagent.devices import DeviceInfo
from nodeagent.mps import MpsControl, MpsError
from nodeagent.daemon.loop import POLLIN, EventLoopPoller
from sharing.partition import PartitionError, PartitionTable

log = logging.getLogger("nodeagent.daemon.mps")

Send = Callable[[object, object], None]  # (route, message)
Error = Callable[[object, int, str, str], None]  # (route, request id, code, message)


class MpsPartitions:
    """``config.mps_devices`` names the devices; each gets a control daemon at :meth:`start` and a
    table that plans integer SM shares for the sessions that :meth:`join` it."""

    def __init__(self, config: ServeConfig, devices: list[DeviceInfo], poller: EventLoopPoller,
                 send: Send, error: Error, backend: str = "cpu") -> None:
        wanted, self._auto = config.mps_devices_for(backend, len(devices))
        bad = [d for d in wanted if not 0 <= d < len(devices)]
        if bad:
            raise ConfigError(f"mps.devices names {bad}, but this node has devices 0..{len(devices) - 1}")
        self._wanted = wanted
        self._config = config
        self._devices = devices
        self._poller = poller
        self._send = send
        self._error = error
        self._controls: dict[int, MpsControl] = {}  # device -> its control daemon (started in start())
        self._by_fd: dict[int, int] = {}  # watch fd -> device
        self._users: dict[int, dict[str, int | None]] = {}  # device -> its MPS sessions' uids (one user at a time)
        self._faulted: dict[int, set[str]] = {}  # device -> sessions a server fault ended, until they leave
        self._tables: dict[int, PartitionTable] = {
            i: PartitionTable(i, min_percent=config.mps_min_percent,
                              memory_total_mb=memory.capacity_mb(devices[i], config.memory_reserve_mb))
            for i in wanted}

    # ------------------------------------------------------------------ life

    def start(self, runtime_dir: str) -> None:
        """One control daemon per configured device, watched through its pidfd."""
        for device in self._wanted:
            control = MpsControl(device, self._devices[device].uuid, runtime_dir, self._config.mps_control_binary,
                                 dir_mode=0o755 if os.geteuid() == 0 else 0o700)
            try:
                control.start()
            except MpsError as exc:
                if not self._auto:
                    raise
                # Chosen by "auto", not asked for: the daemon serves without MPS on this device.
                log.warning("[mps] device=%d: no MPS (%s); co-run paces lower classes without MPS client priority "
                            "(set mps.devices to silence this)", device, exc)
                self._tables.pop(device, None)
                continue
            self._controls[device] = control
            self._watch(device)
            log.info("[mps] device=%d control daemon pid=%s", device, control.pid)

    def stop(self) -> None:
        for device, control in self._controls.items():
            step = control.quit(timeout_s=5)
            log.info("[shutdown] step=mps device=%d result=%s", device, step.value)
        for fd in list(self._by_fd):
            self._unwatch(fd)
        self._controls.clear()

    def on_exit(self, fd: int, events: int) -> None:
        """A control daemon's pidfd fired: restart it (within its budget) and watch the new one."""
        device = self._by_fd.get(fd)
        if device is None:
            return
        for other in [f for f, d in self._by_fd.items() if d == device]:
            self._unwatch(other)
        try:
            self._controls[device].ensure_running()
        except MpsError as exc:
            # Off MPS from now on, as a device "auto" could not start MPS on: a client pointed at
            # a daemon that is gone runs without MPS, and must not be counted as the server's.
            del self._controls[device]
            self._tables.pop(device, None)
            log.error("[mps] device=%d control daemon cannot be kept running (%s); new sessions on it run "
                      "without MPS", device, exc)
            return
        self._watch(device)

    def _watch(self, device: int) -> None:
        fd = self._controls[device].watch_fd()
        if fd is not None:
            self._by_fd[fd] = device
            self._poller.register(fd, POLLIN, on_ready=self.on_exit, where="mps")

    def _unwatch(self, fd: int) -> None:
        self._by_fd.pop(fd, None)
        self._poller.unregister(fd)  # one not watched is let be

    # -------------------------------------------------------------- sessions

    def runs_on(self, device: int) -> bool:
        """Whether ``device`` has an MPS control daemon (started)."""
        return device in self._controls

    def control(self, device: int) -> MpsControl | None:
        return self._controls.get(device)

    def join(self, session: str, device: int, memory_mb: int, uid: int | None = None) -> bool:
        """Give ``session`` a share of ``device``; False (it runs outside MPS, in a plain context) off
        MPS, or when another user's session is on the device's MPS already: MPS makes a second
        user's clients wait for the first user's server to empty, and one server's clients share a
        fault domain (docs/architecture.md). An unverified uid (None) counts as a user of its own.
        Raises PartitionError."""
        table = self._tables.get(device)
        if table is None:
            return False
        if self._faulted.get(device):
            log.info("[mps] device=%d session=%s runs outside MPS: the server is recovering from a fault "
                     "(%d of its clients still to exit)", device, session, len(self._faulted[device]))
            return False
        users = self._users.setdefault(device, {})
        others = {u for u in users.values() if u != uid or uid is None}
        if others:
            log.info("[mps] device=%d session=%s uid=%s runs outside MPS: uid %s has the device's MPS server",
                     device, session, uid, sorted(others, key=str)[0])
            return False
        table.join(session, None, memory_mb or None)
        users[session] = uid
        return True

    def leave(self, session: str, device: int) -> None:
        table = self._tables.get(device)
        if table is not None:
            table.leave(session)
        self._users.get(device, {}).pop(session, None)
        faulted = self._faulted.get(device)
        if faulted and session in faulted:
            faulted.discard(session)
            if not faulted:
                del self._faulted[device]
                log.warning("[mps] device=%d: every client of the faulted MPS server has left; new sessions "
                            "join MPS again", device)

    def on_fault(self, event) -> None:
        """The bus's :class:`~nodeagent.daemon.bus.MpsFaulted`: a fatal fault ended every client of
        ``event.device``'s MPS server, which takes no new client until they have all exited; until
        their sessions have left, sessions that join get a plain context (:meth:`join`)."""
        gone = {sid for sid in event.sessions if sid in self._users.get(event.device, {})}
        if gone:
            self._faulted.setdefault(event.device, set()).update(gone)

    def recovering(self, device: int) -> int:
        """How many sessions of ``device``'s faulted MPS server are still to leave (0: none)."""
        return len(self._faulted.get(device, ()))

    def client_env(self, session: str, device: int, uncapped: bool = False) -> dict[str, str]:
        """What the client must set before CUDA initialises: its MPS daemon and share
        (``uncapped``: no SM cap unless a partition set one; see PartitionTable.issue)."""
        control, table = self._controls.get(device), self._tables.get(device)
        if control is None or table is None or session not in self._users.get(device, {}):
            return {}  # off MPS, or outside it (another user's server has the device)
        if self._faulted.get(device):
            return {}  # its server recovers from a fault: no client of it, a reattaching one included
        return {**control.client_env(), **table.issue(session, uncapped=uncapped)}

    def shares(self, device: int) -> dict[str, int]:
        """SM percent per session on ``device`` as planned now (empty off MPS)."""
        table = self._tables.get(device)
        return dict(table.plan.shares) if table is not None else {}

    # --------------------------------------------------------------- request

    def on_partition(self, route, msg: p.Partition) -> None:
        """The ``partition`` request, from a peer allowed to make it (nodeagent.daemon.authz)."""
        table = self._tables.get(msg.device)
        if table is None:
            self._error(route, msg.id, p.ErrorCode.DEVICE, f"device {msg.device} has no MPS daemon "
                        "(list it in mps.devices)")
            return
        strangers = sorted(set(msg.shares) - set(table.sessions()))
        if strangers:
            self._error(route, msg.id, p.ErrorCode.INVALID, f"not sessions of device {msg.device}: {strangers}")
            return
        try:
            plan = table.partition(msg.shares, msg.memory_mb)
        except PartitionError as exc:
            self._error(route, msg.id, p.ErrorCode.PARTITION, str(exc))
            return
        log.info("[mps] partition device=%d shares=%s", msg.device, dict(plan.shares))
        self._send(route, p.PartitionReply(id=msg.id, device=msg.device, shares=dict(plan.shares),
                                           memory_limits_mb=dict(plan.memory_limits_mb), stale=table.stale()))
