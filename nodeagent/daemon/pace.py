"""Pacing lower classes on co-run devices: the pace boards and their controllers.

On a co-run device (:mod:`sharing.corun`) every class has its own token, so an
inference request is granted at once beside a training holder. This
component tells the lower classes how hard to hold back while a higher class
holds: one pace board per device (:mod:`client_lib.pace`, a 64-byte file
clients map read-only, named in their welcome), written after every loop turn
from the scheduler's lanes and the device's :class:`sharing.corun.PaceController`,
which it feeds with the higher class's slices.

A part of :class:`nodeagent.daemon.tokens.Tokens` (which owns the schedulers);
given the tokens component's views and the session table to read, and the metrics.
"""

from __future__ import annotations

import logging
import os
import stat

from client_lib.pace import Pace, PaceBoardError, PaceBoardWriter
from nodeagent import runtime
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import Workload
from sharing.corun import PaceController

log = logging.getLogger("nodeagent.daemon.pace")

PACE_DIR = "pace"


class Pacing:
    """Boards and controllers of the co-run devices (see the module docstring)."""

    def __init__(self, *, tokens, sessions: SessionTable, controllers: dict[int, PaceController],
                 metrics=None) -> None:
        self._tokens = tokens  # read only: each device's lanes (pace()) and holders
        self._sessions = sessions
        self._controllers = controllers  # device -> its controller (co-run devices only)
        self._metrics = metrics
        self._boards: dict[int, PaceBoardWriter] = {}
        self._dir: str | None = None
        self._open: dict[str, tuple[int, bool]] = {}  # higher-class session -> (duty at grant, lower active)
        self._duty_shown: dict[int, int] = {}  # device -> the duty the gauge shows

    # ---------------------------------------------------------------- life

    def start(self, socket_path: str | None, state_dir: str) -> None:
        """Create ``<socket dir>/pace/dev<N>`` for each co-run device (the state dir over tcp)."""
        if not self._controllers:
            return
        if self._metrics is not None:  # each co-run device's series from the start: 0 changes yet
            for device in self._controllers:
                self._metrics.pace_changes.labels(str(device))
        base = os.path.dirname(socket_path) if socket_path else state_dir
        directory = os.path.join(base or ".", PACE_DIR)
        system = os.geteuid() == 0
        try:
            # The socket's group reads the boards (the nodeagent group's where there is no socket).
            gid = (os.stat(socket_path).st_gid if socket_path else runtime.socket_gid()) if system else None
            os.makedirs(directory, mode=0o750 if system else 0o700, exist_ok=True)
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                log.warning("[pace] %s is not a directory of this daemon's user; lower classes are paced by "
                            "MPS priority alone", directory)
                return
            if gid is not None:
                os.chown(directory, 0, gid)
            for device in self._controllers:
                self._boards[device] = PaceBoardWriter(os.path.join(directory, f"dev{device}"),
                                                       mode=0o640 if system else 0o600, gid=gid)
        except (OSError, PaceBoardError) as exc:
            log.warning("[pace] cannot prepare the pace boards in %s (%s); lower classes are paced by MPS "
                        "priority alone", directory, getattr(exc, "strerror", None) or exc)
            for board in self._boards.values():
                board.close()
            self._boards.clear()
            return
        self._dir = directory
        log.info("[pace] co-run devices=%s boards=%s", sorted(self._boards), directory)

    def close(self) -> None:
        """Remove the boards, and their emptied directory (a clean stop leaves nothing)."""
        for board in self._boards.values():
            board.close()
        self._boards.clear()
        if self._dir is not None:
            runtime.remove_empty_dir(self._dir)
            self._dir = None

    def board_path(self, device: int) -> str:
        """The board a session on ``device`` reads ("" where the device does not co-run)."""
        board = self._boards.get(device)
        return board.path if board is not None else ""

    def controller(self, device: int) -> PaceController | None:
        return self._controllers.get(device)

    # ---------------------------------------------------------------- turns

    def refresh_all(self) -> None:
        """Write every board from its device's lanes and controller (after each loop turn)."""
        for device, board in self._boards.items():
            controller = self._controllers[device]
            duty, period_us = controller.duty_permille, controller.period_us
            if self._metrics is not None and self._duty_shown.get(device) != duty:
                self._duty_shown[device] = duty
                self._metrics.pace_duty.labels(str(device)).set(duty)
            for workload, (present, active) in enumerate(self._tokens.pace(device)):
                board.set(workload, Pace(present, active, duty if active else 1000, period_us))

    # ---------------------------------------------------------------- slices

    def granted(self, s: Session) -> None:
        """``s`` was granted: note the duty and whether a lower class holds, for its slice's end."""
        controller = self._controllers.get(s.device)
        if controller is None or s.workload is Workload.BEST_EFFORT:
            return
        self._open[s.id] = (controller.duty_permille, self._lower_active(s))

    def slice_ended(self, s: Session, held_s: float) -> None:
        """``s``'s slice of ``held_s`` ended: the controller learns from it."""
        opened = self._open.pop(s.id, None)
        controller = self._controllers.get(s.device)
        if opened is None or controller is None:
            return
        duty, lower_active = opened
        controller.set_slo(s.slo_ms / 1000.0 if s.slo_ms else None)
        if controller.observe(held_s, duty, lower_active or self._lower_active(s)):
            log.info("[pace] device=%d duty_permille=%d (slice %.2f ms, reference %s)", s.device,
                     controller.duty_permille, held_s * 1e3,
                     "%.2f ms" % (controller.reference_s() * 1e3) if controller.reference_s() else "unknown")
            if self._metrics is not None:
                self._metrics.pace_changes.labels(str(s.device)).inc()

    def forget(self, s: Session) -> None:
        self._open.pop(s.id, None)

    def _lower_active(self, s: Session) -> bool:
        holders = self._tokens.holders(s.device)
        return any(self._sessions[h].workload > s.workload for h in holders if h in self._sessions)
