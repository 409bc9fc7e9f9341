"""Daemon settings: defaults, then the TOML config file, then command-line flags.

The file mirrors :data:`EXAMPLE_TOML`. Unknown keys and bad values stop the
daemon at start-up with an error naming the key, so a typo never silently
leaves a default in force.
"""

from __future__ import annotations

import difflib
import grp
import math
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from client_lib.endpoint import ENV_ENDPOINT, client_endpoint, daemon_endpoint
from client_lib.framing import parse_endpoint
from sharing import SchedulerPolicy, Workload
from sharing.corun import PaceController

DEFAULT_CONFIG_PATH = "/etc/nodeagent/nodeagent.toml"
MEMORY_POLICIES = ("warn", "revoke", "stop")
SHARING_MODES = ("auto", "corun", "exclusive")

EXAMPLE_TOML = """\
# /etc/nodeagent/nodeagent.toml: every key is optional; these are the defaults.
backend = "auto"            # auto | cuda | cpu
cpu_devices = 1             # logical devices of the cpu backend
# endpoint = "ipc:///run/nodeagent/agent.sock"
# state_dir = "/var/lib/nodeagent"
log_level = "info"          # debug | info | warning | error

[scheduler]
grace_ms = 100.0            # a holder asked to yield has this long before enforcement
enforce = "stop"            # stop: SIGSTOP verified processes (else revoke) | revoke: never signal
sharing = "auto"            # corun: each class its own token, lower classes paced (auto: on cuda)
                            # | exclusive: one holder per device, a higher class preempts
linger_ms = 2.0             # exclusive: after a higher class's slice, the token waits this long for its
                            # next request before a lower class gets it (a burst pays one preemption)

[corun]
duty = "adaptive"           # how lower classes are paced while a higher class holds: adaptive
                            # (a controller steers by the higher class's slice times) | pause | free
                            # (MPS priority only) | a permille 0..1000 of each period they may run
tolerance_percent = 5.0     # adaptive: how much longer than its reference a higher-class slice may take
period_ms = 10.0            # the pacing period lower classes run and pause in
lower_sm_percent = 0        # on an MPS device, cap lower classes to this percent of the SMs (0: no cap),
                            # so that a higher class arriving finds SMs free; a partition overrides it

[scheduler.quantum_ms]
inference = 50.0
training = 200.0
best-effort = 200.0

[heartbeat]
interval_ms = 1000.0        # clients send a heartbeat at least this often
misses = 3                  # silent for this many intervals: the session is lost

[local]
max_connections = 4096      # connections to the local socket; more are refused with E_UNAVAILABLE
max_connections_per_uid = 1024  # of them, what one user may hold (so that one user cannot take every slot)
max_queued_kb = 4096        # a peer with more than this queued to it (not reading) is dropped

[memory]
policy = "warn"             # a session over its declared memory: warn | revoke | stop
watch_interval_ms = 1000.0  # how often per-process device memory is read (cuda)
context_allowance_mb = "auto"  # per process, beyond its session's declaration (its CUDA context); auto: 512 on cuda, else 0
host_proc = ""              # the host's /proc, mounted for a daemon in its own pid namespace (see README)
reserve_mb = 0              # device memory kept out of admission
make_room = "suspend"       # a session that does not fit: suspend (lower-class sessions, to fit it) | refuse
make_room_deadline_ms = 5000.0  # how long those sessions get to park their state

[memory.class_cap_percent]  # most of a device's capacity one class may declare in all (default 100)
# best-effort = 50.0

[metrics]
# port = 9400               # off unless set
addr = "127.0.0.1"
max_connections = 64        # scrapers at once; a new one past it takes the slot of the oldest idle one
timeout_ms = 10000.0        # a scrape connection gets this long for each request and its response

[mps]
devices = "auto"            # device indices that get an MPS control daemon; [] : MPS off; auto: every GPU
                            # when the daemon co-runs on cuda as root and control_binary is found (lower
                            # classes then run at MPS client priority 1: see docs/architecture.md, Co-run)
control_binary = "nvidia-cuda-mps-control"
min_percent = 5             # smallest SM share a partition may give a session

[ctxpool]
enabled = "off"             # warm workers for server-side models (they hold device memory): off | on |
                            # auto (on where torch is importable by the daemon)
workers_per_device = 2      # one active, the rest on standby with warm contexts
pool_mb = 0                 # device memory each worker reserves in its allocator at start
resident_mb = "auto"        # device memory each worker may keep models resident in (LRU), held in admission;
                            # auto: half of what contexts, pools and sessions leave at start, split between
                            # workers (nodeagent.memory.auto_resident_mb); 0: no bound, not held
python_path = []            # directories workers add to sys.path to import model factories
restart_budget = 5          # worker deaths per device in 60 s before it stops replacing them
hang_budget = 3             # a model's requests hanging (worker replaced) this often in 10 min: refused for a while
timeout_grace_ms = 2000.0   # a worker still running a request this long after its timeout is replaced
register_group = ""         # group (name or gid) whose members may register models; "": root only

[cluster]
# endpoint = "tcp://0.0.0.0:7410"   # placement API (CURVE); off unless set
events_endpoint = "tcp://0.0.0.0:7411"  # PUB socket for events (CURVE), bound with the endpoint; "" for none
keys_dir = "/etc/nodeagent/keys"  # server.key_secret and allowed/*.key (`nodeagent keys generate`)
protect_s = 60.0            # a device whose inference went idle is not lent until this long after
node = ""                   # node name in inventory and events; "" = the hostname
health_interval_s = 5.0     # how often a health event is published
"""


def default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/nodeagent"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "nodeagent")


WORKLOADS = tuple(w.wire for w in Workload)


class ConfigError(ValueError):
    """A setting with a bad value; the message names the setting.

    ``key`` is the setting's dotted name in the file (``scheduler.grace_ms``;
    None where no one setting is at fault) and ``problem`` the message without
    its subject, so that the command line can name the flag or the environment
    variable the value came from instead of the file's key."""

    def __init__(self, message: str, key: str | None = None, problem: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.problem = message if problem is None else problem


def _bad(key: str, problem: str, subject: str | None = None) -> ConfigError:
    """``subject problem``: ``subject`` is the key unless the message reads better naming its table."""
    return ConfigError(f"{subject or key} {problem}", key, problem)


def nearest(name: str, candidates) -> str | None:
    """The candidate ``name`` was most likely meant to be (a typo, or a key in the wrong table); None if none
    is close."""
    candidates = list(candidates)
    leaf = name.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for candidate in candidates:
        by_leaf.setdefault(candidate.rsplit(".", 1)[-1], []).append(candidate)
    if len(by_leaf.get(leaf, ())) == 1 and by_leaf[leaf][0] != name:  # the right key in the wrong table
        return by_leaf[leaf][0]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if close:
        return close[0]
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    if close and len(by_leaf[close[0]]) == 1:
        return by_leaf[close[0]][0]
    return None


def did_you_mean(name: str, candidates) -> str:
    """``"; did you mean 'x'?"`` for the nearest candidate, or ``""``."""
    guess = nearest(name, candidates)
    return f"; did you mean {guess!r}?" if guess is not None else ""


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be a local endpoint (a clause after its name), or None if it can."""
    try:
        _, address = parse_endpoint(endpoint)
    except ValueError:
        return f"must be ipc://PATH or tcp://HOST:PORT, got {endpoint!r}"
    if isinstance(address, tuple) and not 0 <= address[1] <= 65535:
        return f"has a port outside 0..65535: {endpoint!r}"
    return None


def client_endpoint_problem(flag: str | None) -> str | None:
    """For a command that connects (status, run): why the endpoint it would use, ``--endpoint``
    if given, else the environment's or the default, cannot be one, naming where it came from."""
    endpoint = flag or client_endpoint()
    problem = endpoint_problem(endpoint)
    if problem is None:
        return None
    return f"{'--endpoint' if flag else ENV_ENDPOINT} {problem}"


@dataclass
class ServeConfig:
    backend: str = "auto"  # auto | cuda | cpu
    cpu_devices: int = 1
    endpoint: str = field(default_factory=daemon_endpoint)
    state_dir: str = field(default_factory=default_state_dir)
    log_level: str = "info"
    metrics_port: int | None = None  # None: no metrics HTTP server
    metrics_addr: str = "127.0.0.1"
    metrics_max_connections: int = 64  # connections to the metrics endpoint at once
    metrics_timeout_ms: float = 10000.0  # from a connection (or its last response) to its next response
    quantum_ms: dict[str, float] = field(
        default_factory=lambda: {"inference": 50.0, "training": 200.0, "best-effort": 200.0})
    grace_ms: float = 100.0
    enforce: str = "stop"  # stop | revoke
    sharing: str = "auto"  # auto (corun on cuda, else exclusive) | corun | exclusive
    linger_ms: float = 2.0  # exclusive: how long a higher class's token waits for its next request
    corun_duty: str | int = "adaptive"  # adaptive | pause | free | permille 0..1000
    corun_tolerance_percent: float = 5.0
    corun_period_ms: float = 10.0
    corun_lower_sm_percent: int = 0  # MPS devices under co-run: SM cap of lower classes; 0: none
    heartbeat_ms: float = 1000.0  # clients send a heartbeat at least this often
    heartbeat_misses: int = 3  # a session that sent nothing for this many intervals is lost
    local_max_connections: int = 4096  # local endpoint: more are refused (E_UNAVAILABLE), never an abort
    local_max_connections_per_uid: int = 1024  # of those, what one user may hold
    local_max_queued_kb: int = 4096  # bytes queued to a peer that does not read before it is dropped
    memory_policy: str = "warn"  # warn | revoke | stop
    memory_watch_ms: float = 1000.0
    memory_context_allowance_mb: int | str = "auto"  # per process (its CUDA context); auto: 512 on cuda, else 0
    memory_host_proc: str = ""  # "": NVML's pids are read as the daemon's (see nodeagent.procwatch.PidTranslator)
    memory_reserve_mb: int = 0
    memory_make_room: str = "suspend"  # suspend | refuse: may a higher class push lower-class declarations out
    memory_class_cap_percent: dict[str, float] = field(default_factory=dict)  # workload -> percent; absent: 100
    memory_make_room_deadline_ms: float = 5000.0
    mps_devices: list[int] | str = "auto"  # indices, or "auto" (see mps_devices_for)
    mps_control_binary: str = "nvidia-cuda-mps-control"
    mps_min_percent: int = 5
    ctxpool_enabled: str = "off"  # off | on | auto (on where torch is importable); opt-in: workers hold memory
    ctxpool_workers_per_device: int = 2
    ctxpool_pool_mb: int = 0
    ctxpool_resident_mb: int | str = "auto"  # "auto" (memory.auto_resident_mb) | MiB per worker | 0: no bound
    ctxpool_python_path: list[str] = field(default_factory=list)
    ctxpool_restart_budget: int = 5
    ctxpool_hang_budget: int = 3  # hangs of one model in 10 minutes before its requests are refused
    ctxpool_timeout_grace_ms: float = 2000.0  # past a request's timeout, before its worker is replaced
    ctxpool_register_group: str | int = ""  # name or gid of the group that may register models; "": root only
    cluster_endpoint: str | None = None  # None: no cluster endpoint (and no events socket)
    cluster_events_endpoint: str = "tcp://0.0.0.0:7411"
    cluster_keys_dir: str = "/etc/nodeagent/keys"
    cluster_protect_s: float = 60.0
    cluster_node: str = ""  # "": the hostname
    cluster_health_interval_s: float = 5.0

    def validate(self) -> None:
        """Raise :class:`ConfigError` (with its ``key``) for the first setting that cannot be used."""
        if self.backend not in ("auto", "cuda", "cpu"):
            raise _bad("backend", f"must be auto, cuda or cpu, got {self.backend!r}")
        if self.cpu_devices < 1:
            raise _bad("cpu_devices", f"must be >= 1, got {self.cpu_devices}")
        problem = endpoint_problem(self.endpoint)
        if problem is not None:
            raise _bad("endpoint", problem)
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise _bad("log_level", f"must be debug, info, warning or error, got {self.log_level!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise _bad("metrics.port", f"must be in 0..65535, got {self.metrics_port}")
        if not 1 <= self.metrics_max_connections <= 4096:
            raise _bad("metrics.max_connections", f"must be in 1..4096, got {self.metrics_max_connections}")
        if not (math.isfinite(self.metrics_timeout_ms) and self.metrics_timeout_ms > 0):
            raise _bad("metrics.timeout_ms", f"must be a positive number, got {self.metrics_timeout_ms:g}")
        for name, ms in self.quantum_ms.items():  # a table of its own: one key per workload class
            if name not in WORKLOADS:
                raise _bad(f"scheduler.quantum_ms.{name}", f"has unknown workload class {name!r}"
                           f"{did_you_mean(name, WORKLOADS)} (classes: {', '.join(WORKLOADS)})",
                           subject="scheduler.quantum_ms")
            if not (math.isfinite(ms) and ms > 0):
                raise _bad(f"scheduler.quantum_ms.{name}", f"must be a positive number of ms, got {name}={ms:g}",
                           subject="scheduler.quantum_ms")
        for name, value in (("scheduler.grace_ms", self.grace_ms), ("heartbeat.interval_ms", self.heartbeat_ms),
                            ("memory.watch_interval_ms", self.memory_watch_ms)):
            if not (math.isfinite(value) and value > 0):
                raise _bad(name, f"must be a positive number, got {value:g}")
        if self.heartbeat_misses < 1:
            raise _bad("heartbeat.misses", f"must be >= 1, got {self.heartbeat_misses}")
        if self.enforce not in ("stop", "revoke"):
            raise _bad("scheduler.enforce", f"must be stop or revoke, got {self.enforce!r}")
        if self.sharing not in SHARING_MODES:
            raise _bad("scheduler.sharing", f"must be one of {', '.join(SHARING_MODES)}, got {self.sharing!r}")
        if not (math.isfinite(self.linger_ms) and 0 <= self.linger_ms <= 1000):
            raise _bad("scheduler.linger_ms", f"must be a number of ms in 0..1000, got {self.linger_ms:g}")
        self.corun_fixed_duty()
        if not (math.isfinite(self.corun_tolerance_percent) and 0 < self.corun_tolerance_percent <= 500):
            raise _bad("corun.tolerance_percent", f"must be in (0, 500], got {self.corun_tolerance_percent:g}")
        if not (math.isfinite(self.corun_period_ms) and 1 <= self.corun_period_ms <= 1000):
            raise _bad("corun.period_ms", f"must be in 1..1000, got {self.corun_period_ms:g}")
        if not 0 <= self.corun_lower_sm_percent <= 100:
            raise _bad("corun.lower_sm_percent", f"must be in 0..100, got {self.corun_lower_sm_percent}")
        if self.memory_policy not in MEMORY_POLICIES:
            raise _bad("memory.policy", f"must be one of {', '.join(MEMORY_POLICIES)}, got {self.memory_policy!r}")
        if self.mps_devices != "auto" and (not isinstance(self.mps_devices, list) or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.mps_devices)):
            raise _bad("mps.devices", f"must be \"auto\" or a list of device indices, got {self.mps_devices!r}")
        if not 1 <= self.mps_min_percent <= 100:
            raise _bad("mps.min_percent", f"must be in 1..100, got {self.mps_min_percent}")
        for workload, percent in self.memory_class_cap_percent.items():
            key = f"memory.class_cap_percent.{workload}"
            if workload not in WORKLOADS:
                raise _bad(key, f"has unknown workload class {workload!r}{did_you_mean(workload, WORKLOADS)} "
                                f"(classes: {', '.join(WORKLOADS)})", subject="memory.class_cap_percent")
            if not (math.isfinite(percent) and 0 < percent <= 100):
                raise _bad(key, f"must be in (0, 100], got {percent:g}")
        if self.memory_make_room not in ("refuse", "suspend"):
            raise _bad("memory.make_room", f"must be refuse or suspend, got {self.memory_make_room!r}")
        if not (math.isfinite(self.memory_make_room_deadline_ms) and self.memory_make_room_deadline_ms > 0):
            raise _bad("memory.make_room_deadline_ms",
                       f"must be a positive number, got {self.memory_make_room_deadline_ms:g}")
        if self.ctxpool_enabled not in ("auto", "on", "off"):
            raise _bad("ctxpool.enabled", f"must be auto, on or off, got {self.ctxpool_enabled!r}")
        for name, value, low in (("ctxpool.workers_per_device", self.ctxpool_workers_per_device, 1),
                                 ("ctxpool.pool_mb", self.ctxpool_pool_mb, 0),
                                 ("ctxpool.restart_budget", self.ctxpool_restart_budget, 0),
                                 ("ctxpool.hang_budget", self.ctxpool_hang_budget, 1)):
            if value < low:
                raise _bad(name, f"must be >= {low}, got {value}")
        resident = self.ctxpool_resident_mb
        if resident != "auto" and (isinstance(resident, bool) or not isinstance(resident, int) or resident < 0):
            raise _bad("ctxpool.resident_mb", f"must be \"auto\" or an integer >= 0, got {resident!r}")
        if not (math.isfinite(self.ctxpool_timeout_grace_ms) and self.ctxpool_timeout_grace_ms >= 0):
            raise _bad("ctxpool.timeout_grace_ms", f"must be a number >= 0, got {self.ctxpool_timeout_grace_ms:g}")
        self.ctxpool_register_gid()
        if any(not isinstance(d, str) or not os.path.isabs(d) for d in self.ctxpool_python_path):
            raise _bad("ctxpool.python_path",
                       f"must be a list of absolute directories, got {self.ctxpool_python_path!r}")
        if self.cluster_endpoint is not None and not self.cluster_endpoint.startswith("tcp://"):
            raise _bad("cluster.endpoint", f"must be tcp://HOST:PORT, got {self.cluster_endpoint!r}")
        if self.cluster_events_endpoint and not self.cluster_events_endpoint.startswith("tcp://"):
            raise _bad("cluster.events_endpoint", f"must be tcp://HOST:PORT or empty, "
                                                  f"got {self.cluster_events_endpoint!r}")
        if self.cluster_endpoint is not None and self.cluster_endpoint == self.cluster_events_endpoint:
            raise ConfigError("cluster.endpoint and cluster.events_endpoint must differ "
                              f"(both are {self.cluster_endpoint!r})")
        if not (math.isfinite(self.cluster_protect_s) and self.cluster_protect_s >= 0):
            raise _bad("cluster.protect_s", f"must be a number >= 0, got {self.cluster_protect_s:g}")
        if not (math.isfinite(self.cluster_health_interval_s) and self.cluster_health_interval_s > 0):
            raise _bad("cluster.health_interval_s",
                       f"must be a positive number, got {self.cluster_health_interval_s:g}")
        if self.local_max_connections < 1:
            raise _bad("local.max_connections", f"must be >= 1, got {self.local_max_connections}")
        if self.local_max_connections_per_uid < 1:
            raise _bad("local.max_connections_per_uid", f"must be >= 1, got {self.local_max_connections_per_uid}")
        if self.local_max_queued_kb < 64:
            raise _bad("local.max_queued_kb", f"must be >= 64, got {self.local_max_queued_kb}")
        if self.memory_reserve_mb < 0:
            raise _bad("memory.reserve_mb", f"must be >= 0, got {self.memory_reserve_mb}")
        allowance = self.memory_context_allowance_mb
        if allowance != "auto" and (isinstance(allowance, bool) or not isinstance(allowance, int) or allowance < 0):
            raise _bad("memory.context_allowance_mb", f"must be \"auto\" or an integer >= 0, got {allowance!r}")
        if self.memory_host_proc and not os.path.isabs(self.memory_host_proc):
            raise _bad("memory.host_proc", f"must be an absolute directory or empty, got {self.memory_host_proc!r}")
        self.policy()

    def policy(self) -> SchedulerPolicy:
        """The scheduling policy these settings give (validate first: a bad quantum raises ConfigError)."""
        quanta = {}
        for name, ms in self.quantum_ms.items():
            if name not in WORKLOADS:
                raise _bad(f"scheduler.quantum_ms.{name}", f"has unknown workload class {name!r} "
                           f"(classes: {', '.join(WORKLOADS)})", subject="scheduler.quantum_ms")
            quanta[Workload.parse(name)] = ms
        try:
            return SchedulerPolicy(quantum_ms=quanta, grace_ms=self.grace_ms, linger_ms=self.linger_ms)
        except ValueError as exc:  # validate() checked each value; this is what the scheduler adds
            raise ConfigError(f"scheduler: {exc}") from None

    def sharing_for(self, backend: str) -> str:
        """"corun" or "exclusive" for a daemon on ``backend``: auto means co-run on cuda, where
        a GPU runs processes side by side, and exclusive elsewhere (a cpu device is its cores)."""
        if self.sharing != "auto":
            return self.sharing
        return "corun" if backend == "cuda" else "exclusive"

    def mps_devices_for(self, backend: str, count: int) -> tuple[list[int], bool]:
        """(the devices that get an MPS control daemon, whether "auto" chose them). Auto: every
        device when the daemon co-runs on cuda as root and ``mps.control_binary`` is found; MPS
        client priority is the strongest lever co-run has (bench/results/h100-80gb-hbm3-2026-11-27)."""
        if self.mps_devices != "auto":
            return list(self.mps_devices), False
        wanted = (backend == "cuda" and self.sharing_for(backend) == "corun" and os.geteuid() == 0
                  and shutil.which(self.mps_control_binary) is not None)
        return (list(range(count)) if wanted else []), True

    def pace_controller(self) -> PaceController:
        """A co-run device's controller as these settings make it (validate first)."""
        return PaceController(tolerance=self.corun_tolerance_percent / 100.0,
                              fixed_duty_permille=self.corun_fixed_duty(),
                              period_us=int(round(self.corun_period_ms * 1000)))

    def corun_fixed_duty(self) -> int | None:
        """The duty ``corun.duty`` pins, in permille (None: adaptive). ConfigError if it is neither."""
        duty = self.corun_duty
        if isinstance(duty, str) and duty.strip().isdigit():
            duty = int(duty.strip())
        if duty == "adaptive":
            return None
        if duty == "pause":
            return 0
        if duty == "free":
            return 1000
        if isinstance(duty, bool) or not isinstance(duty, int) or not 0 <= duty <= 1000:
            raise _bad("corun.duty", f"must be adaptive, pause, free or a permille in 0..1000, got {duty!r}")
        return duty

    def ctxpool_register_gid(self) -> int | None:
        """The gid of ``ctxpool.register_group`` (None: root only). ConfigError if no such group."""
        group = self.ctxpool_register_group
        if group == "":
            return None
        if isinstance(group, bool) or (isinstance(group, int) and group < 0):
            raise _bad("ctxpool.register_group", f"must be a group name or a gid >= 0, got {group!r}")
        if isinstance(group, int) or group.isdigit():
            return int(group)
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            raise _bad("ctxpool.register_group", f"names group {group!r}, which does not exist on this host "
                                                 "(create it, or give a gid)") from None

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_ms * self.heartbeat_misses / 1000.0


# (dotted key in the file, attribute, accepted types)
_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "backend": ("backend", (str,)),
    "cpu_devices": ("cpu_devices", (int,)),
    "endpoint": ("endpoint", (str,)),
    "state_dir": ("state_dir", (str,)),
    "log_level": ("log_level", (str,)),
    "scheduler.grace_ms": ("grace_ms", (int, float)),
    "scheduler.enforce": ("enforce", (str,)),
    "scheduler.sharing": ("sharing", (str,)),
    "scheduler.linger_ms": ("linger_ms", (int, float)),
    "corun.duty": ("corun_duty", (str, int)),
    "corun.tolerance_percent": ("corun_tolerance_percent", (int, float)),
    "corun.period_ms": ("corun_period_ms", (int, float)),
    "corun.lower_sm_percent": ("corun_lower_sm_percent", (int,)),
    "heartbeat.interval_ms": ("heartbeat_ms", (int, float)),
    "heartbeat.misses": ("heartbeat_misses", (int,)),
    "local.max_connections": ("local_max_connections", (int,)),
    "local.max_connections_per_uid": ("local_max_connections_per_uid", (int,)),
    "local.max_queued_kb": ("local_max_queued_kb", (int,)),
    "memory.policy": ("memory_policy", (str,)),
    "memory.watch_interval_ms": ("memory_watch_ms", (int, float)),
    "memory.reserve_mb": ("memory_reserve_mb", (int,)),
    "memory.context_allowance_mb": ("memory_context_allowance_mb", (int, str)),
    "memory.host_proc": ("memory_host_proc", (str,)),
    "memory.make_room": ("memory_make_room", (str,)),
    "memory.make_room_deadline_ms": ("memory_make_room_deadline_ms", (int, float)),
    "metrics.port": ("metrics_port", (int,)),
    "metrics.addr": ("metrics_addr", (str,)),
    "metrics.max_connections": ("metrics_max_connections", (int,)),
    "metrics.timeout_ms": ("metrics_timeout_ms", (int, float)),
    "mps.devices": ("mps_devices", (list, str)),
    "mps.control_binary": ("mps_control_binary", (str,)),
    "mps.min_percent": ("mps_min_percent", (int,)),
    "ctxpool.enabled": ("ctxpool_enabled", (str,)),
    "ctxpool.workers_per_device": ("ctxpool_workers_per_device", (int,)),
    "ctxpool.pool_mb": ("ctxpool_pool_mb", (int,)),
    "ctxpool.resident_mb": ("ctxpool_resident_mb", (int, str)),
    "ctxpool.python_path": ("ctxpool_python_path", (list,)),
    "ctxpool.restart_budget": ("ctxpool_restart_budget", (int,)),
    "ctxpool.hang_budget": ("ctxpool_hang_budget", (int,)),
    "ctxpool.timeout_grace_ms": ("ctxpool_timeout_grace_ms", (int, float)),
    "ctxpool.register_group": ("ctxpool_register_group", (str, int)),
    "cluster.endpoint": ("cluster_endpoint", (str,)),
    "cluster.events_endpoint": ("cluster_events_endpoint", (str,)),
    "cluster.keys_dir": ("cluster_keys_dir", (str,)),
    "cluster.protect_s": ("cluster_protect_s", (int, float)),
    "cluster.node": ("cluster_node", (str,)),
    "cluster.health_interval_s": ("cluster_health_interval_s", (int, float)),
}
_SECTIONS = {"scheduler", "scheduler.quantum_ms", "heartbeat", "local", "memory", "memory.class_cap_percent", "metrics",
             "mps", "ctxpool", "cluster", "corun"}


def load_file(config: ServeConfig, path: str, *, required: bool, applied: set[str] | None = None) -> bool:
    """Apply the TOML file at ``path`` to ``config``. Returns False if it is absent
    and not ``required``; raises :class:`ConfigError` naming the file and the key
    otherwise (an unknown key with the nearest valid one). ``applied`` collects
    the dotted keys the file set."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:  # TOML is UTF-8; say where, not a traceback
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{path}: not UTF-8 text (line {line}, byte {exc.start}: {raw[exc.start]:#04x}); "
                          "TOML files are UTF-8: save it as UTF-8") from None
    except FileNotFoundError:
        if required:
            raise ConfigError(f"config file {path} does not exist") from None
        return False
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    per_workload = {"scheduler.quantum_ms.": config.quantum_ms,
                    "memory.class_cap_percent.": config.memory_class_cap_percent}
    for key, value in _flatten(doc, path):
        table_prefix, workload = key.rsplit(".", 1)[0] + ".", key.rsplit(".", 1)[-1]
        if table_prefix in per_workload:  # [section.table] with one number per workload class
            if workload not in WORKLOADS:
                guess = nearest(workload, WORKLOADS)
                hint = f"; did you mean {table_prefix + guess!r}?" if guess is not None else ""
                raise ConfigError(f"{path}: unknown key {key!r}{hint} (workload classes: {', '.join(WORKLOADS)})")
            _check_type(path, key, value, (int, float))
            per_workload[table_prefix][workload] = float(value)
        else:
            spec = _KEYS.get(key)
            if spec is None:
                raise ConfigError(f"{path}: unknown key {key!r}{did_you_mean(key, _all_keys())} "
                                  "(`nodeagent config-example` prints every key)")
            attr, types = spec
            _check_type(path, key, value, types)
            setattr(config, attr, float(value) if float in types else value)
        if applied is not None:
            applied.add(key)
    return True


def _all_keys() -> list[str]:
    return [*_KEYS, *(f"{table}.{w}" for table in ("scheduler.quantum_ms", "memory.class_cap_percent")
                      for w in WORKLOADS)]


def _flatten(doc: dict[str, Any], path: str, prefix: str = ""):
    for name, value in doc.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            if key not in _SECTIONS:
                guess = nearest(key, _SECTIONS)
                hint = f"; did you mean [{guess}]?" if guess is not None else ""
                raise ConfigError(f"{path}: unknown section [{key}]{hint} (sections: {', '.join(sorted(_SECTIONS))})")
            yield from _flatten(value, path, key + ".")
        else:
            yield key, value


def _check_type(path: str, key: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int subclass in Python; a TOML true is never a number here.
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join("a number" if t is float else {int: "an integer", str: "a string", list: "a list"}[t]
                               for t in types if not (t is int and float in types))
        raise ConfigError(f"{path}: {key} must be {expected}, got {_toml(value)}")


def _toml(value: Any) -> str:
    """``value`` as it would be written in the file (true, not True)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "a table"
    return repr(value) if isinstance(value, (int, float)) else str(value)  # dates and times print as TOML writes them
