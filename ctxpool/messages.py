"""Messages between the daemon's pool supervisor and its worker processes, and the events the
pool hands the daemon: msgspec Structs, MessagePack on a ``multiprocessing`` pipe, never pickle;
one reply per request, so at most one message is in flight per worker. Detail: docs/internals.md.
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

from client_lib.protocol import ModelInfo, TensorRef


class WeightEntry(msgspec.Struct, kw_only=True, frozen=True):
    """Where one parameter or buffer lies in a model's weight segment."""

    kind: str  # "parameter" | "buffer"
    dtype: str  # torch dtype name without "torch."
    shape: list[int]
    offset: int  # bytes from the segment's start, 64-byte aligned
    nbytes: int


class WeightManifest(msgspec.Struct, kw_only=True, frozen=True):
    """Every parameter and buffer of one model, in ONE shared-memory segment.

    Tied tensors (one Parameter under two names) have two entries with the
    same offset; they are stored once and rebound to one object."""

    segment: str
    total_bytes: int
    entries: dict[str, WeightEntry]


class PeerIdentity(msgspec.Struct, kw_only=True, frozen=True):
    """The kernel-verified user of a peer (SO_PEERCRED, groups from /proc): a file it
    names is opened with these rights, never the worker's (see :mod:`ctxpool.peer_open`)."""

    uid: int
    gid: int
    groups: list[int] = []


class ModelSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What :meth:`ctxpool.pool.WorkerPool.register_model` registers.

    ``example_input`` lies in shared-memory segments that the caller keeps
    (neither closed nor unlinked) until the model is unregistered or the pool
    shut down: replacement workers attach the model again and run it once."""

    name: str
    factory: str  # "package.module:callable", importable by the workers
    weights: Optional[str] = None  # safetensors or torch state-dict file; None: the factory's own init
    example_input: list[TensorRef] = []
    devices: Optional[list[int]] = None  # None: every device of the pool
    reader: Optional[PeerIdentity] = None  # whose rights open ``weights``; None: the worker's own


# ------------------------------------------------------------ daemon -> worker


class ToWorker(msgspec.Struct, tag_field="op", kw_only=True, frozen=True):
    """Base of what the supervisor sends a worker."""


class Prepare(ToWorker, tag="prepare"):
    """Build the model, load and check its weights, place them in a new
    segment named ``segment`` (the daemon names it so that it can unlink it
    whatever happens to the worker)."""

    model: str
    factory: str
    weights: Optional[str]
    segment: str
    segment_group: Optional[int] = None
    reader: Optional[PeerIdentity] = None  # open ``weights`` with these rights; None: the worker's own


class Attach(ToWorker, tag="attach"):
    """Build the model, rebind it to the shared weights, add it to the engine
    (which runs ``example_input`` once to plan its layer groups)."""

    model: str
    factory: str
    manifest: WeightManifest
    example_input: list[TensorRef]


class Drop(ToWorker, tag="drop"):
    model: str


class Run(ToWorker, tag="run"):
    """Run ``model`` on ``inputs``. With ``owner_uid`` (the requester's verified uid), input
    segments must belong to that uid (unless ``any_inputs``: the requester is the daemon's ROOT)
    and the output segment is created owned by it."""

    request_id: int
    model: str
    inputs: list[TensorRef]
    owner_uid: Optional[int] = None
    any_inputs: bool = False


class Shutdown(ToWorker, tag="shutdown"):
    """Finish nothing further and exit 0."""


# ------------------------------------------------------------ worker -> daemon


class FromWorker(msgspec.Struct, tag_field="op", kw_only=True, frozen=True):
    """Base of what a worker sends the supervisor."""


class Ready(FromWorker, tag="ready"):
    """The engine is up and warm (a matmul and a conv ran, the pool is reserved)."""

    pid: int
    warm_up_ms: float


class Prepared(FromWorker, tag="prepared"):
    model: str
    manifest: WeightManifest
    model_bytes: int
    layers: int  # leaf modules holding parameters or buffers


class Attached(FromWorker, tag="attached"):
    model: str
    model_bytes: int
    layers: int  # as the engine's plan counts them
    groups: int  # layer groups of the pipelined swap-in
    resident: list[str] = []  # models on the device now, as the engine keeps them


class Dropped(FromWorker, tag="dropped"):
    model: str


class Rejected(FromWorker, tag="rejected"):
    """Prepare or Attach failed; the worker left nothing of the model behind."""

    model: str
    step: str  # "prepare" | "attach"
    code: str  # client_lib.protocol.ErrorCode
    message: str


class Done(FromWorker, tag="done"):
    """Outputs lie in a new segment the worker made and closed; the receiver owns it."""

    request_id: int
    outputs: list[TensorRef]
    swap: str  # "ready" | "pipelined" | "sequential"
    run_ms: float
    resident: list[str] = []  # models on the device after this run, as the engine keeps them
    single: bool = False  # the model returned one tensor, not a tuple or list


class Failed(FromWorker, tag="failed"):
    """The request failed; the worker survived and serves the next one."""

    request_id: int
    code: str
    message: str


class Dying(FromWorker, tag="dying"):
    """Last frame of a worker that is about to exit because of an exception."""

    reason: str


# ------------------------------------------------------------ pool -> daemon
# What WorkerPool.on_readable (and unregister_model) return to the daemon loop.


class WorkerReady(msgspec.Struct, frozen=True):
    """A worker is warm, has every registered model attached, and takes requests."""

    device: int
    pid: int
    warm_up_ms: float


class WorkerReplaced(msgspec.Struct, frozen=True):
    """A worker died. ``new_pid`` is None when the device's restart budget is spent."""

    device: int
    old_pid: int
    new_pid: Optional[int]
    lost_request_ids: list[int]
    reason: str = ""


class ModelReady(msgspec.Struct, frozen=True):
    name: str
    info: ModelInfo


class ModelFailed(msgspec.Struct, frozen=True):
    """The registration failed and left nothing behind (segment unlinked, workers told to drop it)."""

    name: str
    code: str
    message: str


class RequestDone(msgspec.Struct, frozen=True):
    """The outputs lie in a segment the receiver now owns (and must unlink)."""

    request_id: int
    device: int
    outputs: list[TensorRef]
    swap: str
    run_ms: float
    single: bool = False  # the model returned one tensor, not a tuple or list


class RequestFailed(msgspec.Struct, frozen=True):
    request_id: int
    code: str
    message: str


PoolEvent = Union[WorkerReady, WorkerReplaced, ModelReady, ModelFailed, RequestDone, RequestFailed]


class WorkerSnapshot(msgspec.Struct, kw_only=True):
    pid: int
    state: str  # ctxpool.procs.WorkerState value
    models: list[str]  # attached
    resident: list[str]  # on the device, as the worker last reported
    request_id: Optional[int] = None


class DeviceStatus(msgspec.Struct, kw_only=True):
    available: bool  # False once the restart budget is spent and no worker is left
    queued: int  # requests waiting for a worker
    restarts: int  # workers replaced so far
    gave_up: str = ""  # why replacement stopped, once the restart budget is spent


ToWorkerMessage = Union[Prepare, Attach, Drop, Run, Shutdown]
FromWorkerMessage = Union[Ready, Prepared, Attached, Dropped, Rejected, Done, Failed, Dying]

# What each side encodes and decodes with (msgspec.DecodeError / ValidationError if malformed).
encode = msgspec.msgpack.Encoder().encode
decode_to_worker = msgspec.msgpack.Decoder(ToWorkerMessage).decode
decode_from_worker = msgspec.msgpack.Decoder(FromWorkerMessage).decode
