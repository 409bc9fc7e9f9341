"""Which CUDA device of this process is a session's GPU, which the daemon names by UUID
(``welcome.device_uuid``). Detail: docs/internals.md.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from client_lib.errors import NodeAgentError

_UUID_PREFIXES = ("GPU-", "MIG-")


class DeviceNotVisibleError(NodeAgentError):
    """The session's GPU is not among the devices this process can see."""


def ordinal_in_visible(uuid: str, visible: str | None) -> int | None:
    """The CUDA ordinal of GPU ``uuid`` in a process whose ``CUDA_VISIBLE_DEVICES`` is
    ``visible``, when that decides it: the position of the first entry naming it (CUDA
    accepts a unique prefix of a UUID). None when the variable cannot tell: unset, or
    indices (which are CUDA's own numbers, not NVML's). DeviceNotVisibleError when it
    lists UUIDs and not this one, or is empty (no device visible)."""
    if visible is None:
        return None
    entries = [entry.strip() for entry in visible.split(",")]
    if not entries[0].startswith(_UUID_PREFIXES):
        if entries[0] == "":
            raise DeviceNotVisibleError(f"GPU {uuid} is not visible to this process: CUDA_VISIBLE_DEVICES is "
                                        "empty (no GPU visible); unset it or add the GPU's UUID")
        return None
    for ordinal, entry in enumerate(entries):
        if not entry.startswith(_UUID_PREFIXES):
            break  # CUDA stops reading the list at the first entry it cannot parse
        if len(entry) > len("GPU-") and uuid.startswith(entry):
            return ordinal
    raise DeviceNotVisibleError(f"GPU {uuid} is not visible to this process: CUDA_VISIBLE_DEVICES={visible} "
                                "does not name it; add its UUID, or unset the variable")


def torch_uuids() -> list[str]:
    """``GPU-<uuid>`` of every CUDA device torch sees, in ordinal order (initialises CUDA)."""
    import torch

    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count())]


def cuda_ordinal(uuid: str, environ: Mapping[str, str] | None = None,
                 list_uuids: Callable[[], list[str]] = torch_uuids) -> int:
    """The CUDA ordinal of GPU ``uuid`` in this process: from ``CUDA_VISIBLE_DEVICES`` when
    it lists UUIDs, else the position of ``uuid`` among ``list_uuids()`` (torch's devices).
    DeviceNotVisibleError if this process cannot see it."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    found = ordinal_in_visible(uuid, visible)
    if found is not None:
        return found
    try:
        uuids = list_uuids()
    except ImportError as exc:
        raise DeviceNotVisibleError(f"cannot tell which CUDA device is GPU {uuid}: {exc} (install torch, or set "
                                    "CUDA_VISIBLE_DEVICES to the GPU's UUID)") from exc
    if uuid in uuids:
        return uuids.index(uuid)
    raise DeviceNotVisibleError(f"GPU {uuid} is not among the {len(uuids)} CUDA device(s) this process sees "
                                f"(CUDA_VISIBLE_DEVICES={visible if visible is not None else '(unset)'})")
