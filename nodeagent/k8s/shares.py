"""What the device plugin tells the kubelet, decided from what the daemon reports, pure: each
device becomes ``shares`` kubelet devices (``<uuid>::<n>``), all healthy or all not. Detail:
docs/internals.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SEPARATOR = "::"
MAX_ID_CHARS = 63  # the API's bound on a device id: "GPU-" + 36 + "::" + 4 digits fit
LENT_CHOICES = ("unhealthy", "healthy")


class AllocationError(ValueError):
    """An Allocate the plugin must refuse (the message names the device and why)."""


@dataclass(frozen=True)
class Gpu:
    """One daemon device as the plugin sees it."""

    index: int
    uuid: str
    backend: str  # cuda | cpu
    capacity_mb: int  # what admission lets sessions declare on it in all (status: memory_capacity_mb)
    state: str | None = None  # lifecycle: FREE | RUN | PROTECT | LENT | DRAINING; None: not known
    borrower: str | None = None
    lost: bool = False  # NVML reported it lost (learnt from the daemon's events)
    lost_reason: str = ""


@dataclass(frozen=True)
class NodeView:
    """The daemon's devices at one moment. ``reachable`` False: the daemon did not answer,
    and ``gpus`` are the last ones it reported."""

    reachable: bool = False
    gpus: tuple[Gpu, ...] = ()
    problem: str = ""  # why it is not reachable, for the log


@dataclass(frozen=True)
class ShareDevice:
    id: str
    health: str


@dataclass(frozen=True)
class AllocationSettings:
    """What Allocate gives a container besides the devices: the daemon's socket as pods see it."""

    endpoint: str  # NODEAGENT_ENDPOINT in the container: ipc://<container_socket_dir>/<socket file>
    host_socket_dir: str  # the daemon's socket directory on the host (a hostPath)
    container_socket_dir: str  # where the container sees it
    gpu_access: str = "env"  # env | cdi | none


@dataclass
class ContainerAllocation:
    """What one container gets: environment, a bind mount of the daemon's socket directory,
    and CDI device names (``gpu_access="cdi"``)."""

    envs: dict[str, str]
    mounts: list[tuple[str, str, bool]]  # (container_path, host_path, read_only)
    cdi_devices: list[str]


def share_id(uuid: str, n: int) -> str:
    return f"{uuid}{SEPARATOR}{n}"


def parse_share_id(device_id: str) -> tuple[str, int]:
    """``(uuid, n)`` of ``<uuid>::<n>``; ValueError for anything else."""
    uuid, sep, n = device_id.rpartition(SEPARATOR)
    if not sep or not uuid or not n.isdigit():
        raise ValueError(f"{device_id!r} is not a device id of this plugin (<uuid>{SEPARATOR}<n>)")
    return uuid, int(n)


@dataclass(frozen=True)
class SharePolicy:
    """How the daemon's devices become the kubelet's: ``shares`` per device, the memory each
    share declares (``memory_mb_per_share``: an int, or None for the device's admission capacity
    divided by ``shares``), and whether a lent device's shares are offered."""

    shares: int = 4
    memory_mb_per_share: int | None = None
    lent: str = "unhealthy"

    def __post_init__(self) -> None:
        if isinstance(self.shares, bool) or not isinstance(self.shares, int) or not 1 <= self.shares <= 1000:
            raise ValueError(f"shares must be an integer 1..1000, got {self.shares!r}")
        if self.memory_mb_per_share is not None and self.memory_mb_per_share < 0:
            raise ValueError(f"memory per share must be >= 0 MiB, got {self.memory_mb_per_share}")
        if self.lent not in LENT_CHOICES:
            raise ValueError(f"lent must be one of {', '.join(LENT_CHOICES)}, got {self.lent!r}")

    def health(self, gpu: Gpu, reachable: bool) -> tuple[str, str]:
        """(health, why) of every share of ``gpu``."""
        if not reachable:
            return UNHEALTHY, "the daemon does not answer"
        if gpu.lost:
            return UNHEALTHY, f"lost ({gpu.lost_reason})" if gpu.lost_reason else "lost"
        if gpu.state == "DRAINING":
            return UNHEALTHY, "draining"
        if gpu.state == "LENT" and self.lent == "unhealthy":
            return UNHEALTHY, f"lent to {gpu.borrower}"
        return HEALTHY, gpu.state or "ok"

    def devices(self, view: NodeView) -> list[ShareDevice]:
        """The kubelet's device list for ``view``, in a stable order."""
        out = []
        for gpu in view.gpus:
            health, _ = self.health(gpu, view.reachable)
            out.extend(ShareDevice(share_id(gpu.uuid, n), health) for n in range(self.shares))
        return out

    def memory_mb(self, gpu: Gpu) -> int:
        """What one share of ``gpu`` declares (``memory_mb`` of its sessions), MiB."""
        if self.memory_mb_per_share is not None:
            return self.memory_mb_per_share
        return max(0, gpu.capacity_mb) // self.shares


def preferred(available: list[str], must_include: list[str], size: int) -> list[str]:
    """Which ``size`` of ``available`` ids to give one container: ``must_include`` first, then
    the rest on as few devices as possible (a session runs on one device), preferring the
    device with the most shares free, so that pods spread over the GPUs before they stack.
    Ids that are not this plugin's are passed over."""
    chosen = list(dict.fromkeys(must_include))
    if size <= len(chosen):
        return chosen[:max(size, 0)]
    free: dict[str, list[str]] = {}
    for device_id in dict.fromkeys(available):
        if device_id in chosen:
            continue
        try:
            uuid, _ = parse_share_id(device_id)
        except ValueError:
            continue
        free.setdefault(uuid, []).append(device_id)
    used = []
    for device_id in chosen:
        with contextlib.suppress(ValueError):
            used.append(parse_share_id(device_id)[0])
    need = size - len(chosen)
    # Devices already holding a chosen share first; then the one with the most free shares
    # that holds all that is needed; then the most free shares. Ties: the order given.
    order = sorted(free, key=lambda u: (u not in used, len(free[u]) < need, -len(free[u])))
    for uuid in order:
        take = free[uuid][:need]
        chosen.extend(take)
        need -= len(take)
        if need == 0:
            break
    return chosen


def allocate(device_ids: list[str], view: NodeView, policy: SharePolicy,
             settings: AllocationSettings) -> ContainerAllocation:
    """What a container given ``device_ids`` needs to join the right device's token: the table of
    docs/kubernetes.md (What a container gets), its ``NODEAGENT_*`` variables describing the device
    holding most of the shares (a session is on one device). AllocationError for an id that is not
    one of ours, a device the daemon does not report, or one it reports lost."""
    if not device_ids:
        raise AllocationError("no devices to allocate")
    by_uuid = {gpu.uuid: gpu for gpu in view.gpus}
    counts: dict[str, int] = {}
    for device_id in device_ids:
        try:
            uuid, n = parse_share_id(device_id)
        except ValueError as exc:
            raise AllocationError(str(exc)) from None
        gpu = by_uuid.get(uuid)
        if gpu is None or n >= policy.shares:
            raise AllocationError(f"{device_id} is not a device the daemon reports"
                                  + ("" if view.reachable else f" ({view.problem or 'the daemon does not answer'})"))
        if gpu.lost:
            raise AllocationError(f"{device_id}: device {gpu.index} ({uuid}) is lost"
                                  + (f": {gpu.lost_reason}" if gpu.lost_reason else ""))
        counts[uuid] = counts.get(uuid, 0) + 1
    order = sorted(counts, key=lambda u: (-counts[u], by_uuid[u].index))
    first = by_uuid[order[0]]
    envs = {
        "NODEAGENT_ENDPOINT": settings.endpoint,
        "CUDA_VISIBLE_DEVICES": ",".join(order),
        "NODEAGENT_DEVICE": str(first.index),
        "NODEAGENT_DEVICE_UUID": first.uuid,
        "NODEAGENT_SHARES": str(counts[first.uuid]),
        "NODEAGENT_MEMORY_MB": str(policy.memory_mb(first) * counts[first.uuid]),
    }
    gpus = [u for u in order if by_uuid[u].backend == "cuda"]
    if gpus and settings.gpu_access == "env":
        envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(gpus)
    cdi_devices = [f"nvidia.com/gpu={u}" for u in gpus] if settings.gpu_access == "cdi" else []
    return ContainerAllocation(envs, [(settings.container_socket_dir, settings.host_socket_dir, True)], cdi_devices)


def describe(view: NodeView, policy: SharePolicy) -> dict[int, str]:
    """Device index -> ``health (why)``, for the log line that reports a change."""
    out = {}
    for gpu in view.gpus:
        health, why = policy.health(gpu, view.reachable)
        out[gpu.index] = health if health == HEALTHY else f"{health} ({why})"  # not every FREE/RUN move
    return out
