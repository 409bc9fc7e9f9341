"""Daemon settings: defaults, then the TOML config file, then command-line flags.

The file mirrors :data:`EXAMPLE_TOML`. Unknown keys and bad values stop the
daemon at start-up with an error naming the key, so a typo never silently
leaves a default in force.
"""

from __future__ import annotations

import grp
import math
import os
from dataclasses import dataclass, field
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from client_lib.endpoint import daemon_endpoint
from sharing import SchedulerPolicy, Workload

DEFAULT_CONFIG_PATH = "/etc/nodeagent/nodeagent.toml"
MEMORY_POLICIES = ("warn", "revoke", "stop")

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

[mps]
devices = []                # device indices that get an MPS control daemon; empty: MPS off
control_binary = "nvidia-cuda-mps-control"
min_percent = 5             # smallest SM share a partition may give a session

[ctxpool]
enabled = "auto"            # auto: warm workers when torch is importable | on | off
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


class ConfigError(ValueError):
    """A setting with a bad value; the message names the setting."""


@dataclass
class ServeConfig:
    backend: str = "auto"  # auto | cuda | cpu
    cpu_devices: int = 1
    endpoint: str = field(default_factory=daemon_endpoint)
    state_dir: str = field(default_factory=default_state_dir)
    log_level: str = "info"
    metrics_port: int | None = None  # None: no metrics HTTP server
    metrics_addr: str = "127.0.0.1"
    quantum_ms: dict[str, float] = field(
        default_factory=lambda: {"inference": 50.0, "training": 200.0, "best-effort": 200.0})
    grace_ms: float = 100.0
    enforce: str = "stop"  # stop | revoke
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
    mps_devices: list[int] = field(default_factory=list)
    mps_control_binary: str = "nvidia-cuda-mps-control"
    mps_min_percent: int = 5
    ctxpool_enabled: str = "auto"  # auto | on | off
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
        if self.backend not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"backend must be auto, cuda or cpu, got {self.backend!r}")
        if self.cpu_devices < 1:
            raise ConfigError(f"cpu_devices must be >= 1, got {self.cpu_devices}")
        if not (self.endpoint.startswith("ipc://") or self.endpoint.startswith("tcp://")):
            raise ConfigError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {self.endpoint!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics.port must be in 0..65535, got {self.metrics_port}")
        for name, value in (("scheduler.grace_ms", self.grace_ms), ("heartbeat.interval_ms", self.heartbeat_ms),
                            ("memory.watch_interval_ms", self.memory_watch_ms)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if self.heartbeat_misses < 1:
            raise ConfigError(f"heartbeat.misses must be >= 1, got {self.heartbeat_misses}")
        if self.enforce not in ("stop", "revoke"):
            raise ConfigError(f"scheduler.enforce must be stop or revoke, got {self.enforce!r}")
        if self.memory_policy not in MEMORY_POLICIES:
            raise ConfigError(f"memory.policy must be one of {', '.join(MEMORY_POLICIES)}, "
                              f"got {self.memory_policy!r}")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.mps_devices):
            raise ConfigError(f"mps.devices must be a list of device indices, got {self.mps_devices!r}")
        if not 1 <= self.mps_min_percent <= 100:
            raise ConfigError(f"mps.min_percent must be in 1..100, got {self.mps_min_percent}")
        for workload, percent in self.memory_class_cap_percent.items():
            if workload not in {w.wire for w in Workload}:
                raise ConfigError(f"memory.class_cap_percent has unknown workload {workload!r} "
                                  "(workloads: inference, training, best-effort)")
            if not (math.isfinite(percent) and 0 < percent <= 100):
                raise ConfigError(f"memory.class_cap_percent.{workload} must be in (0, 100], got {percent}")
        if self.memory_make_room not in ("refuse", "suspend"):
            raise ConfigError(f"memory.make_room must be refuse or suspend, got {self.memory_make_room!r}")
        if not (math.isfinite(self.memory_make_room_deadline_ms) and self.memory_make_room_deadline_ms > 0):
            raise ConfigError(f"memory.make_room_deadline_ms must be a positive number, "
                              f"got {self.memory_make_room_deadline_ms}")
        if self.ctxpool_enabled not in ("auto", "on", "off"):
            raise ConfigError(f"ctxpool.enabled must be auto, on or off, got {self.ctxpool_enabled!r}")
        for name, value, low in (("ctxpool.workers_per_device", self.ctxpool_workers_per_device, 1),
                                 ("ctxpool.pool_mb", self.ctxpool_pool_mb, 0),
                                 ("ctxpool.restart_budget", self.ctxpool_restart_budget, 0),
                                 ("ctxpool.hang_budget", self.ctxpool_hang_budget, 1)):
            if value < low:
                raise ConfigError(f"{name} must be >= {low}, got {value}")
        resident = self.ctxpool_resident_mb
        if resident != "auto" and (isinstance(resident, bool) or not isinstance(resident, int) or resident < 0):
            raise ConfigError(f"ctxpool.resident_mb must be \"auto\" or an integer >= 0, got {resident!r}")
        if not (math.isfinite(self.ctxpool_timeout_grace_ms) and self.ctxpool_timeout_grace_ms >= 0):
            raise ConfigError(f"ctxpool.timeout_grace_ms must be a number >= 0, got {self.ctxpool_timeout_grace_ms}")
        self.ctxpool_register_gid()
        if any(not isinstance(d, str) or not os.path.isabs(d) for d in self.ctxpool_python_path):
            raise ConfigError(f"ctxpool.python_path must be a list of absolute directories, "
                              f"got {self.ctxpool_python_path!r}")
        if self.cluster_endpoint is not None and not self.cluster_endpoint.startswith("tcp://"):
            raise ConfigError(f"cluster.endpoint must be tcp://HOST:PORT, got {self.cluster_endpoint!r}")
        if self.cluster_events_endpoint and not self.cluster_events_endpoint.startswith("tcp://"):
            raise ConfigError(f"cluster.events_endpoint must be tcp://HOST:PORT or empty, "
                              f"got {self.cluster_events_endpoint!r}")
        if self.cluster_endpoint is not None and self.cluster_endpoint == self.cluster_events_endpoint:
            raise ConfigError("cluster.endpoint and cluster.events_endpoint must differ "
                              f"(both are {self.cluster_endpoint!r})")
        if not (math.isfinite(self.cluster_protect_s) and self.cluster_protect_s >= 0):
            raise ConfigError(f"cluster.protect_s must be a number >= 0, got {self.cluster_protect_s}")
        if not (math.isfinite(self.cluster_health_interval_s) and self.cluster_health_interval_s > 0):
            raise ConfigError(f"cluster.health_interval_s must be a positive number, "
                              f"got {self.cluster_health_interval_s}")
        if self.local_max_connections < 1:
            raise ConfigError(f"local.max_connections must be >= 1, got {self.local_max_connections}")
        if self.local_max_connections_per_uid < 1:
            raise ConfigError("local.max_connections_per_uid must be >= 1, "
                              f"got {self.local_max_connections_per_uid}")
        if self.local_max_queued_kb < 64:
            raise ConfigError(f"local.max_queued_kb must be >= 64, got {self.local_max_queued_kb}")
        if self.memory_reserve_mb < 0:
            raise ConfigError(f"memory.reserve_mb must be >= 0, got {self.memory_reserve_mb}")
        allowance = self.memory_context_allowance_mb
        if allowance != "auto" and (isinstance(allowance, bool) or not isinstance(allowance, int) or allowance < 0):
            raise ConfigError(f"memory.context_allowance_mb must be \"auto\" or an integer >= 0, got {allowance!r}")
        if self.memory_host_proc and not os.path.isabs(self.memory_host_proc):
            raise ConfigError(f"memory.host_proc must be an absolute directory or empty, "
                              f"got {self.memory_host_proc!r}")
        try:
            self.policy()
        except ValueError as exc:
            raise ConfigError(str(exc).replace("quantum_ms", "scheduler.quantum_ms")) from None

    def policy(self) -> SchedulerPolicy:
        unknown = set(self.quantum_ms) - {w.wire for w in Workload}
        if unknown:
            raise ConfigError(f"scheduler.quantum_ms has unknown workload(s) {sorted(unknown)}; "
                              "valid: inference, training, best-effort")
        quanta = {Workload.parse(name): ms for name, ms in self.quantum_ms.items()}
        return SchedulerPolicy(quantum_ms=quanta, grace_ms=self.grace_ms)

    def ctxpool_register_gid(self) -> int | None:
        """The gid of ``ctxpool.register_group`` (None: root only). ConfigError if no such group."""
        group = self.ctxpool_register_group
        if group == "":
            return None
        if isinstance(group, bool) or (isinstance(group, int) and group < 0):
            raise ConfigError(f"ctxpool.register_group must be a group name or a gid >= 0, got {group!r}")
        if isinstance(group, int) or group.isdigit():
            return int(group)
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"ctxpool.register_group names group {group!r}, which does not exist on this host "
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
    "mps.devices": ("mps_devices", (list,)),
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
             "mps", "ctxpool", "cluster"}


def load_file(config: ServeConfig, path: str, *, required: bool) -> bool:
    """Apply the TOML file at ``path`` to ``config``. Returns False if it is absent
    and not ``required``; raises :class:`ConfigError` naming the key otherwise."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"config file {path} does not exist") from None
        return False
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    per_workload = {"scheduler.quantum_ms.": config.quantum_ms,
                    "memory.class_cap_percent.": config.memory_class_cap_percent}
    for key, value in _flatten(doc, path):
        table_prefix, workload = key.rsplit(".", 1)[0] + ".", key.rsplit(".", 1)[-1]
        if table_prefix in per_workload:  # [section.table] with one number per workload class
            if workload not in {w.wire for w in Workload}:
                raise ConfigError(f"{path}: unknown key {key!r} (workloads: inference, training, best-effort)")
            _check_type(path, key, value, (int, float))
            per_workload[table_prefix][workload] = float(value)
            continue
        spec = _KEYS.get(key)
        if spec is None:
            raise ConfigError(f"{path}: unknown key {key!r}; valid keys: "
                              f"{', '.join(sorted(_KEYS) + ['scheduler.quantum_ms.<workload>', 'memory.class_cap_percent.<workload>'])}")
        attr, types = spec
        _check_type(path, key, value, types)
        setattr(config, attr, float(value) if float in types else value)
    return True


def _flatten(doc: dict[str, Any], path: str, prefix: str = ""):
    for name, value in doc.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            if key not in _SECTIONS:
                raise ConfigError(f"{path}: unknown section [{key}]; valid sections: "
                                  f"{', '.join(sorted(_SECTIONS))}")
            yield from _flatten(value, path, key + ".")
        else:
            yield key, value


def _check_type(path: str, key: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int subclass in Python; a TOML true is never a number here.
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join("number" if t is float else {int: "integer", str: "string", list: "list"}[t] for t in types
                               if not (t is int and float in types))
        raise ConfigError(f"{path}: {key} must be a {expected}, got {value!r}")
