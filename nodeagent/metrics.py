"""Prometheus metrics of the daemon, in an injected registry: counters, histograms, and the state
gauges a custom collector reads at scrape time, every label set on every scrape. Labels take bounded
values, never a session, process or request id (why: docs/internals.md). :meth:`Metrics.catalogue`
lists every metric; README's table is generated from it (``python -m nodeagent.metrics``).
"""

from __future__ import annotations

import functools
import math
import re
import time
from bisect import bisect_left
from itertools import accumulate
from typing import Callable, Iterable, NamedTuple

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sharing import DeviceState, SessionState, Workload

# Token waits span sub-millisecond handoffs to multi-second queues.
_WAIT_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_HANDOFF_BUCKETS_S = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01)
_PARK_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_RECLAIM_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

WORKLOADS = tuple(w.wire for w in Workload)
SESSION_STATES = (*(s.value for s in SessionState), "stopped")  # stopped: SIGSTOPped by enforcement
DEVICE_STATES = tuple(s.value for s in DeviceState)
YIELD_REASONS = ("preempted", "quantum")
ENFORCEMENT_KINDS = ("stop", "revoke")
SUSPEND_OUTCOMES = ("suspended", "stopped", "timeout", "gone", "cancelled")
# Why a session was dropped without a bye (nodeagent.daemon.server: _drop's reasons).
SESSION_LOST_REASONS = ("process_exited", "disconnected", "not_reading", "bad_frame", "heartbeat")
# Where the loop contains a bug (nodeagent.daemon.server._contain, the endpoints' dispatch).
INTERNAL_ERROR_PLACES = ("serve", "cluster", "pidfd", "memory", "mps", "poll", "unreachable", "timers", "pace",
                         "status", "metrics")
DEVICE_FAULT_DOMAINS = ("mps", "context", "other")  # nodeagent.daemon.memory_watch: what an Xid ended
METRICS_HTTP_CLOSE_REASONS = ("timeout", "evicted", "refused", "bad_request")
# Claims a peer made that the daemon could not verify and refused (nodeagent.daemon.suspension, admission).
REFUSED_CLAIMS = ("borrower", "suspended", "resumed", "host_bytes")


class MetricDoc(NamedTuple):
    """One metric as Prometheus stores it: README's table is made of these."""

    name: str  # as exported: a counter's name ends in _total
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str


class SessionRow(NamedTuple):
    device: str
    workload: str
    state: str  # one of SESSION_STATES
    memory_bytes: int  # measured where the backend can (cuda), else declared
    host_bytes: int = 0  # host memory its client keeps for parked state (suspended/resumed.host_bytes)
    host_pinned: bool = False


class DeviceRow(NamedTuple):
    device: str
    lifecycle: str  # one of DEVICE_STATES
    lost: bool  # NVML reports the GPU lost
    token_held: bool  # a session holds (or is yielding) the token
    waiting: int  # sessions waiting for the token


_STATE_DOCS = (
    MetricDoc("nodeagent_sessions", "gauge", ("device", "workload", "state"),
              "Sessions by device, workload and state (every combination; 0 when none)"),
    MetricDoc("nodeagent_device_memory_bytes", "gauge", ("device", "workload"),
              "Device memory of the sessions of a workload: measured on cuda, declared on cpu"),
    MetricDoc("nodeagent_token_held", "gauge", ("device",),
              "1 while a session holds the device's token (or is yielding it), else 0"),
    MetricDoc("nodeagent_token_queue_length", "gauge", ("device",), "Sessions waiting for the device's token"),
    MetricDoc("nodeagent_device_state", "gauge", ("device", "state"),
              "1 for the device's lifecycle state (FREE, RUN, PROTECT, LENT, DRAINING), 0 for the others"),
    MetricDoc("nodeagent_device_lost", "gauge", ("device",), "1 while NVML reports the device lost, else 0"),
    MetricDoc("nodeagent_host_kept_bytes", "gauge", ("device", "pinned"),
              "Host memory the device's clients keep for their parked state (the buffer a park reuses), "
              "page-locked (pinned=\"true\") or not, as they report it"),
)


class _StateCollector(Collector):
    """State gauges computed at scrape time from the daemon's devices and sessions.
    Runs on the daemon's loop thread, between two of its steps (the metrics endpoint
    is in the loop): the row callables read, never change."""

    def __init__(self, devices: Callable[[], Iterable[DeviceRow]],
                 sessions: Callable[[], Iterable[SessionRow]]) -> None:
        self._devices = devices
        self._sessions = sessions

    def describe(self):
        return [GaugeMetricFamily(doc.name, doc.help, labels=doc.labels) for doc in _STATE_DOCS]

    def collect(self):
        sessions, memory, held, queue, state, lost, host = self.describe()
        devices = list(self._devices())
        counts = {(d.device, w, st): 0 for d in devices for w in WORKLOADS for st in SESSION_STATES}
        used = {(d.device, w): 0 for d in devices for w in WORKLOADS}
        kept = {(d.device, pinned): 0 for d in devices for pinned in ("true", "false")}
        for row in self._sessions():
            if row.host_bytes:
                key = (row.device, "true" if row.host_pinned else "false")
                kept[key] = kept.get(key, 0) + row.host_bytes
            key = (row.device, row.workload, row.state)
            counts[key] = counts.get(key, 0) + 1
            used[(row.device, row.workload)] = used.get((row.device, row.workload), 0) + row.memory_bytes
        for family, values in ((sessions, counts), (memory, used), (host, kept)):
            for key, n in values.items():
                family.add_metric(list(key), n)
        for d in devices:
            held.add_metric([d.device], 1 if d.token_held else 0)
            queue.add_metric([d.device], d.waiting)
            lost.add_metric([d.device], 1 if d.lost else 0)
            for name in DEVICE_STATES:
                state.add_metric([d.device, name], 1 if d.lifecycle == name else 0)
        return [sessions, memory, held, queue, state, lost, host]


# ------------------------------------------------------------------ instruments of the hot path


class _LoopInstrument(Collector):
    """A labelled counter or histogram written by the daemon's loop alone, on every handoff.

    ``prometheus_client``'s instruments take a lock per write and look a histogram's bucket
    up in a Python loop, which costs more than the daemon's own work on the path
    (docs/architecture.md, metrics). These keep plain floats (the loop is the only writer, and the metrics
    endpoint reads them between two of its steps) and export what ``prometheus_client`` does:
    the same families, samples and order, byte for byte in the text format (a test holds it).
    ``labels(...)``'s child is kept by the caller; a write is an addition."""

    _family_type: type

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...],
                 registry: CollectorRegistry | None = None) -> None:
        self._name = name
        self._help = help
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values):
        """The child for these label values (made on first use, exported from then on, at 0)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}, got {values!r}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def describe(self):
        return [self._family_type(self._name, self._help, labels=self._labelnames)]

    def collect(self):
        [family] = self.describe()
        for key, child in list(self._children.items()):
            family.add_metric(list(key), *child.sample())
        return [family]


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount

    def sample(self) -> tuple[float]:
        return (self.value,)


class LoopCounter(_LoopInstrument):
    """A counter the loop writes (see :class:`_LoopInstrument`); exported as ``<name>_total``."""

    _family_type = CounterMetricFamily

    def _new_child(self) -> _CounterChild:
        return _CounterChild()


class _HistogramChild:
    __slots__ = ("_bounds", "_le", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...], le: tuple[str, ...]) -> None:
        self._bounds = bounds
        self._le = le  # the bounds as the text format writes them
        self.counts = [0.0] * len(bounds)  # per bucket, not cumulative (the last is +Inf's)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1.0
        self.sum += amount

    def sample(self) -> tuple[list[tuple[str, float]], float]:
        return list(zip(self._le, accumulate(list(self.counts)))), self.sum


class LoopHistogram(_LoopInstrument):
    """A histogram the loop writes (see :class:`_LoopInstrument`): ``buckets`` are the upper
    bounds, ``+Inf`` added, a value counted in the first bucket it is not above."""

    _family_type = HistogramMetricFamily

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...], buckets: tuple[float, ...],
                 registry: CollectorRegistry | None = None) -> None:
        bounds = tuple(sorted(float(b) for b in buckets))
        self._bounds = bounds if bounds and bounds[-1] == math.inf else (*bounds, math.inf)
        self._le = tuple(floatToGoString(b) for b in self._bounds)
        super().__init__(name, help, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds, self._le)


class Metrics:
    """All metrics of one daemon, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # The *_created series double the series count and no dashboard reads them. The
        # switch is process-wide in prometheus_client; the daemon's process has only this registry.
        prometheus_client.disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self._docs: list[MetricDoc] = []
        # Written on every handoff, by the loop alone: see _LoopInstrument.
        self.token_wait = self._histogram(
            "nodeagent_token_wait_seconds", "Time from asking for a device token to its grant",
            ("device", "workload"), _WAIT_BUCKETS_S, loop=True)
        self.token_handoff = self._histogram(
            "nodeagent_token_handoff_seconds",
            "Time inside the daemon from a token's release to the next grant being sent", ("device",),
            _HANDOFF_BUCKETS_S, loop=True)
        self.slice_seconds = self._counter(
            "nodeagent_slice_seconds", "Time sessions held their device's token, by workload",
            ("device", "workload"), loop=True)
        self.yield_requests = self._counter(
            "nodeagent_yield_requests", "Requests to a token holder to yield (reason: preempted, quantum)",
            ("device", "reason"))
        self.enforcements = self._counter(
            "nodeagent_enforcements", "Holders that overran their yield deadline, by action taken (stop, revoke)",
            ("kind",))
        self.pace_changes = self._counter(
            "nodeagent_pace_changes",
            "Co-run: changes of the duty lower classes run at while a higher class holds (the controller's steps)",
            ("device",))
        self.pace_duty = self._gauge(
            "nodeagent_pace_duty_permille",
            "Co-run: permille of each pacing period lower classes may issue work while a higher class holds "
            "(0: paused, 1000: MPS priority alone)", ("device",))
        self.bad_requests = self._counter("nodeagent_bad_requests", "Frames refused with E_BAD_REQUEST")
        self.refused_claims = self._counter(
            "nodeagent_refused_claims",
            "Claims refused as unverified (borrower: a hello naming a job whose lend does not name the peer; "
            "suspended, resumed: a report no suspension asked for; host_bytes: more than the host's memory)",
            ("claim",))
        self.metrics_http_closed = self._counter(
            "nodeagent_metrics_http_closed",
            "Connections to this metrics endpoint it closed itself (timeout: no whole request and response within "
            "metrics.timeout_ms; evicted: idle when a new one needed its slot; refused: every slot busy; "
            "bad_request: answered with an error)", ("reason",))
        self.connections_refused = self._counter(
            "nodeagent_connections_refused",
            "Local connections refused: over local.max_connections or out of descriptors")
        self.internal_errors = self._counter(
            "nodeagent_internal_errors",
            "Bugs contained by the loop (one request or loop step lost, not the daemon), by where they happened",
            ("where",))
        self.suspends = self._counter(
            "nodeagent_suspends",
            "Whole-device suspensions, by outcome (suspended, stopped, timeout, gone, cancelled)", ("outcome",))
        self.resumes = self._counter("nodeagent_resumes", "Suspended sessions resumed")
        self.parked_bytes = self._counter(
            "nodeagent_parked_bytes", "Bytes of state clients parked in host memory when suspended")
        self.suspend_seconds = self._histogram(
            "nodeagent_suspend_seconds", "Time clients took to park their state (their measurement)", (),
            _PARK_BUCKETS_S)
        self.resume_seconds = self._histogram(
            "nodeagent_resume_seconds", "Time clients took to bring their state back (their measurement)", (),
            _PARK_BUCKETS_S)
        self.device_faults = self._counter(
            "nodeagent_device_faults",
            "Xid errors NVML reported, by what they ended (mps: every client of the device's MPS server; "
            "context: one CUDA context, NVML does not say whose; other: not a fault of a context)",
            ("device", "domain"))
        self.memory_violations = self._counter(
            "nodeagent_memory_violations",
            "Sessions found using more device memory than they declared (policy: warn, revoke, stop)",
            ("device", "policy"))
        self.sessions_lost = self._counter(
            "nodeagent_sessions_lost",
            "Sessions dropped because their client vanished (reason: process_exited, disconnected, not_reading, "
            "heartbeat, ...; a bye is not counted, nor a process that ended holding no token with no frame "
            "half-sent: a client never closed)", ("reason",))
        self.lends = self._counter("nodeagent_lends", "Devices lent to a borrower (a lend that changed the state)",
                                   ("device",))
        self.reclaims = self._counter("nodeagent_reclaims", "Reclaims of a lent device that finished",
                                      ("device",))
        self.reclaim_seconds = self._histogram(
            "nodeagent_reclaim_seconds", "Time from a reclaim's start until the borrower's sessions were off the device",
            (), _RECLAIM_BUCKETS_S)
        self.journal_write_failures = self._counter(
            "nodeagent_journal_write_failures",
            "State journal writes that failed (disk full, I/O error); what they carried is not durable")
        self.journal_ok = self._gauge(
            "nodeagent_journal_ok",
            "1 while the state journal takes writes; 0 from a failed write until one succeeds (sessions are then "
            "not durable), and without a journal")
        self._docs.extend(_STATE_DOCS)
        # Label values known from the start are exported at 0 from the first scrape (rates need a start).
        for counter, values in ((self.enforcements, ENFORCEMENT_KINDS), (self.suspends, SUSPEND_OUTCOMES),
                                (self.sessions_lost, SESSION_LOST_REASONS),
                                (self.internal_errors, INTERNAL_ERROR_PLACES),
                                (self.metrics_http_closed, METRICS_HTTP_CLOSE_REASONS),
                                (self.refused_claims, REFUSED_CLAIMS)):
            for value in values:
                counter.labels(value)

    def _counter(self, name: str, help: str, labels: tuple[str, ...] = (), loop: bool = False) -> Counter:
        self._docs.append(MetricDoc(name + "_total", "counter", labels, help))
        return (LoopCounter if loop else Counter)(name, help, labels, registry=self.registry)

    def _gauge(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Gauge:
        self._docs.append(MetricDoc(name, "gauge", labels, help))
        return Gauge(name, help, labels, registry=self.registry)

    def _histogram(self, name: str, help: str, labels: tuple[str, ...], buckets: tuple[float, ...],
                   loop: bool = False) -> Histogram:
        self._docs.append(MetricDoc(name, "histogram", labels, help))
        return (LoopHistogram if loop else Histogram)(name, help, labels, buckets=buckets, registry=self.registry)

    def catalogue(self) -> list[MetricDoc]:
        """Every metric the daemon exports, in README's order."""
        return list(self._docs)

    def watch(self, device_count: int, devices: Callable[[], Iterable[DeviceRow]],
              sessions: Callable[[], Iterable[SessionRow]], memory_policy: str = "warn") -> None:
        """Expose the state gauges from ``devices`` and ``sessions`` at scrape time, and
        start each device's counters and histograms at 0 (memory violations under the
        ``memory_policy`` in force: the only one this daemon can count)."""
        self.registry.register(_StateCollector(devices, sessions))
        for device in map(str, range(device_count)):
            self.lends.labels(device)
            self.reclaims.labels(device)
            self.memory_violations.labels(device, memory_policy)
            for domain in DEVICE_FAULT_DOMAINS:
                self.device_faults.labels(device, domain)
            for reason in YIELD_REASONS:
                self.yield_requests.labels(device, reason)
            for workload in WORKLOADS:
                self.slice_seconds.labels(device, workload)
                self.token_wait.labels(device, workload)


# ------------------------------------------------------------------ the text format, in steps

# Prometheus' text format 0.0.4: what `prometheus_client.generate_latest` writes, and the type
# a scrape is answered with.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LEGACY_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LEGACY_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_TYPE_SHOWN = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_NAME_SUFFIX = {"counter": "_total", "info": "_info"}  # what a family's name takes in HELP and TYPE
_CHECK_EVERY = 32  # samples between looks at the clock


class _OneFamily(Collector):
    def __init__(self, family) -> None:
        self._family = family

    def collect(self):
        return [self._family]


class Exposition:
    """``generate_latest(registry)``'s bytes, written in steps of about ``budget_s`` of
    CPU each, so that the loop serving a scrape can hand a token on between steps.

    A family is collected whole (one collector's ``collect``, the largest step: 3.3 ms
    for a histogram of 456 samples on 2 shared cores) and then written a few samples
    at a time; what it writes is byte for byte ``generate_latest``'s (a test holds it),
    and a family the fast path does not cover (names outside the legacy set,
    timestamps, OpenMetrics-only samples) is written by ``generate_latest`` itself."""

    def __init__(self, registry: Collector, clock: Callable[[], float] = time.perf_counter) -> None:
        self._families = iter(registry.collect())
        self._clock = clock
        self._parts: list[str] = []
        self._family = None  # the family being written, its samples' iterator, and its lines so far
        self._samples = None
        self._lines: list[str] = []
        self.cpu_s = 0.0  # spent in step() so far
        self.result: bytes | None = None  # set once every family is written

    def step(self, budget_s: float) -> bool:
        """Write for about ``budget_s``; True once :attr:`result` holds the whole exposition."""
        if self.result is not None:
            return True
        start = self._clock()
        deadline = start + budget_s
        try:
            while True:
                if self._samples is None:
                    family = next(self._families, None)
                    if family is None:
                        self.result = "".join(self._parts).encode("utf-8")
                        return True
                    self._begin(family)
                if self._write_samples(deadline):
                    self._parts.extend(self._lines)
                    self._samples = self._family = None
                if self._clock() >= deadline:
                    return False
        finally:
            self.cpu_s += self._clock() - start

    def _begin(self, family) -> None:
        self._family = family
        self._samples = iter(family.samples)
        self._lines = []
        if not _legacy(family.name):
            self._write_whole()
            return
        kind = family.type
        name = family.name + _NAME_SUFFIX.get(kind, "")
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        self._lines.append(f"# HELP {name} {doc}\n# TYPE {name} {_TYPE_SHOWN.get(kind, kind)}\n")

    def _write_whole(self) -> None:
        """Let ``generate_latest`` write the family, which it moves or quotes."""
        self._samples = iter(())
        self._lines[:] = [generate_latest(_OneFamily(self._family)).decode("utf-8")]

    def _write_samples(self, deadline: float) -> bool:
        """Lines of the family's samples until the deadline; True when it has no more."""
        lines, base = self._lines, self._family.name
        special = (base + "_created", base + "_gsum", base + "_gcount")
        n = 0
        for s in self._samples:
            if s.timestamp is not None or s.name in special or not _legacy(s.name) or \
                    not all(_legacy(k, True) for k in s.labels):
                self._write_whole()
                return True
            value = floatToGoString(s.value)
            if s.labels:
                labels = ",".join([f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items())])
                lines.append(f"{s.name}{{{labels}}} {value}\n")
            else:
                lines.append(f"{s.name} {value}\n")
            n += 1
            if n % _CHECK_EVERY == 0 and self._clock() >= deadline:
                return False
        return True


@functools.lru_cache(maxsize=4096)
def _legacy(name: str, label: bool = False) -> bool:
    """Whether generate_latest writes ``name`` as it is (no escaping, no quotes)."""
    return (_LEGACY_LABEL if label else _LEGACY_METRIC).match(name) is not None


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def markdown_table(docs: Iterable[MetricDoc]) -> str:
    """README's metrics table."""
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for doc in docs:
        labels = ", ".join(doc.labels) if doc.labels else "-"
        lines.append(f"| `{doc.name}` | {doc.type} | {labels} | {doc.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m nodeagent.metrics > the table for README.md
    print(markdown_table(Metrics(CollectorRegistry()).catalogue()), end="")
