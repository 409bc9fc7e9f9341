"""Prometheus metrics of the daemon.

The registry is injected so tests use a fresh one. Gauges that describe the
current state (sessions per device, workload and state) are read at scrape
time by a custom collector instead of being kept in step by hand.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("nodeagent.metrics")

# Token waits span sub-millisecond handoffs to multi-second queues.
_WAIT_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_HANDOFF_BUCKETS_S = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01)

class SessionRow(NamedTuple):
    device: str
    workload: str
    state: str  # idle | waiting | holding | yielding | stopped
    session: str
    memory_bytes: int  # measured where the backend can (cuda), else declared


class _SessionCollector(Collector):
    """State gauges computed at scrape time from the daemon's sessions."""

    def __init__(self, rows: Callable[[], Iterable[SessionRow]]) -> None:
        self._rows = rows

    def collect(self):
        sessions = GaugeMetricFamily("nodeagent_sessions", "Sessions by device, workload and state",
                                     labels=["device", "workload", "state"])
        memory = GaugeMetricFamily("nodeagent_device_memory_bytes",
                                   "Device memory per session: measured on cuda, declared on cpu",
                                   labels=["device", "session"])
        counts: dict[tuple[str, str, str], int] = {}
        for row in self._rows():
            key = (row.device, row.workload, row.state)
            counts[key] = counts.get(key, 0) + 1
            memory.add_metric([row.device, row.session], row.memory_bytes)
        for key, n in sorted(counts.items()):
            sessions.add_metric(list(key), n)
        yield sessions
        yield memory


class Metrics:
    """All metrics of one daemon, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.token_wait = Histogram(
            "nodeagent_token_wait_seconds", "Time from asking for a device token to its grant",
            ["device", "workload"], buckets=_WAIT_BUCKETS_S, registry=r)
        self.token_handoff = Histogram(
            "nodeagent_token_handoff_seconds",
            "Time inside the daemon from a token's release to the next grant being sent",
            ["device"], buckets=_HANDOFF_BUCKETS_S, registry=r)
        self.slice_seconds = Counter(
            "nodeagent_slice_seconds", "Time a session held its device token", ["session"], registry=r)
        self.yield_requests = Counter(
            "nodeagent_yield_requests", "Requests to a token holder to yield", ["device", "reason"], registry=r)
        self.enforcements = Counter(
            "nodeagent_enforcements", "Holders that overran their yield deadline, by action taken",
            ["kind"], registry=r)
        self.bad_requests = Counter(
            "nodeagent_bad_requests", "Frames refused with E_BAD_REQUEST", registry=r)
        self.connections_refused = Counter(
            "nodeagent_connections_refused", "Local connections refused: over local.max_connections or out of descriptors",
            registry=r)
        self.internal_errors = Counter(
            "nodeagent_internal_errors", "Bugs contained by the loop (one request or loop step lost, not the daemon)",
            ["where"], registry=r)
        self.suspends = Counter(
            "nodeagent_suspends", "Whole-device suspensions, by outcome (suspended, stopped, timeout, gone)",
            ["outcome"], registry=r)
        self.resumes = Counter("nodeagent_resumes", "Suspended sessions resumed", registry=r)
        self.parked_bytes = Counter(
            "nodeagent_parked_bytes", "Bytes of state clients parked in host memory when suspended", registry=r)
        self.suspend_seconds = Histogram(
            "nodeagent_suspend_seconds", "Time clients took to park their state (their measurement)",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.resume_seconds = Histogram(
            "nodeagent_resume_seconds", "Time clients took to bring their state back (their measurement)",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.memory_violations = Counter(
            "nodeagent_memory_violations", "Sessions found using more device memory than they declared",
            ["device", "policy"], registry=r)
        self.sessions_lost = Counter(
            "nodeagent_sessions_lost", "Sessions dropped because their client vanished", ["reason"], registry=r)
        self.journal_write_failures = Counter(
            "nodeagent_journal_write_failures",
            "State journal writes that failed (disk full, I/O error); what they carried is not durable", registry=r)
        self.journal_ok = Gauge(
            "nodeagent_journal_ok", "1 while the state journal takes writes; 0 from a failed write until one succeeds",
            registry=r)
        self._session_collector: _SessionCollector | None = None

    def watch_sessions(self, rows: Callable[[], Iterable[SessionRow]]) -> None:
        """Expose ``nodeagent_sessions`` from ``rows`` at scrape time."""
        self._session_collector = _SessionCollector(rows)
        self.registry.register(self._session_collector)

    def forget_session(self, session: str) -> None:
        """Drop the label sets of a departed session."""
        try:
            self.slice_seconds.remove(session)
        except KeyError:
            pass

    def serve_http(self, port: int, addr: str = "127.0.0.1"):
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        log.info("[metrics] serving http://%s:%d/metrics", addr, server.server_port)
        return server, thread
