"""Server-side models from the client's side, for :class:`client_lib.Client`'s ``register_model``
and ``infer``: tensors in and out through shared memory. Detail: docs/internals.md.
"""

from __future__ import annotations

from typing import Any, Sequence

from client_lib import protocol as p
from client_lib import tensors
from client_lib.endpoint import ipc_path

REPLY_MARGIN_S = 5.0  # how long past a request's own timeout the client waits for the daemon's answer


def as_list(inputs: Any) -> list:
    """One tensor or a sequence of them, as a list."""
    if inputs is None:
        return []
    if isinstance(inputs, (list, tuple)):
        return list(inputs)
    return [inputs]


def kind_of(values: Sequence[Any]) -> str:
    if values and not type(values[0]).__module__.startswith("torch"):
        return "numpy"
    return "torch"


class Packed:
    """Inputs packed into a segment this client owns (mode 0600, unless a daemon of
    another non-root user needs the socket's group); unlinked on exit."""

    def __init__(self, values: Sequence[Any], endpoint: str) -> None:
        group = tensors.share_group(ipc_path(endpoint))
        # Reserved: on a full /dev/shm, SharedMemoryFull now rather than SIGBUS while copying.
        self.segment, self.refs = tensors.pack(values, prefix="na-in", group=group, reserve=True)

    def __enter__(self) -> "Packed":
        return self

    def __exit__(self, *exc) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()


def take_outputs(reply: p.InferResult, like: str, single: bool) -> Any:
    """The outputs as tensors or arrays of kind ``like``; the segment is unlinked."""
    out = tensors.take(reply.outputs, like=like)
    return out[0] if single and len(out) == 1 else out
