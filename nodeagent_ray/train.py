"""What a Ray Train worker on a lent device runs (:class:`LentWorker`), so that a reclaim, a
resize or a crash costs no step of work: it parks or hands off its state at ``step_done``.
Its three cases (reclaim, resize, checkpoint) and a driver's outline: docs/internals.md.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
import time

import torch

from client_lib import Client
from client_lib.torch import Yielder

log = logging.getLogger("nodeagent_ray.train")

__all__ = ["HandOff", "LentWorker"]

ENV_BORROWER = "NODEAGENT_BORROWER"
_STATE_RE = re.compile(r"state-(\d{9})\.pt$")
_WAIT_ROUND_S = 0.25  # while waiting for a resize: how often a stop is looked for (one small all-reduce)
_TRACKER_TIMEOUT_S = 2.0


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DistributedDataParallel keeps the model in .module


class HandOff:
    """A job's training state on storage every worker reaches, one file per step
    (``state-<step>.pt``, written whole and renamed into place), the newest ``keep`` kept."""

    def __init__(self, directory: str, keep: int = 3) -> None:
        self.directory = directory
        self.keep = max(1, int(keep))
        os.makedirs(directory, exist_ok=True)

    def steps(self) -> list[int]:
        out = []
        for path in glob.glob(os.path.join(self.directory, "state-*.pt")):
            m = _STATE_RE.search(path)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def write(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
        path = os.path.join(self.directory, f"state-{step:09d}.pt")
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save({"step": step, "model": _unwrapped(model).state_dict(), "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, path)
        for old in self.steps()[:-self.keep]:
            try:
                os.unlink(os.path.join(self.directory, f"state-{old:09d}.pt"))
            except FileNotFoundError:
                pass
        return path

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the newest state into ``model`` and ``optimizer``; returns its step (0: none yet)."""
        for step in reversed(self.steps()):
            path = os.path.join(self.directory, f"state-{step:09d}.pt")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # removed, cut short or not ours: try the one before (torch raises many kinds)
                log.warning("[handoff] %s unreadable (%s); trying an older one", path, exc)
                continue
            _unwrapped(model).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            return int(state["step"])
        return 0


class LentWorker:
    """One training worker's session with its node's daemon, and its part in hand-offs."""

    def __init__(self, job: str, handoff_dir: str, *, checkpoint_every: int = 0, resize_wait_s: float = 15.0,
                 tracker=None, rank: int | None = None, world_size: int | None = None,
                 client: Client | None = None, endpoint: str | None = None) -> None:
        self.job = job
        self.handoff = HandOff(handoff_dir)
        self.checkpoint_every = int(checkpoint_every)
        self.resize_wait_s = float(resize_wait_s)
        if rank is None or world_size is None:  # inside Ray Train: its context and the job's tracker
            import ray.train

            from nodeagent_ray.actors import job_tracker
            ctx = ray.train.get_context()
            rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
            tracker = tracker if tracker is not None else job_tracker(job)
        self.rank, self.world_size, self.tracker = rank, world_size, tracker
        borrower = os.environ.get(ENV_BORROWER) or job
        self.client = client or Client(f"{job}/rank{rank}", workload="training", borrower=borrower,
                                       endpoint=endpoint)
        self.step = 0
        self.parks = 0  # suspensions this process went through and resumed from
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._yielder: Yielder | None = None
        self._slice = None
        self._acked_epoch = 0
        self._pending: list = []  # the tracker's answers to step_done not read yet

    # ------------------------------------------------------------ lifecycle

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the newest hand-off, take the device's token; returns the step to go on from."""
        self._model, self._optimizer = model, optimizer
        self.step = self.handoff.load(model, optimizer)
        self._yielder = Yielder(None, modules=[model], optimizers=[optimizer])
        self.client.set_suspend_handlers(self._park, self._unpark)
        if self.tracker is not None and self.rank == 0:
            import ray
            self._acked_epoch = ray.get(self.tracker.started.remote(self.world_size, self.step, os.getpid()))
        self._slice = self.client.slice()
        self._slice.__enter__()
        log.info("[train] job=%s rank=%d/%d session=%s starts at step %d", self.job, self.rank, self.world_size,
                 self.client.session_id, self.step)
        return self.step

    def step_done(self, step: int) -> bool:
        """After each optimizer step, on every rank. Takes turns, parks on a reclaim, hands off
        before a resize. True when the job is to stop (every rank gets True at the same step)."""
        self.step = step
        self.client.yield_point()
        if self.rank == 0 and self.checkpoint_every and step % self.checkpoint_every == 0:
            self._hand_off("checkpoint")
        pause, stop = self._agree(*self._read_notices(step))
        if stop:
            return True
        if pause:
            self._wait_for_resize()
        return False

    def close(self) -> None:
        if self._slice is not None:
            held, self._slice = self._slice, None
            held.__exit__(None, None, None)
        self.client.set_suspend_handlers(None, None)
        if self.tracker is not None and self.rank == 0:
            # Not the job's end: the other ranks may still be returning, and Ray Train counts a rank
            # whose loan node is stopped before it returns as a failure. The driver ends the job
            # once fit() has returned (nodeagent_ray.actors.finish_job), or by going away.
            self.tracker.workers_done.remote(self.step)
        self.client.close()

    # ------------------------------------------------------------ notices

    def _read_notices(self, step: int) -> tuple[bool, bool]:
        """Rank 0: report this step (every step: the tracker counts steps redone from the highest one
        it heard of) and read the newest answer that has arrived, without waiting for any."""
        if self.tracker is None or self.rank != 0:
            return False, False
        import ray
        self._pending.append(self.tracker.step_done.remote(step, self.world_size))
        ready, _ = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        if not ready:
            return False, False
        self._pending = [ref for ref in self._pending if ref not in ready]
        answers = ray.get(ready)
        epoch = max(a["pause_epoch"] for a in answers)
        pause = epoch > self._acked_epoch
        if pause:
            self._acked_epoch = epoch
        return pause, any(a["stop"] for a in answers)

    def _agree(self, pause: bool, stop: bool) -> tuple[bool, bool]:
        """Every rank learns rank 0's notices in the same step."""
        if self.world_size <= 1 or not torch.distributed.is_initialized():
            return pause, stop
        flags = torch.tensor([int(pause), int(stop)], dtype=torch.int64)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def _wait_for_resize(self) -> None:
        """Hand off, then wait to be stopped by the resize; go on if it does not come within
        ``resize_wait_s``, or at once when the job is asked to stop meanwhile (it trains on to
        the stop step). Every rank waits the same number of rounds and learns a stop in the same one."""
        if self.rank == 0:
            self._hand_off("resize", sync=True)
        log.info("[train] job=%s rank=%d waits for a resize at step %d", self.job, self.rank, self.step)
        for _ in range(max(1, math.ceil(self.resize_wait_s / _WAIT_ROUND_S))):
            self.client.yield_point()  # still answers yields and suspends while it waits
            time.sleep(_WAIT_ROUND_S)
            _, stop = self._agree(False, self._stop_asked())
            if stop:
                log.info("[train] job=%s rank=%d asked to stop while waiting for a resize: training on to it",
                         self.job, self.rank)
                return
        log.info("[train] job=%s rank=%d no resize within %.0f s: training on", self.job, self.rank,
                 self.resize_wait_s)

    def _stop_asked(self) -> bool:
        """Rank 0, while waiting for a resize: has the job been asked to stop? (False when the tracker
        does not answer in time: the next round asks again.)"""
        if self.tracker is None or self.rank != 0:
            return False
        import ray
        try:
            return bool(ray.get(self.tracker.stop_asked.remote(), timeout=_TRACKER_TIMEOUT_S))
        except Exception as exc:  # busy or restarting: the wait stays bounded by resize_wait_s
            log.warning("[train] job=%s the tracker did not say whether to stop: %s", self.job, exc)
            return False

    def _hand_off(self, why: str, sync: bool = False) -> None:
        self.handoff.write(self.step, self._model, self._optimizer)
        if self.tracker is not None:
            ref = self.tracker.handed_off.remote(self.step, why, self._acked_epoch if why == "resize" else 0)
            if sync:
                import ray
                ray.get(ref)

    # ------------------------------------------------------------ suspend handlers

    def _park(self) -> int:
        """The daemon wants the device back: hand the state off, then park it in host memory."""
        self._hand_off("reclaim")
        if self.tracker is not None:
            self.tracker.parked.remote(self.step, os.getpid())
        self.parks += 1
        return self._yielder.park()

    def _unpark(self) -> None:
        self._yielder.unpark()
        if self.tracker is not None:
            self.tracker.unparked.remote(self.step, os.getpid())
        log.info("[train] job=%s rank=%d resumed in-process at step %d", self.job, self.rank, self.step)
