"""Pacing lower classes on co-run devices: the pace boards and their controllers.

On a co-run device (:mod:`sharing.corun`) every class has its own token, so an
inference request is granted at once beside a training holder. This
component tells the lower classes how hard to hold back while a higher class
holds: one pace board per device (:mod:`client_lib.pace`, a 64-byte file
clients map read-only, named in their welcome), written after every loop turn
from the scheduler's lanes and one :class:`sharing.corun.PaceController` per
higher-class session, fed by that session's slices and the queue it says it
has (:func:`sharing.corun.board_slot` combines them).

A part of :class:`nodeagent.daemon.tokens.Tokens`, which owns the schedulers,
offers its commands and hands it, call by call, the schedulers it reads; given
the session table to read, a controller factory, the clock and the metrics.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Callable, Iterable, Sequence

from client_lib.pace import Pace, PaceBoardError, PaceBoardWriter
from nodeagent import runtime
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import SessionState, Workload
from sharing.corun import PaceController, board_slot

log = logging.getLogger("nodeagent.daemon.pace")

PACE_DIR = "pace"


class Pacing:
    """Boards and controllers of the co-run devices (see the module docstring)."""

    def __init__(self, *, sessions: SessionTable, devices: Iterable[int],
                 new_controller: Callable[[], PaceController], clock: Callable[[], float], metrics=None) -> None:
        self._sessions = sessions
        self._devices = tuple(devices)  # the co-run devices
        self._new_controller = new_controller
        self._clock = clock
        self._metrics = metrics
        self._boards: dict[int, PaceBoardWriter] = {}
        self._dir: str | None = None
        # One controller per higher-class session (inference, and training for best-effort), fed by
        # its own slices; a holder with none (a server-side queue's sub-session) uses its device's.
        self._controllers: dict[str, PaceController] = {}
        self._on_device: dict[int, dict[str, tuple[Workload, PaceController]]] = {d: {} for d in self._devices}
        self._shared = {d: new_controller() for d in self._devices}
        self._duty_shown: dict[int, int] = {}  # device -> the duty the gauge shows
        # A board is written again only when something it depends on may have changed: a
        # controller was told something (dirty), the lanes or holders differ, or a deadline passed.
        self._dirty: set[int] = set(self._devices)
        self._seen: dict[int, tuple] = {}  # device -> (lanes, holders) its board was last written from
        self._due: dict[int, float] = {}  # device -> its controllers' soonest deadline at that write

    # ---------------------------------------------------------------- life

    def start(self, socket_path: str | None, state_dir: str) -> None:
        """Create ``<socket dir>/pace/dev<N>`` for each co-run device (the state dir over tcp); a board
        the last daemon left is reused in place or replaced by rename, never truncated under its readers."""
        if not self._devices:
            return
        if self._metrics is not None:  # each co-run device's series from the start: 0 changes yet
            for device in self._devices:
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
            for device in self._devices:
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

    def controller(self, session: str) -> PaceController | None:
        """``session``'s controller (None: it has none yet, or is of the lowest class)."""
        return self._controllers.get(session)

    # ---------------------------------------------------------------- turns

    def refresh_all(self, schedulers: Sequence) -> None:
        """Write every board from its device's lanes (``schedulers``, read only) and controllers
        (after each loop turn)."""
        if not self._boards:
            return
        now = self._clock()
        for device, board in self._boards.items():
            scheduler = schedulers[device]
            lanes = scheduler.pace()
            holders = scheduler.holders()
            seen = (lanes, holders, scheduler.waiting_count())
            due = self._due.get(device)
            if device not in self._dirty and self._seen.get(device) == seen and (due is None or now < due):
                continue
            self._dirty.discard(device)
            self._seen[device] = seen
            wants = []  # (class, want, holding) of each higher-class session with a controller
            due = None
            for sid, (workload, controller) in self._on_device[device].items():
                holding = sid in holders
                in_line = holding or not controller.queue_steered or \
                    scheduler.state(sid) is SessionState.WAITING
                wants.append((workload, self._counted(device, controller.want, now, in_line), holding))
                deadline = controller.next_deadline()
                if deadline is not None and (due is None or deadline < due):
                    due = deadline
            if due is None:
                self._due.pop(device, None)
            else:
                self._due[device] = due
            for holder in holders:  # a holder with no controller of its own
                if holder not in self._controllers:
                    workload = _lane_workload(scheduler, holder)
                    if workload is not None:
                        wants.append((workload, self._shared[device].want(now), True))
            period_us = self._shared[device].period_us
            for workload, (present, active) in enumerate(lanes):
                if workload == Workload.BEST_EFFORT and len(scheduler) <= lanes[-1][0]:
                    board.set(workload, Pace(present, active, 1000, period_us))  # nobody of it is there
                    continue
                slot = board_slot(present, ((w, h) for k, w, h in wants if k < workload), period_us)
                board.set(workload, Pace(present, slot.active, slot.duty_permille, period_us, slot.armed))
                if workload == Workload.TRAINING and self._metrics is not None \
                        and self._duty_shown.get(device) != slot.duty_permille:
                    self._duty_shown[device] = slot.duty_permille
                    self._metrics.pace_duty.labels(str(device)).set(slot.duty_permille)

    def next_deadline(self) -> float | None:
        """When a controller's want may change with nothing said (a waiting request's projected
        latency reaching its target, a held pause's gap ending)."""
        return min(self._due.values()) if self._due else None  # as of the last write (after every turn)

    # ---------------------------------------------------------------- slices

    def told_queue(self, s: Session, now: float, waiting: int | None, oldest_wait_ms: float | None,
                   released: bool = False) -> None:
        """``s`` said with a slice request (or, ``released``, a release) how many of its requests
        wait (None: nothing; see :meth:`sharing.corun.PaceController.tell_queue`)."""
        controller = self._controller_for(s)
        if controller is None:
            return
        self._counted(s.device, controller.tell_queue, now, waiting,
                      None if oldest_wait_ms is None else oldest_wait_ms / 1000.0, released=released)
        self._dirty.add(s.device)

    def granted(self, s: Session, now: float, scheduler) -> None:
        """``s`` was granted (``scheduler``: its device's, read only): its controller notes the duty
        and whether a lower class holds."""
        controller = self._controller_for(s)
        if controller is not None:
            controller.set_slo(s.slo_ms / 1000.0 if s.slo_ms else None)
            self._counted(s.device, controller.slice_started, now, self._lower_active(s, scheduler.holders()))
            self._dirty.add(s.device)

    def slice_ended(self, s: Session, now: float, scheduler) -> None:
        """``s``'s slice ended at ``now`` (``scheduler``: its device's, read only): its controller learns."""
        controller = self._controllers.get(s.id)
        if controller is None:
            return
        self._dirty.add(s.device)
        if self._counted(s.device, controller.slice_ended, now, self._lower_active(s, scheduler.holders())):
            log.info("[pace] device=%d session=%s duty_permille=%d (reference %s)", s.device, s.id,
                     controller.duty_permille,
                     "%.2f ms" % (controller.reference_s() * 1e3) if controller.reference_s() else "unknown")

    def forget(self, s: Session) -> None:
        """``s``'s slice ended uncounted; a session that is gone loses its controller."""
        if s.id not in self._sessions:
            self.drop(s.id)

    def drop(self, sid: str) -> None:
        """``sid`` left its device: its controller goes."""
        if self._controllers.pop(sid, None) is not None:
            for device, members in self._on_device.items():
                if members.pop(sid, None) is not None:
                    self._dirty.add(device)

    # ---------------------------------------------------------------- internals

    def _controller_for(self, s: Session) -> PaceController | None:
        return self.joined(s.device, s.id, s.workload)

    def joined(self, device: int, sid: str, workload: Workload) -> PaceController | None:
        """``sid`` of class ``workload`` is on ``device``: a higher-class session gets its controller."""
        if device not in self._on_device or workload is Workload.BEST_EFFORT:
            return None
        controller = self._controllers.get(sid)
        if controller is None:
            controller = self._controllers[sid] = self._new_controller()
            self._on_device[device][sid] = (workload, controller)
            self._dirty.add(device)
        return controller

    def _counted(self, device: int, step: Callable, *args, **kwargs):
        """``step`` of a controller, its duty changes counted in the metrics."""
        controller = step.__self__
        before = controller.changes
        result = step(*args, **kwargs)
        if controller.changes != before and self._metrics is not None:
            self._metrics.pace_changes.labels(str(device)).inc(controller.changes - before)
        return result

    def _lower_active(self, s: Session, holders: tuple[str, ...]) -> bool:
        """Whether a session of a lower class than ``s`` is among ``holders``."""
        return any(self._sessions[h].workload > s.workload for h in holders if h in self._sessions)


def _lane_workload(scheduler, sid: str) -> Workload | None:
    """The class of the lane ``sid`` takes turns in on a co-run device (None: not co-run, or not there)."""
    if not scheduler.corun or sid not in scheduler:
        return None
    return Workload(scheduler.lanes().index(scheduler.lane_of(sid)))
