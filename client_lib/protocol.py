"""Wire types of the nodeagent protocol: the one definition both sides import, with their bounds.
A new field goes at the end of its struct with a default (a minor bump). Encoding and decoding
live in :mod:`client_lib.codec`. Detail: docs/internals.md; the contract: docs/protocol.md.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

import msgspec

from client_lib.limits import MAX_DEADLINE_MS, MAX_NAME_CHARS, MAX_TENSORS, MAX_WEIGHT, MODEL_NAME_PATTERN

PROTOCOL_VERSION: tuple[int, int] = (2, 7)
"""(major, minor) of the wire protocol spoken by this copy of client_lib. What each minor
added is listed in docs/protocol.md (Versioning)."""

Workload = Literal["inference", "training", "best-effort"]
WORKLOADS: tuple[str, ...] = ("inference", "training", "best-effort")
"""Workload classes, highest priority first."""

RequestId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # fits a signed 64-bit integer: every peer holds it
HostBytes = Annotated[int, msgspec.Meta(ge=0, le=2**53)]  # bytes of host memory a client reports
Waiting = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # 2.7: requests a service says wait
WaitMs = Annotated[float, msgspec.Meta(ge=0.0, le=3_600_000.0)]  # 2.7: how long its oldest has waited
Uid = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 2)]  # a user id ((uid_t) -1 is none)
# Bounds a value of the right type must keep: a frame that breaks one is answered E_INVALID
# (client_lib.codec), one of the wrong type or shape E_BAD_REQUEST.
Weight = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_WEIGHT)]  # a fair-share weight
DeadlineMs = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_DEADLINE_MS)]  # a deadline, timeout or SLO
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
Borrower = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS, pattern=r"\S")]  # not blank
ModelName = Annotated[str, msgspec.Meta(pattern=MODEL_NAME_PATTERN)]


class ErrorCode:
    """Stable error codes. Clients match on these strings; never rename one."""

    BAD_REQUEST = "E_BAD_REQUEST"  # not MessagePack, wrong shape or types, unknown op, oversized
    PROTOCOL = "E_PROTOCOL"  # protocol major version the daemon cannot speak
    NO_SESSION = "E_NO_SESSION"  # request needs a session and this peer has none (or it was lost)
    NOT_HOLDER = "E_NOT_HOLDER"  # release of a grant this session does not hold
    DEVICE = "E_DEVICE"  # no such device, or the device cannot take the session
    INVALID = "E_INVALID"  # well-formed request with a value out of range (weight <= 0, ...)
    SHUTTING_DOWN = "E_SHUTTING_DOWN"  # the daemon is stopping and takes no new work
    NO_MEMORY = "E_NO_MEMORY"  # declared memory does not fit the device
    PARTITION = "E_PARTITION"  # an MPS partition that cannot be planned (shares over 100, below the minimum)
    FORBIDDEN = "E_FORBIDDEN"  # the peer may not act on that session (another user's, or unverifiable)
    # 1.1: server-side models (ctxpool)
    NO_MODEL = "E_NO_MODEL"  # no model registered under that name
    MODEL = "E_MODEL"  # registration failed: bad factory path, missing weights file, shape mismatch
    INFERENCE = "E_INFERENCE"  # the model raised; the worker survived and serves the next request
    WORKER_DEAD = "E_WORKER_DEAD"  # the worker running the request died; a replacement serves the next one
    UNAVAILABLE = "E_UNAVAILABLE"  # no workers on this daemon or device (ctxpool off, or none started yet)
    # 1.1: cluster placement
    STATE = "E_STATE"  # the device's lifecycle state does not allow it (lend while inference runs, ...)
    INTERNAL = "E_INTERNAL"  # a bug in the daemon; the request changed nothing
    # 1.2
    TIMEOUT = "E_TIMEOUT"  # the request did not finish within its timeout_ms (a hung worker is replaced)
    CUDA_TOO_EARLY = "E_CUDA_TOO_EARLY"  # raised by client_lib only (CudaTooEarlyError), never sent by a daemon


# -- Client -> daemon requests ------------------------------------------------


class Request(msgspec.Struct, tag_field="op", kw_only=True, forbid_unknown_fields=False):
    """Base of every request: ``id`` is echoed in the reply."""

    id: RequestId


class Hello(Request, tag="hello"):
    """Opens a session. ``pid`` is a claim only; the daemon verifies it from
    the connection's peer credentials where the transport allows."""

    protocol: tuple[int, int]
    name: Name
    pid: Annotated[int, msgspec.Meta(gt=0)]
    workload: Workload = "training"
    weight: Weight = 1.0
    device: Optional[int] = None  # None: the daemon picks the least loaded device
    memory_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    resume_session: Optional[str] = None  # reattach to this session id if it still exists
    resume_key: Optional[str] = None  # the key the welcome carried for that session
    managed_pgid: Optional[int] = None  # process group of a child the client launched (nodeagent run)
    holding_grant: Optional[int] = None  # on resume: the grant the client was using when it lost the daemon
    borrower: Optional[Borrower] = None  # 1.1: training job this session belongs to, for a device lent to it
    slo_ms: Optional[DeadlineMs] = None  # 2.2: co-run: the slice time this (higher-class) session asks pacing to keep


class Heartbeat(Request, tag="heartbeat"):
    """Keeps a session alive. May come from a different connection than the
    session's own (the client's heartbeat thread), so it names the session
    and proves it with the session key."""

    session: str
    key: str


class Acquire(Request, tag="acquire"):
    """Ask for the device token. Replied ``ok`` at once; the token itself
    arrives later as a ``grant`` notice. Idempotent while waiting or holding.
    With ``quiet`` the daemon replies only on error (the grant is the answer)."""

    quiet: bool = False
    # 2.7, co-run: how many of this (higher-class) service's requests wait, the one this slice is
    # for included, and how long the oldest has waited (None: not said; it is steered as before)
    waiting: Optional[Waiting] = None
    oldest_wait_ms: Optional[WaitMs] = None


class Release(Request, tag="release"):
    """Give the token of ``grant`` back. With ``requeue`` the session is put
    back in the queue in the same step (a yield that wants the GPU again)."""

    grant: int
    requeue: bool = False
    quiet: bool = False  # reply only on error: the releaser is not waiting for it
    # 2.7, co-run: the requests still waiting once this slice is done, and the oldest's wait so far
    waiting: Optional[Waiting] = None
    oldest_wait_ms: Optional[WaitMs] = None


class Cancel(Request, tag="cancel"):
    """Withdraw a pending ``acquire`` (no-op when not waiting)."""


class StatusRequest(Request, tag="status"):
    """Snapshot of devices and sessions. Needs no session."""


class Goodbye(Request, tag="bye"):
    """Close the session: its token, if held, passes on at once."""


class SuspendSession(Request, tag="suspend_session"):
    """Operator/placement request: have ``session`` give up the whole device,
    memory included, within ``deadline_ms``. Needs no session of its own; the
    peer must be root or the session's owner. Answered with ``suspend_result``
    once the device is free (or the deadline forced it)."""

    session: str
    deadline_ms: DeadlineMs = 5000.0


class ResumeSession(Request, tag="resume_session"):
    """Let a suspended session come back. Answered ``ok`` once it was told (or continued)."""

    session: str


class Partition(Request, tag="partition"):
    """Set the MPS partition of ``device``: an SM percentage per session (None:
    share what is left) and optional memory limits. Root only. Running clients
    get their new share when they next create a CUDA context (``stale``)."""

    device: int
    shares: dict[str, Optional[float]]
    memory_mb: Optional[dict[str, int]] = None


class Suspended(Request, tag="suspended"):
    """From the suspended client: its state is parked in host memory and its
    device memory freed; it waits for ``resume``."""

    bytes_parked: int
    suspend_ms: float
    # 2.5: host memory the client holds for its parked state (the buffer it keeps across
    # park cycles, so the next park allocates nothing), and whether it is page-locked
    host_bytes: HostBytes = 0
    host_pinned: bool = False


class Resumed(Request, tag="resumed"):
    """From the client: its state is back on the device."""

    resume_ms: float
    # 2.5: the host memory it still keeps for the next park (None: as reported at suspended)
    host_bytes: Optional[HostBytes] = None


# -- 1.1: server-side models (ctxpool) ---------------------------------------


class TensorRef(msgspec.Struct, kw_only=True):
    """One tensor crossing processes without pickling. CPU: ``nbytes`` bytes at
    ``offset`` in the POSIX shared-memory segment ``shm`` (C-contiguous).
    CUDA: ``cuda_ipc`` names the device memory instead (``shm`` empty)."""

    dtype: str  # torch dtype name without the "torch." prefix: "float32", "int64", ...
    shape: list[int]
    shm: str = ""
    offset: int = 0
    nbytes: int = 0
    cuda_ipc: Optional["CudaIpcRef"] = None


class CudaIpcRef(msgspec.Struct, kw_only=True):
    """What ``torch.UntypedStorage._share_cuda_()`` returns, as fields."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int = 0  # elements from the storage's start
    stride: list[int] = []


class RegisterModel(Request, tag="register_model"):
    """Register a model with the daemon's workers. ``factory`` is
    ``"package.module:callable"`` importable by the daemon; ``weights`` an
    absolute path to a safetensors or torch state-dict file (None: the
    factory's own initialisation). ``example_input`` is run once to check the
    model and to time its layers. Answered ``model_registered`` or ``E_MODEL``."""

    name: ModelName
    factory: str
    weights: Optional[str] = None
    example_input: Annotated[list[TensorRef], msgspec.Meta(max_length=MAX_TENSORS)] = []
    device: Optional[int] = None  # None: every device that has workers
    replace: bool = False  # False: registering an existing name with other arguments is E_INVALID


class UnregisterModel(Request, tag="unregister_model"):
    name: str


class ModelsRequest(Request, tag="models"):
    """List registered models. Needs no session."""


class Infer(Request, tag="infer"):
    """Run a registered model on ``inputs`` in a daemon worker, under the
    token of this session's device (as workload ``inference``). Answered
    ``infer_result`` with the outputs (the caller owns and unlinks their
    shared-memory segment), or an error."""

    model: str
    inputs: Annotated[list[TensorRef], msgspec.Meta(max_length=MAX_TENSORS)]
    timeout_ms: DeadlineMs = 60000.0


# -- 1.1: cluster placement (the tcp endpoint) --------------------------------


class Inventory(Request, tag="inventory"):
    """Devices with their lifecycle state, sessions, partition, utilisation."""


class Lend(Request, tag="lend"):
    """Lend ``device`` to the training sessions of ``borrower`` (FREE -> LENT),
    for at most ``max_s`` seconds (None: until reclaimed). Repeating it with
    the same borrower is a no-op."""

    device: int
    borrower: Borrower
    max_s: Optional[float] = None
    # issue 32: the uids whose sessions may join as ``borrower`` (SO_PEERCRED's, verified); None or
    # empty: only local root's. Again with the same borrower: replaces them.
    borrower_uids: Optional[Annotated[list[Uid], msgspec.Meta(max_length=64)]] = None


class Reclaim(Request, tag="reclaim"):
    """Take a lent device back for inference: the borrower's sessions there are
    suspended (stopped after ``deadline_ms``). Answered once the device is free."""

    device: int
    deadline_ms: DeadlineMs = 5000.0


class Drain(Request, tag="drain"):
    """Stop admitting sessions to ``device`` and ask those there to leave.
    ``cancel``: admit again."""

    device: int
    cancel: bool = False


class SetPolicy(Request, tag="set_policy"):
    """Change ``device``'s scheduling policy; fields left None keep their value."""

    device: int
    quanta_ms: Optional[dict[str, float]] = None  # per workload class
    grace_ms: Optional[float] = None
    protect_s: Optional[float] = None


# -- 2.4: the placement layer's signals and levers for a job ------------------


class SetWeight(Request, tag="set_weight"):
    """Change ``session``'s share of its device's time within its class (``hello.weight``)."""

    session: str
    weight: Weight


class Renew(Request, tag="renew"):
    """A new term for the lend of ``device`` to ``borrower``: it ends ``max_s`` seconds from
    now (a lease). Answered ``lifecycle_reply`` with ``lent_until``."""

    device: int
    borrower: Borrower
    max_s: float


ClientMessage = Union[Hello, Heartbeat, Acquire, Release, Cancel, StatusRequest, Goodbye,
                      SuspendSession, ResumeSession, Partition, Suspended, Resumed,
                      RegisterModel, UnregisterModel, ModelsRequest, Infer,
                      Inventory, Lend, Reclaim, Drain, SetPolicy, SetWeight, Renew]


# -- Daemon -> client replies and notices -------------------------------------


class Reply(msgspec.Struct, tag_field="op", kw_only=True, forbid_unknown_fields=False):
    """Base of every daemon -> client message. Notices carry ``id = 0``."""

    id: int = 0


class Ok(Reply, tag="ok"):
    """Request done; nothing to return."""


class Error(Reply, tag="error"):
    """Request refused; it changed nothing. ``code`` is an :class:`ErrorCode`."""

    code: str
    message: str


class Welcome(Reply, tag="welcome"):
    """Reply to ``hello``: the session and the settings the client must follow."""

    protocol: tuple[int, int]
    session: str
    key: str  # secret proving ownership of the session (heartbeats, resume)
    device: int
    backend: str
    slice_ms: float  # quantum of this session's workload class
    grace_ms: float  # time between a yield request and enforcement
    heartbeat_ms: float  # send a heartbeat at least this often
    resumed: bool = False
    boot: int = 0  # the daemon's incarnation; a heartbeat_ack with another means it restarted
    env: dict[str, str] = {}  # set in the environment before CUDA initialises (MPS pipe dir, SM share, memory limit)
    durable: bool = True  # False: the daemon could not journal the session (disk full): a restart would lose it
    # 1.2: which GPU, by UUID (the index above is the daemon's, NVML's, not this process's CUDA ordinal)
    device_uuid: str = ""
    cuda_ordinal: Optional[int] = None  # the CUDA ordinal to use, where the daemon can tell (0 when env names the GPU)
    pace: str = ""  # 2.2: co-run: the device's pace board (read-only; client_lib.pace) for a lower class; "" none
    suspended: bool = False  # 2.3: a resumed session that is suspended (a restarted daemon kept it): stay parked


class HeartbeatAck(Reply, tag="heartbeat_ack"):
    """Reply to ``heartbeat``; ``boot`` tells a restarted daemon from the one that welcomed us."""

    boot: int
    durable: bool = True  # as in welcome, now: False while the daemon's journal fails to record the session


class SessionInfo(msgspec.Struct, kw_only=True):
    id: str
    name: str
    pid: int
    pid_verified: bool
    workload: str
    weight: float
    state: str  # idle | waiting | holding | yielding
    gpu_time_s: float
    grants: int
    memory_mb: int
    stopped: bool = False  # SIGSTOPped by the daemon until its next grant
    memory_used_bytes: Optional[int] = None  # measured (cuda); None where not measurable
    managed_pgid: Optional[int] = None
    attached: bool = True  # False: restored from the journal, its client has not reattached yet
    suspended: Optional[str] = None  # requested | suspended | stopped, while a suspend is in force
    bytes_parked: int = 0
    borrower: Optional[str] = None  # 1.1: hello.borrower, the training job the session belongs to
    # 2.3: the cgroup v2 (as /proc/PID/cgroup names it) the daemon freezes to stop a
    # launched program; None where it stops the process group (managed_pgid) instead
    managed_cgroup: Optional[str] = None
    # 2.5: host memory the session's client keeps for its parked state (suspended/resumed.host_bytes)
    host_bytes: int = 0
    host_pinned: bool = False


class TokenActivity(msgspec.Struct, kw_only=True):
    """2.1: a device's recent token history, as ``status_reply.devices[].activity``. Counters run
    since the daemon started; waits are the last ``waits`` grants' (at most 512); the timeline
    is ``bucket_ms`` buckets, oldest first, the last one the bucket now is in."""

    grants: int = 0
    preemptions: int = 0  # yield asked because a higher class waited
    quantum_yields: int = 0  # yield asked when a slice ended and a session of the class waited
    enforcements: int = 0  # holders stopped or revoked past their yield deadline
    suspensions: int = 0  # sessions on the device asked to suspend (give the whole device up)
    waits: int = 0
    wait_p50_ms: Optional[float] = None  # None: no grant yet
    wait_p99_ms: Optional[float] = None
    bucket_ms: float = 1000.0
    timeline: list[str] = []  # per bucket: session id that held the token longest, "" idle, "*" many sessions
    names: dict[str, str] = {}  # session id -> name, for the ids in timeline
    # 2.7: per bucket, every session that held a token in it, longest first ("*": the rest); names has them
    holders: list[list[str]] = []


class DeviceInfo(msgspec.Struct, kw_only=True):
    index: int
    backend: str
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: Optional[int]
    utilization_percent: Optional[float]
    holder: Optional[str]  # session id holding the token, if any
    queue: list[str]  # session ids waiting, in grant order
    sessions: list[SessionInfo]
    memory_declared_mb: int = 0  # sum of the sessions' declarations
    memory_capacity_mb: int = 0  # what admission lets sessions declare in all
    mps: bool = False
    partition: dict[str, int] = {}  # SM percent per session, on an MPS device
    memory_workers_mb: int = 0  # 1.2: held for the device's ctxpool workers (contexts, pools, resident budgets)
    activity: Optional[TokenActivity] = None  # 2.1: recent token history (`nodeagent top`); None from older daemons


class StatusReply(Reply, tag="status_reply"):
    protocol: tuple[int, int]
    daemon_pid: int
    backend: str
    uptime_s: float
    devices: list[DeviceInfo]
    boot: int = 0
    # 2.4: GPU-seconds each training job (hello.borrower) attained on this node, over all its
    # sessions and this daemon's restarts
    attained_gpu_s: dict[str, float] = {}


class Grant(Reply, tag="grant"):
    """Notice: you hold the token of ``device`` under ``grant`` (pass it back
    in ``release``). Keep it as long as nobody is waiting; expect a ``yield``
    once ``slice_ms`` has passed and somebody is."""

    grant: int
    device: int
    slice_ms: float


class YieldRequest(Reply, tag="yield"):
    """Notice: give the token of ``grant`` back within ``deadline_ms``."""

    grant: int
    deadline_ms: float
    reason: str  # "preempted" (a higher class waits) | "quantum" (slice over, others wait)


class Revoke(Reply, tag="revoke"):
    """Notice: the token of ``grant`` was taken away; do not use the device
    until the next ``grant``."""

    grant: int
    reason: str  # "overrun" | "shutdown" | "memory" | "suspended" | "device_lost" (1.2: NVML reports the GPU lost)
    # | "mps_fault" (2.6: a fault ended every client of the device's MPS server)


class SuspendNotice(Reply, tag="suspend"):
    """Notice: at your next yield point park your state in host memory, free
    the device, report ``suspended`` and wait for ``resume``."""

    deadline_ms: float
    reason: str = "requested"


class ResumeNotice(Reply, tag="resume"):
    """Notice: bring your state back and carry on."""


class SuspendResult(Reply, tag="suspend_result"):
    """Reply to ``suspend_session``. ``outcome``: suspended (the client parked
    its state), stopped (it missed the deadline and was SIGSTOPped), timeout
    (missed it and could not be stopped: unverified), gone (it left), cancelled
    (a resume came first). A client without suspend handlers reports
    ``bytes_parked = 0``: it released the device but kept its memory."""

    session: str
    outcome: str
    elapsed_ms: float  # from the request to the device being free
    bytes_parked: int = 0
    suspend_ms: float = 0.0  # as the client measured its own parking


class PartitionReply(Reply, tag="partition_reply"):
    device: int
    shares: dict[str, int]
    memory_limits_mb: dict[str, int]
    stale: list[str]  # sessions running with an older share until they recreate their CUDA context


# -- 1.1: server-side models (ctxpool) ---------------------------------------


class ModelInfo(msgspec.Struct, kw_only=True):
    name: str
    factory: str
    weights: Optional[str]
    model_bytes: int  # parameters and buffers
    layers: int
    groups: int  # layer groups of the pipelined swap-in
    devices: list[int]
    resident: list[int] = []  # devices where it is on the device now


class ModelRegistered(Reply, tag="model_registered"):
    model: ModelInfo
    changed: bool = True  # False: the same registration already existed


class ModelsReply(Reply, tag="models_reply"):
    models: list[ModelInfo]


class InferResult(Reply, tag="infer_result"):
    model: str
    outputs: list[TensorRef]
    swap: str  # "ready" (resident) | "pipelined" (swapped in for this request)
    queue_ms: float  # from arrival to the worker starting (token wait included)
    run_ms: float  # in the worker: swap-in and compute, until the outputs were ready
    device: int = 0
    single: bool = False  # the model returned one tensor (not a tuple or list)


# -- 1.1: cluster placement ---------------------------------------------------


class PolicyInfo(msgspec.Struct, kw_only=True):
    quanta_ms: dict[str, float]
    grace_ms: float
    protect_s: float


class DeviceInventory(msgspec.Struct, kw_only=True):
    index: int
    uuid: str
    name: str
    backend: str
    memory_total_bytes: int
    memory_used_bytes: Optional[int]
    utilization_percent: Optional[float]
    state: str  # FREE | RUN | PROTECT | LENT | DRAINING
    borrower: Optional[str]
    lent_until: Optional[float]  # unix time, when lent with max_s
    sessions: list[SessionInfo]
    policy: PolicyInfo
    mps: bool = False
    partition: dict[str, int] = {}


class InventoryReply(Reply, tag="inventory_reply"):
    node: str  # hostname
    boot: int
    devices: list[DeviceInventory]
    attained_gpu_s: dict[str, float] = {}  # 2.4: as in status_reply: per job, over its sessions and restarts


class LifecycleReply(Reply, tag="lifecycle_reply"):
    """Answer to lend, drain: the state now and whether the request changed it."""

    device: int
    state: str
    borrower: Optional[str]
    changed: bool
    lent_until: Optional[float] = None  # 2.4: unix time the lend ends (max_s, renew); None: no end, or not lent


class ReclaimReply(Reply, tag="reclaim_reply"):
    device: int
    state: str
    free_ms: float  # from the request to the device being free of the borrower's sessions
    outcomes: dict[str, str]  # session -> suspended | stopped | timeout | gone
    changed: bool


class PolicyReply(Reply, tag="policy_reply"):
    device: int
    policy: PolicyInfo


class DrainNotice(Reply, tag="drain"):
    """Pushed: this session's device is draining; leave when you can."""

    device: int


class Event(msgspec.Struct, kw_only=True):
    """One message on the events PUB socket, after a topic frame equal to ``kind``."""

    node: str
    seq: int  # per daemon boot, from 1, no gaps: a subscriber sees what it missed
    boot: int
    time: float  # unix seconds
    kind: str  # device_state | grant | preempt | session_join | session_leave | suspend | resume | reclaim | lend | health
    device: Optional[int] = None
    session: Optional[str] = None
    data: dict[str, Union[str, int, float, bool, None]] = {}


DaemonMessage = Union[Ok, Error, Welcome, HeartbeatAck, StatusReply, Grant, YieldRequest, Revoke,
                      SuspendNotice, ResumeNotice, SuspendResult, PartitionReply,
                      ModelRegistered, ModelsReply, InferResult,
                      InventoryReply, LifecycleReply, ReclaimReply, PolicyReply, DrainNotice]

MAX_REQUEST_BYTES = 64 * 1024
"""Largest request frame the daemon accepts; larger ones get E_BAD_REQUEST."""

MAX_NESTING_DEPTH = 32
"""Deepest nesting of arrays and maps a frame may have (requests need 5); deeper
frames get E_BAD_REQUEST before any decoding, so no peer can exhaust the stack."""
