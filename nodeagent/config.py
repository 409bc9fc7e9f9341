"""Daemon settings, each declared once as a field of :class:`ServeConfig` (:func:`setting`: its
key in the TOML file, type, default, bounds, help and flag). The example file, the file's keys,
validation and the ``serve`` flags are derived from those declarations.

Defaults, then the file, then flags. Unknown keys and bad values stop the daemon at start-up with
an error naming the key, so a typo never silently leaves a default in force.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import grp
import math
import os
import shutil
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from client_lib.endpoint import ENV_ENDPOINT, client_endpoint, daemon_endpoint
from client_lib.framing import parse_endpoint
from client_lib.limits import DEFAULT_SUSPEND_DEADLINE_MS
from sharing import SchedulerPolicy, Workload
from sharing.corun import PaceController

DEFAULT_CONFIG_PATH = "/etc/nodeagent/nodeagent.toml"


def default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/nodeagent"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "nodeagent")


WORKLOADS = tuple(w.wire for w in Workload)
_NAMED_DUTIES = {"adaptive": None, "pause": 0, "free": 1000}  # corun.duty's words, as permille (None: adaptive)


class ConfigError(ValueError):
    """A setting with a bad value, named in the message. ``key``: its dotted name in the file (None where
    no one setting is at fault); ``problem``: the message without its subject, so that the command line
    can name the flag or the environment variable the value came from instead."""

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


# ------------------------------------------------------------ declaring a setting


@dataclass(frozen=True)
class Setting:
    """One setting as :func:`setting` declared it; ``attr`` and ``types`` come from its field."""

    key: str  # dotted key in the file; a dict-typed setting is a table with one number per workload class
    help: str  # one line: the example file's comment and the flag's --help
    default: Any = None  # None: off unless set
    factory: Callable[[], Any] | None = None  # makes the default (a host's own where ``example`` is given)
    low: float | None = None  # bounds of a number (a bounded setting has a low one)
    high: float | None = None
    above: bool = False  # ``low`` itself is not allowed
    unit: str = ""  # named in the bounds' message ("a positive number of ms")
    choices: tuple[str, ...] = ()
    words: tuple[str, ...] = ()  # strings allowed beside a number or a list ("auto")
    check: Callable[[Any], str | None] | None = None  # what else is wrong with a value (a clause), or None
    flag: str | None = None  # its ``serve`` flag, if it has one
    metavar: str | None = None
    env: str | None = None  # an environment variable that sets its default
    example: Any = None  # written commented out in the example file, where the default is not written
    attr: str = ""
    types: tuple[type, ...] = ()  # what the file may give; float takes an int too

    def integral(self) -> bool:
        return int in self.types and float not in self.types

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default

    def problem(self, value: Any) -> str | None:
        """Why ``value`` cannot be this setting's (a clause after its key), or None."""
        if value is None and self.default_value() is None:
            return None  # off
        if self.choices:
            return None if value in self.choices else f"must be one of {', '.join(self.choices)}, got {value!r}"
        if value in self.words:
            return None
        if self.low is not None and not self.within(value):
            return f"must be {self.allowed()}, got {_shown(value)}"
        return self.check(value) if self.check is not None else None

    def within(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integral() and not isinstance(value, int):
            return False
        return (value > self.low if self.above else value >= self.low) and (self.high is None or value <= self.high)

    def allowed(self) -> str:
        """What the bounds allow, as the error says it: ``in 1..1000``, ``a positive number``."""
        of = f" of {self.unit}" if self.unit else ""
        if self.high is not None:
            span = f"({self.low:g}, {self.high:g}]" if self.above else f"{self.low:g}..{self.high:g}"
            allowed = f"a number{of} in {span}" if of else f"in {span}"
        elif self.above:
            allowed = f"a positive number{of}" if self.low == 0 else f"a number{of} > {self.low:g}"
        elif not self.integral():
            allowed = f"a number >= {self.low:g}"
        else:
            allowed = f"an integer >= {self.low:g}" if self.words else f">= {self.low:g}"
        return " or ".join([*(f'"{word}"' for word in self.words), allowed])

    def shown_default(self) -> str:
        """The default as ``--help`` shows it: ``default: 100``, ``default here: /run/...``, or ``""``."""
        value = self.default_value()
        if dict in self.types:
            return "defaults: " + " ".join(f"{name}={ms:g}" for name, ms in value.items())
        if self.example is not None and self.factory is not None:  # the host's own
            return f"default here: {value}" + (f"; ${self.env} overrides it" if self.env else "")
        if value is None:
            return ""
        return f"default: {value:g}" if isinstance(value, float) else f"default: {value}"


def setting(key: str, default: Any = None, *, factory: Callable[[], Any] | None = None, **declared: Any) -> Any:
    """A field of :class:`ServeConfig` declaring the setting at ``key`` (the rest: :class:`Setting`)."""
    meta = {"setting": Setting(key, default=default, factory=factory, **declared)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)


def _must(ok: Callable[[Any], bool], allowed: str) -> Callable[[Any], str | None]:
    """A check: None where ``ok(value)``, else ``must be ALLOWED, got VALUE``."""
    return lambda value: None if ok(value) else f"must be {allowed}, got {value!r}"


def _index_list(value: Any) -> bool:
    return isinstance(value, list) and all(not isinstance(d, bool) and isinstance(d, int) and d >= 0 for d in value)


@dataclass
class ServeConfig:
    """The daemon's settings; each field declares one (its key, default, bounds, help and flag)."""

    backend: str = setting("backend", "auto", choices=("auto", "cuda", "cpu"), flag="--backend",
                           help="device backend; auto picks cuda when NVML initialises, else cpu")
    cpu_devices: int = setting("cpu_devices", 1, low=1, flag="--cpu-devices", metavar="N",
                               help="logical devices the cpu backend exposes")
    endpoint: str = setting("endpoint", factory=daemon_endpoint, example="ipc:///run/nodeagent/agent.sock",
                            check=endpoint_problem, flag="--endpoint", env=ENV_ENDPOINT,
                            help="ipc://PATH or tcp://HOST:PORT to listen on")
    state_dir: str = setting("state_dir", factory=default_state_dir, example="/var/lib/nodeagent",
                             flag="--state-dir", metavar="DIR", help="where the journal (state.db) is kept")
    log_level: str = setting("log_level", "info", choices=("debug", "info", "warning", "error"), flag="--log-level",
                             help="the least severe log lines written")

    grace_ms: float = setting("scheduler.grace_ms", 100.0, low=0, above=True, flag="--grace-ms",
                              help="a holder asked to yield has this long before enforcement")
    enforce: str = setting("scheduler.enforce", "stop", choices=("stop", "revoke"), flag="--enforce",
                           help="a holder past its yield deadline: stop (SIGSTOP it if its identity is verified, "
                                "else revoke) or revoke (never signal)")
    sharing: str = setting("scheduler.sharing", "auto", choices=("auto", "corun", "exclusive"), flag="--sharing",
                           help="how classes share a device: corun (each class its own token; a higher class is "
                                "granted at once and lower ones are paced) or exclusive (one holder; a higher class "
                                "preempts); auto: corun on cuda, exclusive on cpu")
    linger_ms: float = setting("scheduler.linger_ms", 2.0, low=0, high=1000, unit="ms",
                               help="exclusive: after a higher class's slice, the token waits this long for its next "
                                    "request before a lower class gets it (a burst pays one preemption)")
    quantum_ms: dict[str, float] = setting(
        "scheduler.quantum_ms", factory=lambda: {"inference": 50.0, "training": 200.0, "best-effort": 200.0},
        low=0, above=True, unit="ms", flag="--quantum-ms", metavar="CLASS=MS",
        help="time slice of each workload class")

    corun_duty: str | int = setting("corun.duty", "adaptive", flag="--corun-duty",
                                    metavar="adaptive|pause|free|PERMILLE",
                                    help="co-run: how lower classes are paced while a higher class holds: adaptive "
                                         "(steered by the higher class's slice times), pause, free (MPS priority "
                                         "only) or the permille 0..1000 of each period they may run")
    corun_tolerance_percent: float = setting("corun.tolerance_percent", 5.0, low=0, above=True, high=500,
                                             help="adaptive: how much longer than its reference a higher-class "
                                                  "slice may take")
    corun_period_ms: float = setting("corun.period_ms", 10.0, low=1, high=1000,
                                     help="the pacing period lower classes run and pause in")
    corun_lower_sm_percent: int = setting("corun.lower_sm_percent", 0, low=0, high=100,
                                          help="on an MPS device, cap lower classes to this percent of the SMs "
                                               "(0: no cap), so that a higher class arriving finds SMs free; a "
                                               "partition overrides it")

    heartbeat_ms: float = setting("heartbeat.interval_ms", 1000.0, low=0, above=True, flag="--heartbeat-ms",
                                  help="clients send a heartbeat at least this often")
    heartbeat_misses: int = setting("heartbeat.misses", 3, low=1,
                                    help="silent for this many intervals: the session is lost")

    local_max_connections: int = setting("local.max_connections", 4096, low=1,
                                         help="connections to the local socket; more are refused with "
                                              "E_UNAVAILABLE, never an abort")
    local_max_connections_per_uid: int = setting("local.max_connections_per_uid", 1024, low=1,
                                                 help="of them, what one user may hold (so that one user cannot "
                                                      "take every slot)")
    local_max_queued_kb: int = setting("local.max_queued_kb", 4096, low=64,
                                       help="a peer with more than this queued to it (not reading) is dropped")

    memory_policy: str = setting("memory.policy", "warn", choices=("warn", "revoke", "stop"), flag="--memory-policy",
                                 help="a session using more device memory than it declared")
    memory_watch_ms: float = setting("memory.watch_interval_ms", 1000.0, low=0, above=True,
                                     help="how often per-process device memory is read (cuda)")
    memory_context_allowance_mb: int | str = setting(
        "memory.context_allowance_mb", "auto", words=("auto",), low=0,
        help="per process, beyond its session's declaration (its CUDA context); auto: 512 on cuda, else 0")
    memory_host_proc: str = setting(
        "memory.host_proc", "", check=_must(lambda v: v == "" or os.path.isabs(v), "an absolute directory or empty"),
        help="the host's /proc, mounted for a daemon in its own pid namespace (see README); empty: the pids NVML "
             "gives are read as the daemon's")
    memory_reserve_mb: int = setting("memory.reserve_mb", 0, low=0, help="device memory kept out of admission")
    memory_make_room: str = setting("memory.make_room", "suspend", choices=("suspend", "refuse"),
                                    help="a session that does not fit: suspend (lower-class sessions, to fit it) or "
                                         "refuse")
    memory_make_room_deadline_ms: float = setting("memory.make_room_deadline_ms", DEFAULT_SUSPEND_DEADLINE_MS, low=0,
                                                  above=True, help="how long those sessions get to park their state")
    memory_class_cap_percent: dict[str, float] = setting(
        "memory.class_cap_percent", factory=dict, example={"best-effort": 50.0}, low=0, above=True, high=100,
        help="most of a device's capacity one class may declare in all (default 100)")

    metrics_port: int | None = setting("metrics.port", None, example=9400, low=0, high=65535, flag="--metrics-port",
                                       metavar="P", help="serve Prometheus metrics on this port (off unless set; 0 "
                                                         "picks one)")
    metrics_addr: str = setting("metrics.addr", "127.0.0.1", flag="--metrics-addr", metavar="ADDR",
                                help="address for the metrics server")
    metrics_max_connections: int = setting("metrics.max_connections", 64, low=1, high=4096,
                                           help="scrapers at once; a new one past it takes the slot of the oldest "
                                                "idle one")
    metrics_timeout_ms: float = setting("metrics.timeout_ms", 10000.0, low=0, above=True,
                                        help="a scrape connection gets this long for each request and its response")

    mps_devices: list[int] | str = setting(
        "mps.devices", "auto", words=("auto",), check=_must(_index_list, "\"auto\" or a list of device indices"),
        help="device indices that get an MPS control daemon; []: MPS off; auto: every GPU when the daemon co-runs "
             "on cuda as root and control_binary is found (lower classes then run at MPS client priority 1: see "
             "docs/architecture.md, Co-run)")
    mps_control_binary: str = setting("mps.control_binary", "nvidia-cuda-mps-control",
                                      help="the MPS control program: a name on PATH, or a path")
    mps_min_percent: int = setting("mps.min_percent", 5, low=1, high=100,
                                   help="smallest SM share a partition may give a session")

    ctxpool_enabled: str = setting("ctxpool.enabled", "off", choices=("off", "on", "auto"), flag="--ctxpool",
                                   help="warm worker processes for server-side models (they hold device memory: "
                                        "contexts, pools, resident models); auto starts them where torch is "
                                        "importable by the daemon")
    ctxpool_workers_per_device: int = setting("ctxpool.workers_per_device", 2, low=1,
                                              help="one active, the rest on standby with warm contexts")
    ctxpool_pool_mb: int = setting("ctxpool.pool_mb", 0, low=0,
                                   help="device memory each worker reserves in its allocator at start")
    ctxpool_resident_mb: int | str = setting(
        "ctxpool.resident_mb", "auto", words=("auto",), low=0,
        help="device memory each worker may keep models resident in (LRU), held in admission; auto: half of what "
             "contexts, pools and sessions leave at start, split between workers (nodeagent.memory."
             "auto_resident_mb); 0: no bound, not held")
    ctxpool_python_path: list[str] = setting(
        "ctxpool.python_path", factory=list, help="directories workers add to sys.path to import model factories",
        check=_must(lambda v: isinstance(v, list) and all(isinstance(d, str) and os.path.isabs(d) for d in v),
                    "a list of absolute directories"))
    ctxpool_restart_budget: int = setting("ctxpool.restart_budget", 5, low=0,
                                          help="worker deaths per device in 60 s before it stops replacing them")
    ctxpool_hang_budget: int = setting("ctxpool.hang_budget", 3, low=1,
                                       help="a model's requests hanging (worker replaced) this often in 10 min: "
                                            "refused for a while")
    ctxpool_timeout_grace_ms: float = setting("ctxpool.timeout_grace_ms", 2000.0, low=0,
                                              help="a worker still running a request this long after its timeout "
                                                   "is replaced")
    ctxpool_register_group: str | int = setting("ctxpool.register_group", "",
                                                help='group (name or gid) whose members may register models; "": '
                                                     "root only")

    cluster_endpoint: str | None = setting("cluster.endpoint", None, example="tcp://0.0.0.0:7410",
                                           check=_must(lambda v: v.startswith("tcp://"), "tcp://HOST:PORT"),
                                           help="placement API (CURVE); off unless set")
    cluster_events_endpoint: str = setting(
        "cluster.events_endpoint", "tcp://0.0.0.0:7411",
        check=_must(lambda v: v == "" or v.startswith("tcp://"), "tcp://HOST:PORT or empty"),
        help='PUB socket for events (CURVE), bound with the endpoint; "" for none')
    cluster_keys_dir: str = setting("cluster.keys_dir", "/etc/nodeagent/keys",
                                    help="server.key_secret and allowed/*.key (`nodeagent keys generate`)")
    cluster_protect_s: float = setting("cluster.protect_s", 60.0, low=0,
                                       help="a device whose inference went idle is not lent until this long after")
    cluster_node: str = setting("cluster.node", "", help='node name in inventory and events; "": the hostname')
    cluster_health_interval_s: float = setting("cluster.health_interval_s", 5.0, low=0, above=True,
                                               help="how often a health event is published")

    def validate(self) -> None:
        """Raise :class:`ConfigError` (with its ``key``) for the first setting that cannot be used."""
        for s in settings(type(self)):
            value = getattr(self, s.attr)
            if dict in s.types:  # a table of its own: one key per workload class
                for name, entry in value.items():
                    if name not in WORKLOADS:
                        raise _bad(f"{s.key}.{name}", f"has unknown workload class {name!r}"
                                   f"{did_you_mean(name, WORKLOADS)} (classes: {', '.join(WORKLOADS)})", subject=s.key)
                    if not s.within(entry):
                        raise _bad(f"{s.key}.{name}", f"must be {s.allowed()}, got {name}={_shown(entry)}",
                                   subject=s.key)
            elif (problem := s.problem(value)) is not None:
                raise _bad(s.key, problem)
        if self.cluster_endpoint is not None and self.cluster_endpoint == self.cluster_events_endpoint:
            raise ConfigError("cluster.endpoint and cluster.events_endpoint must differ "
                              f"(both are {self.cluster_endpoint!r})")
        self.corun_fixed_duty()
        self.ctxpool_register_gid()
        self.policy()

    def policy(self) -> SchedulerPolicy:
        """The scheduling policy these settings give (validate first: it names an unknown class's key)."""
        quanta = {Workload.parse(name): ms for name, ms in self.quantum_ms.items()}
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
        if isinstance(duty, str) and duty in _NAMED_DUTIES:
            return _NAMED_DUTIES[duty]
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


# ------------------------------------------------------------ what the declarations give


def settings(cls: type | None = None) -> tuple[Setting, ...]:
    """Every setting declared on ``cls`` (default: this module's :class:`ServeConfig`), in order."""
    return _declared(cls or ServeConfig)


@functools.cache
def _declared(cls: type) -> tuple[Setting, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(dataclasses.replace(f.metadata["setting"], attr=f.name, types=_file_types(hints[f.name]))
                 for f in dataclasses.fields(cls) if "setting" in f.metadata)


def _file_types(hint: Any) -> tuple[type, ...]:
    """What a file may give for a field typed ``hint``: a float takes an int too; None is "off", not a value."""
    parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    found: list[type] = []
    for part in parts:
        part = typing.get_origin(part) or part
        found += [int, float] if part is float else [] if part is type(None) else [part]
    return tuple(dict.fromkeys(found))


def example_toml() -> str:
    """The commented example file, every setting at its default: what `nodeagent config-example` prints."""
    blocks: dict[str, list[str]] = {"": [f"# {DEFAULT_CONFIG_PATH}: every key is optional; these are the defaults."]}
    for s in settings():
        shown = s.example if s.example is not None else s.default_value()
        off = "# " if s.example is not None else ""  # a default the file cannot hold: shown, not set
        if dict in s.types:
            blocks[s.key] = [*_commented(f"[{s.key}]", s.help),
                             *(f"{off}{name} = {_toml(float(v))}" for name, v in shown.items())]
            continue
        section, _, name = s.key.rpartition(".")
        choices = f"{' | '.join(s.choices)}: " if s.choices else ""
        blocks.setdefault(section, [f"[{section}]"]).extend(_commented(f"{off}{name} = {_toml(shown)}",
                                                                       choices + s.help))
    return "\n\n".join("\n".join(lines) for lines in blocks.values()) + "\n"


def _commented(line: str, comment: str) -> list[str]:
    """``line`` with ``comment`` beside it from column 28, wrapped to 110 columns."""
    column = max(len(line) + 2, 28)
    wrapped = textwrap.wrap(comment, width=max(108 - column, 40)) or [""]
    return [f"{line:<{column}}# {wrapped[0]}", *(f"{'':<{column}}# {more}" for more in wrapped[1:])]


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
    declared = settings(type(config))
    tables = {s.key: s for s in declared if dict in s.types}
    keys = {s.key: s for s in declared if dict not in s.types}
    for key, value in _flatten(doc, path, _sections(declared)):
        table, _, workload = key.rpartition(".")
        if table in tables:  # [section.table] with one number per workload class
            if workload not in WORKLOADS:
                guess = nearest(workload, WORKLOADS)
                hint = f"; did you mean {table + '.' + guess!r}?" if guess is not None else ""
                raise ConfigError(f"{path}: unknown key {key!r}{hint} (workload classes: {', '.join(WORKLOADS)})")
            _check_type(path, key, value, (int, float))
            getattr(config, tables[table].attr)[workload] = float(value)
        elif key in keys:
            _check_type(path, key, value, keys[key].types)
            setattr(config, keys[key].attr, float(value) if float in keys[key].types else value)
        else:
            known = [*keys, *(f"{table}.{w}" for table in tables for w in WORKLOADS)]
            raise ConfigError(f"{path}: unknown key {key!r}{did_you_mean(key, known)} "
                              "(`nodeagent config-example` prints every key)")
        if applied is not None:
            applied.add(key)
    return True


def _sections(declared: tuple[Setting, ...]) -> set[str]:
    """Every [section] the declared keys live in, and each table."""
    found = set()
    for s in declared:
        parts = s.key.split(".")
        found.update(".".join(parts[:end]) for end in range(1, len(parts) + (dict in s.types)))
    return found


def _flatten(doc: dict[str, Any], path: str, sections: set[str], prefix: str = ""):
    for name, value in doc.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            if key not in sections:
                guess = nearest(key, sections)
                hint = f"; did you mean [{guess}]?" if guess is not None else ""
                raise ConfigError(f"{path}: unknown section [{key}]{hint} (sections: {', '.join(sorted(sections))})")
            yield from _flatten(value, path, sections, key + ".")
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
