"""MPS for sessions, as part of :class:`nodeagent.server.AgentServer`: a
supervised control daemon per listed device, each session's share handed out in
its welcome, and the root-only ``partition`` request.

A mixin over the server's state: it uses ``_mps``, ``_mps_by_fd``,
``_partitions``, ``_device_info``, ``_poller``, ``config`` and the server's
``_send`` and ``_error``.
"""

from __future__ import annotations

import logging
import os

import zmq

from client_lib import protocol as p
from nodeagent import procwatch
from nodeagent.cluster import ClusterRoute
from nodeagent.mps import MpsControl, MpsError
from nodeagent.sessions import Session
from sharing.partition import PartitionError

log = logging.getLogger("nodeagent.mps_wiring")


class MpsMixin:
    """MPS daemons and partitions for sessions (see the module docstring)."""

    def _start_mps(self, runtime_dir: str) -> None:
        """One MPS control daemon per configured device, watched through its pidfd."""
        for device in self.config.mps_devices:
            info = self._device_info[device]
            control = MpsControl(device, info.uuid, runtime_dir, self.config.mps_control_binary,
                                 dir_mode=0o755 if os.geteuid() == 0 else 0o700)
            control.start()
            self._mps[device] = control
            self._watch_mps(device)
            log.info("[mps] device=%d control daemon pid=%s", device, control.pid)

    def _watch_mps(self, device: int) -> None:
        fd = self._mps[device].watch_fd()
        if fd is not None:
            self._mps_by_fd[fd] = device
            self._poller.register(fd, zmq.POLLIN)

    def _on_mps_exit(self, device: int) -> None:
        """The control daemon died: restart it (within its budget) and watch the new one."""
        for fd in [fd for fd, d in self._mps_by_fd.items() if d == device]:
            self._poller.unregister(fd)
            del self._mps_by_fd[fd]
        try:
            self._mps[device].ensure_running()
        except MpsError as exc:
            log.error("[mps] device=%d control daemon cannot be kept running: %s", device, exc)
            return
        self._watch_mps(device)

    def _stop_mps(self) -> None:
        for device, control in self._mps.items():
            step = control.quit(timeout_s=5)
            log.info("[shutdown] step=mps device=%d result=%s", device, step.value)
        self._mps.clear()
        self._mps_by_fd.clear()

    def _client_env(self, s: Session) -> dict[str, str]:
        """What the client must set before CUDA initialises: its MPS daemon and share."""
        control, table = self._mps.get(s.device), self._partitions.get(s.device)
        if control is None or table is None:
            return {}
        return {**control.client_env(), **table.issue(s.id)}

    def _on_partition(self, route: bytes, msg: p.Partition, frame, now: float) -> None:
        creds = procwatch.peer_credentials(frame)
        if type(route) is not ClusterRoute and (creds is None or creds.uid != 0):  # cluster peers: root-equivalent
            self._error(route, msg.id, p.ErrorCode.FORBIDDEN, "only root may set MPS partitions")
            return
        table = self._partitions.get(msg.device)
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

