"""A status at a thousand sessions is built a chunk per loop turn: a token handoff that
arrives meanwhile is served between chunks, not after the whole status (issue 12).

The server runs in this process with its local endpoint replaced by a recorder, so
the order in which the daemon sends things is exact, not a matter of timing."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from client_lib import codec
from client_lib import protocol as p
from nodeagent.config import ServeConfig
from nodeagent.daemon import server as server_module
from nodeagent.daemon.server import AgentServer
from nodeagent.daemon.sessions import Session
from nodeagent.devices import CpuBackend
from nodeagent.metrics import Metrics
from sharing import Workload


class RecordingLocal:
    """Stands in for the LocalEndpoint: every message the daemon sends, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, object]] = []

    def send(self, route, body: bytes) -> bool:
        self.sent.append((route, codec.decode_reply(body)))
        return True

    def of(self, route) -> list:
        return [msg for r, msg in self.sent if r == route]


def _server(workdir: str, idle_sessions: int) -> tuple[AgentServer, RecordingLocal]:
    config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/status.sock", state_dir=workdir)
    server = AgentServer(config, CpuBackend(1), metrics=Metrics(CollectorRegistry()))
    local = RecordingLocal()
    server._local = local
    now = time.monotonic()
    for i in range(idle_sessions):
        _add(server, f"idle-{i:04d}", route=f"idle-route-{i}", now=now)
    return server, local


def _add(server: AgentServer, sid: str, route, now: float) -> Session:
    s = Session(id=sid, key="k", route=route, name=sid, claimed_pid=1, verified_pid=None, start_ticks=None,
                uid=0, workload=Workload.TRAINING, weight=1.0, device=0, memory_mb=0, created=now, last_seen=now)
    server._add_session(s, now)
    return s


def test_a_handoff_is_served_between_the_chunks_of_a_big_status(workdir):
    server, local = _server(workdir, idle_sessions=1000)
    now = time.monotonic()
    a, b = _add(server, "a", "route-a", now), _add(server, "b", "route-b", now)
    server._gate.ask(a, now)
    server._gate.ask(b, now)
    [grant_a] = local.of("route-a")
    assert isinstance(grant_a, p.Grant) and b.grant is None

    server._on_status("route-status", p.StatusRequest(id=7), None, now)
    assert local.of("route-status") == []  # one chunk built, the rest waits for later turns
    assert server._poll_timeout_ms() == 0  # and the loop comes back for it at once
    server._on_release("route-a", p.Release(id=8, grant=grant_a.grant, quiet=True), None, now)
    turns = 0
    while server._status_jobs:
        server._status_step()
        turns += 1
    order = [(route, type(msg)) for route, msg in local.sent[1:]]
    assert order == [("route-b", p.Grant), ("route-status", p.StatusReply)]  # the handoff did not wait
    [reply] = local.of("route-status")
    assert reply.id == 7 and len(reply.devices[0].sessions) == 1002
    assert reply.devices[0].holder == "a"  # the schedulers' state as it was when the status was asked
    assert turns == 1002 // server_module.STATUS_CHUNK  # rows a chunk at a time, after the first
    assert server.status().devices[0].holder == "b"  # the whole status at once, for the cluster endpoint


def test_a_small_status_is_answered_at_once(workdir):
    server, local = _server(workdir, idle_sessions=10)
    server._on_status("route-status", p.StatusRequest(id=3), None, time.monotonic())
    [reply] = local.of("route-status")
    assert isinstance(reply, p.StatusReply) and reply.id == 3 and not server._status_jobs


def test_statuses_under_way_are_bounded_and_a_bug_costs_only_its_own(workdir, monkeypatch):
    server, local = _server(workdir, idle_sessions=2 * server_module.STATUS_CHUNK)
    now = time.monotonic()
    for i in range(server_module.STATUS_JOBS_MAX):
        server._on_status(f"peer-{i}", p.StatusRequest(id=i + 1), None, now)
    server._on_status("one-too-many", p.StatusRequest(id=99), None, now)
    [refusal] = local.of("one-too-many")
    assert isinstance(refusal, p.Error) and refusal.code == p.ErrorCode.UNAVAILABLE and refusal.id == 99

    real = server._serving.workers_share
    calls = {"n": 0}

    def broken_once(device):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug while building a status")
        return real(device)

    monkeypatch.setattr(server._serving, "workers_share", broken_once)
    while server._status_jobs:
        server._status_step()
    [first] = local.of("peer-0")
    assert isinstance(first, p.Error) and first.code == p.ErrorCode.INTERNAL and first.id == 1
    answered = [local.of(f"peer-{i}")[0] for i in range(1, server_module.STATUS_JOBS_MAX)]
    assert all(isinstance(r, p.StatusReply) for r in answered)
    assert server.metrics.internal_errors.labels("status")._value.get() == 1
