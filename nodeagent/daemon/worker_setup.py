"""What each device's ctxpool workers start with (:func:`setup_for`) and what admission holds for
them (:func:`worker_shares`): pure functions of explicit inputs, so the arithmetic is tested on its own.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ctxpool.procs import WorkerSetup
from nodeagent import memory
from nodeagent.devices import DeviceInfo, cuda_visible_name

DEVICE_UUID_ENV = "NODEAGENT_DEVICE_UUID"  # every worker: the UUID of its device (a factory may read it)


def worker_env(backend: str, info: DeviceInfo, mps_env: Mapping[str, str] | None = None) -> tuple[dict[str, str], int]:
    """(environment, CUDA ordinal) for a worker of ``info``'s device on ``backend``.

    ``mps_env`` (the device's ``MpsControl.client_env()``) makes the worker an MPS client of the
    device's control daemon, with its default SM share and no memory limit of MPS's own (its budget
    bounds it). On cuda the GPU is the only one the worker sees, by UUID (NVML's index, which the
    devices carry, may differ from CUDA's order: under systemd or Slurm it would name another GPU),
    so its ordinal is 0; a GPU whose UUID NVML did not give is named by its NVML index under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (the order NVML enumerates in)."""
    env = {DEVICE_UUID_ENV: info.uuid, **(mps_env or {})}
    if backend != "cuda":
        return env, info.index  # the cpu engine has no ordinal to choose
    visible = cuda_visible_name(info)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    else:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(info.index)
    return env, 0


def worker_shares(infos: Sequence[DeviceInfo], *, workers: int, context_mb: int, pool_mb: int,
                  resident_mb: int | str, reserve_mb: int,
                  declared_mb: Mapping[int, int]) -> dict[int, memory.WorkerShare]:
    """Each device's worker share: ``resident_mb`` "auto" (:func:`nodeagent.memory.auto_resident_mb`, from
    the device's capacity and what sessions declared), 0 (no bound: not counted) or MiB per worker."""
    shares = {}
    for info in infos:
        if resident_mb == "auto":
            capacity = memory.capacity_mb(info, reserve_mb)
            resident: int | None = memory.auto_resident_mb(capacity, workers, context_mb, pool_mb,
                                                           declared_mb.get(info.index, 0))
        else:
            resident = int(resident_mb) or None
        shares[info.index] = memory.WorkerShare(workers=workers, context_mb=context_mb, pool_mb=pool_mb,
                                                resident_mb=resident)
    return shares


def setup_for(backend: str, info: DeviceInfo, share: memory.WorkerShare,
              mps_env: Mapping[str, str] | None = None) -> WorkerSetup:
    """What the pool starts a worker of ``info``'s device with."""
    env, ordinal = worker_env(backend, info, mps_env)
    budget = None if share.resident_mb is None else share.resident_mb * memory.MiB
    return WorkerSetup(env=env, ordinal=ordinal, memory_budget_bytes=budget)
