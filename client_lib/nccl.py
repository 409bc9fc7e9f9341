"""NCCL's communicators through a park (:class:`Communicators`): their device buffers released
with the job's state and restored at the unpark, where PyTorch and NCCL can; else said once.
Detail: docs/internals.md.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("client_lib.nccl")

Groups = Callable[[], list]  # the process groups to consider (a test passes its own)


def nccl_groups() -> list:
    """This process's process groups with an NCCL backend; [] where torch.distributed is not
    initialised (or is not there)."""
    return [g for g in process_groups() if "nccl" in _backend_name(g)]


def process_groups() -> list:
    """Every process group of this process, read from c10d's registry of groups (which has no
    public name); [] where torch.distributed is not initialised, or the registry is not there."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return []
        import torch.distributed.distributed_c10d as c10d

        world = getattr(c10d, "_world", None)
        return list(getattr(world, "pg_group_ranks", {}) or ())
    except Exception as exc:  # an older or newer torch without that registry: nothing to suspend
        log.debug("[nccl] cannot list the process groups: %s", exc)
        return []


def _backend_name(group: Any) -> str:
    try:
        import torch.distributed as dist

        return str(dist.get_backend(group)).lower()
    except Exception:
        return "unknown"


class Communicators:
    """Suspends the NCCL communicators of ``groups()`` at :meth:`suspend` and resumes the same
    ones at :meth:`resume` (see docs/internals.md)."""

    def __init__(self, groups: Groups = nccl_groups) -> None:
        self._groups = groups
        self._suspended: list[Any] = []
        self.note: str | None = None  # why communicators keep their memory here (said once)
        self.released_bytes = 0  # of the last suspend, where the backend reports its memory

    @property
    def suspended(self) -> int:
        return len(self._suspended)

    def suspend(self, device: Any) -> int:
        """Suspend the communicators of every NCCL group on ``device`` (a ``torch.device``); how
        many were. A group whose communicator does not exist yet, or whose backend cannot
        suspend, is left as it is (the reason in :attr:`note`); one that fails to suspend is
        logged and left running. Call with the device idle (after the park's synchronize)."""
        if self._suspended:
            return len(self._suspended)
        self.released_bytes = 0
        for group in self._groups():
            try:
                backend = group._get_backend(device)
            except Exception as exc:
                log.debug("[nccl] group %r has no backend on %s: %s", group, device, exc)
                continue
            if not all(hasattr(backend, name) for name in ("suspend", "resume")):
                if self.note is None:
                    self.note = ("this torch's NCCL backend cannot suspend its communicators (PyTorch 2.12 with NCCL "
                                 "2.29.7 or newer can): NCCL's buffers stay on the device while parked")
                    log.info("[nccl] %s", self.note)
                continue
            before = _memory(backend)
            try:
                backend.suspend()
            except Exception as exc:
                if "not initialized" in str(exc):  # no collective yet on this device: nothing allocated
                    continue
                log.warning("[nccl] suspending a communicator failed (%s): its buffers stay on the device", exc)
                continue
            self._suspended.append(backend)
            after = _memory(backend)
            if before is not None and after is not None:
                self.released_bytes += max(0, before - after)
        if self._suspended:
            log.debug("[nccl] suspended=%d released_bytes=%d", len(self._suspended), self.released_bytes)
        return len(self._suspended)

    def resume(self) -> int:
        """Resume what :meth:`suspend` suspended, in the same order; how many. A failure is raised
        (the job's next collective would fail or hang) after the others were resumed."""
        suspended, self._suspended = self._suspended, []
        failure = None
        for backend in suspended:
            try:
                backend.resume()
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return len(suspended)


def _memory(backend: Any) -> int | None:
    """Device bytes the backend's communicators hold, where it says (``memory_stats``)."""
    try:
        stats = backend.memory_stats()
    except Exception:
        return None
    for key in ("device_bytes", "allocated_bytes", "total_bytes", "bytes"):
        if key in stats:
            return int(stats[key])
    try:
        return sum(int(v) for v in stats.values())
    except (TypeError, ValueError):
        return None
