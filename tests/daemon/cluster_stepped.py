"""ClusterEndpoint with fakes for all it is given, to be stepped by hand: no daemon, no sockets."""

from __future__ import annotations

import zmq
from prometheus_client import CollectorRegistry

from nodeagent.config import ServeConfig
from nodeagent.daemon.bus import Bus, ServerView
from nodeagent.daemon.cluster import SHARED_OPS, ClusterEndpoint, ClusterRoute
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.metrics import Metrics
from sharing.suspension import Suspension
from tests.daemon_parts import FakeDevices, loop_handle, make_tokens, replies


PLACEMENT = ClusterRoute(b"placement-1")


class Recorder:
    """Stands in for the events publisher (and for everything the endpoint calls out to)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int | None, dict]] = []
        self.sent: list[tuple[object, object]] = []
        self.suspends: list[tuple[str, float, str]] = []  # (session, deadline_ms, reason)
        self.parked: dict[str, int] = {}  # session -> the bytes its client says it parked (a test sets it)

    def publish(self, kind: str, device: int | None = None, session: str | None = None, **data) -> None:
        self.events.append((kind, device, data))

    def of(self, kind: str) -> list[dict]:
        return [data for k, _, data in self.events if k == kind]

    def to(self, route) -> list:
        return [msg for r, msg in self.sent if r == route]


def stepped_endpoint():
    """(endpoint, recorder, sessions, schedulers) for two devices."""
    config = ServeConfig(backend="cpu", cluster_node="n-test")
    rec = Recorder()
    sessions = SessionTable()
    metrics = Metrics(CollectorRegistry())
    context = zmq.Context()
    devices = FakeDevices(2)
    tokens = make_tokens(count=2, sessions=sessions, metrics=metrics, config=config)
    schedulers = tokens.schedulers

    class ScriptedSuspensions:
        def __init__(self) -> None:
            self.machines: dict[str, Suspension] = {}

        def begin(self, s: Session, deadline_ms: float, now: float, reason: str) -> None:
            rec.suspends.append((s.id, deadline_ms, reason))
            machine = self.machines.setdefault(s.id, Suspension())
            machine.request(now, deadline_ms, reason, waiting=False)  # what the real one's machine does first

        def under_way(self, s: Session) -> bool:
            return any(s.id == sid for sid, _, _ in rec.suspends)

        def state(self, s: Session):
            return self.machines.get(s.id, Suspension()).state

        def parked_bytes(self, s: Session) -> int:
            return rec.parked.get(s.id, 0)

    server = ServerView(context=context, handlers={kind: (lambda *args: None) for kind in SHARED_OPS},
                        dispatch=lambda *args, **kwargs: None, status=lambda now: None, boot=lambda: 7, started=0.0,
                        metrics=metrics, replies=replies(rec.sent))
    cluster = ClusterEndpoint(config=config, loop=loop_handle(clock=lambda: 0.0), server=server, tokens=tokens,
                              sessions=sessions, journal=JournalWriter(None, metrics, Bus()),
                              suspensions=ScriptedSuspensions(), devices=devices)
    cluster.events = rec
    cluster.test_lost_devices = devices.lost  # the table the test marks devices lost in
    yield cluster, rec, sessions, schedulers
    cluster.close()
    sessions.close()
    context.term()
