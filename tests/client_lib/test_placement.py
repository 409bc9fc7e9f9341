"""client_lib.placement against small scripted CURVE nodes (a ROUTER and an XPUB per node, in
threads, real tcp loopback sockets, pyzmq's authenticator over a generated allowed/ directory).

The daemon's own cluster endpoint is tested in tests/daemon/test_cluster.py; here the node side is a
script, so that slow, dead, lying and late nodes can be had on cue.
"""

from __future__ import annotations

import heapq
import os
import queue
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq
from zmq.auth.thread import ThreadAuthenticator

from client_lib import codec
from client_lib import protocol as p
from client_lib.placement import (ClientKeys, NodeTimeoutError, PlacementClient, PlacementError,
                                  load_server_public)
from nodeagent import keys as node_keys
from tests.conftest import wait_for
from tests.conftest import free_port

# A handler maps a request to the replies to send: (delay_s, reply) pairs; [] sends nothing.
Handler = Callable[[p.Request], list[tuple[float, p.Reply]]]



def inventory_handler(name: str) -> Handler:
    def handle(req):
        if isinstance(req, p.Inventory):
            return [(0.0, p.InventoryReply(id=req.id, node=name, boot=1, devices=[]))]
        if isinstance(req, p.Lend):
            return [(0.0, p.LifecycleReply(id=req.id, device=req.device, state="LENT", borrower=req.borrower,
                                           changed=True))]
        return [(0.0, p.Error(id=req.id, code=p.ErrorCode.BAD_REQUEST, message="not scripted"))]
    return handle


class FakeNode:
    """One scripted node: a CURVE ROUTER that answers with ``handler`` and an XPUB for events."""

    def __init__(self, ctx: zmq.Context, name: str, handler: Handler, *, port: int | None = None,
                 pub: bool = False, keypair: tuple[bytes, bytes] | None = None) -> None:
        self.name = name
        self.handler = handler
        self.public, secret = keypair or zmq.curve_keypair()
        self.received: list[p.Request] = []
        self.replies_sent = 0
        self.subscribed = threading.Event()
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.router = self._curve_server(ctx, zmq.ROUTER, secret)
        port = port or free_port()
        self.router.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.xpub = None
        self.events_endpoint = None
        if pub:
            self.xpub = self._curve_server(ctx, zmq.XPUB, secret)
            events_port = self.xpub.bind_to_random_port("tcp://127.0.0.1")
            self.events_endpoint = f"tcp://127.0.0.1:{events_port}"
        self._thread = threading.Thread(target=self._run, name=f"fake-node-{name}", daemon=True)
        self._thread.start()

    def _curve_server(self, ctx: zmq.Context, kind: int, secret: bytes) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.curve_secretkey = secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.linger = 0
        return sock

    def publish(self, event: p.Event) -> None:
        """Send ``event`` on the XPUB (from the node's own thread: sockets are not thread-safe)."""
        self._outbox.put(event)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        if self.xpub is not None:
            poller.register(self.xpub, zmq.POLLIN)
        scheduled: list[tuple[float, int, bytes, bytes]] = []  # (due, tie-breaker, route, frame)
        counter = 0
        while not self._stop.is_set():
            now = time.monotonic()
            while scheduled and scheduled[0][0] <= now:
                _, _, route, frame = heapq.heappop(scheduled)
                self.router.send_multipart([route, frame])
                self.replies_sent += 1
            while not self._outbox.empty():
                event = self._outbox.get()
                self.xpub.send_multipart([event.kind.encode(), codec.encode(event)])
            wait_ms = 10 if not scheduled else max(0, min(10, (scheduled[0][0] - now) * 1000))
            for sock, _ in poller.poll(wait_ms):
                if sock is self.xpub:
                    if self.xpub.recv()[:1] == b"\x01":
                        self.subscribed.set()
                    continue
                route, frame = self.router.recv_multipart()
                request = codec.decode_request(frame)
                self.received.append(request)
                for delay_s, reply in self.handler(request):
                    counter += 1
                    heapq.heappush(scheduled, (time.monotonic() + delay_s, counter, route, codec.encode(reply)))
        self.router.close(0)
        if self.xpub is not None:
            self.xpub.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def cluster(tmp_path):
    """Allowed client keys and a factory of fake nodes sharing one authenticated context."""
    paths = node_keys.generate(str(tmp_path / "keys"), clients=["placement"])
    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=os.path.join(paths.keys_dir, "allowed"))
    nodes: list[FakeNode] = []
    clients: list[PlacementClient] = []

    class Cluster:
        client_keys = ClientKeys.load(paths.clients["placement"])

        def node(self, name: str, handler: Handler | None = None, **kw) -> FakeNode:
            node = FakeNode(ctx, name, handler or inventory_handler(name), **kw)
            nodes.append(node)
            return node

        def client(self, nodes: list[FakeNode], *, extra: dict[str, str] | None = None, events: bool = False,
                   keys: ClientKeys | None = None, extra_keys: dict[str, bytes] | None = None,
                   **kw) -> PlacementClient:
            """A client of ``nodes`` plus ``extra`` endpoints with no node (``extra_keys``: their server keys)."""
            endpoints = {n.name: n.endpoint for n in nodes} | (extra or {})
            server_keys = ({n.name: n.public for n in nodes} | {name: zmq.curve_keypair()[0] for name in extra or {}}
                           | (extra_keys or {}))
            client = PlacementClient(endpoints, keys=keys or self.client_keys, server_keys=server_keys,
                                     events={n.name: n.events_endpoint for n in nodes} if events else None, **kw)
            clients.append(client)
            return client

    yield Cluster()
    for client in clients:
        client.close()
    for node in nodes:
        node.stop()
    auth.stop()
    ctx.destroy(linger=0)


# ---------------------------------------------------------------- gathering


def test_gathers_one_reply_per_node_from_three_nodes(cluster):
    nodes = [cluster.node(f"n{i}") for i in range(3)]
    client = cluster.client(nodes, timeout_ms=5000)
    results = client.inventory()
    assert list(results) == ["n0", "n1", "n2"]
    for name, result in results.items():
        assert result.ok and result.error is None
        assert isinstance(result.reply, p.InventoryReply) and result.reply.node == name
    ids = [n.received[0].id for n in nodes]
    assert len(set(ids)) == 3 and [r.reply.id for r in results.values()] == ids
    # A subset, and again: the ids keep growing.
    again = client.inventory(["n1"])
    assert list(again) == ["n1"] and again["n1"].reply.id > max(ids)


def test_a_node_that_is_down_times_out_without_holding_up_the_others(cluster):
    nodes = [cluster.node("a"), cluster.node("b")]
    client = cluster.client(nodes, extra={"down": f"tcp://127.0.0.1:{free_port()}"}, timeout_ms=400)
    start = time.monotonic()
    results = client.inventory()
    elapsed_s = time.monotonic() - start
    assert results["a"].ok and results["b"].ok
    err = results["down"].error
    assert isinstance(err, NodeTimeoutError) and isinstance(err, TimeoutError)
    assert err.code == "E_TIMEOUT" and err.node == "down" and "400 ms" in str(err)
    assert results["down"].reply is None
    assert 0.4 <= elapsed_s < 1.5


def test_a_slow_node_costs_only_the_timeout(cluster):
    fast = cluster.node("fast")
    slow = cluster.node("slow", lambda req: [(3.0, p.InventoryReply(id=req.id, node="slow", boot=1, devices=[]))])
    client = cluster.client([fast, slow], timeout_ms=300)
    start = time.monotonic()
    results = client.inventory()
    assert time.monotonic() - start < 1.5
    assert results["fast"].ok and isinstance(results["slow"].error, NodeTimeoutError)


def test_late_reply_is_discarded_and_the_next_call_gets_its_own(cluster):
    def handler(req):
        delay_s = 0.6 if req.borrower == "first" else 0.0
        return [(delay_s, p.LifecycleReply(id=req.id, device=0, state="LENT", borrower=req.borrower, changed=True))]
    node = cluster.node("n", handler)
    client = cluster.client([node], timeout_ms=200)
    with pytest.raises(NodeTimeoutError):
        client.lend("n", 0, "first")
    wait_for(lambda: node.replies_sent == 1, timeout=5)  # the late reply to "first" has left the node
    reply = client.lend("n", 0, "second")
    assert reply.borrower == "second" and reply.id == node.received[-1].id
    assert [r.borrower for r in node.received] == ["first", "second"]


def test_a_reply_with_an_unknown_id_is_ignored(cluster):
    def handler(req):
        stray = p.InventoryReply(id=req.id + 1000, node="stray", boot=1, devices=[])
        return [(0.0, stray), (0.05, p.InventoryReply(id=req.id, node="n", boot=1, devices=[]))]
    node = cluster.node("n", handler)
    result = cluster.client([node]).inventory()["n"]
    assert result.ok and result.reply.node == "n"


def test_a_request_to_a_node_that_was_down_is_not_delivered_when_it_comes_up(cluster):
    port = free_port()
    keypair = zmq.curve_keypair()
    client = cluster.client([], extra={"late": f"tcp://127.0.0.1:{port}"}, extra_keys={"late": keypair[0]},
                            timeout_ms=300)
    with pytest.raises(NodeTimeoutError):
        client.lend("late", 0, "stale-job")
    # The node starts on that port only now; libzmq reconnects on its own.
    node = cluster.node("late", port=port, keypair=keypair)
    result = client.call(p.Inventory, timeout_ms=5000)["late"]
    assert result.ok
    assert [type(r) for r in node.received] == [p.Inventory]  # the stale lend was dropped


# ---------------------------------------------------------------- errors


def test_a_factory_that_raises_sends_nothing(cluster):
    nodes = [cluster.node("a"), cluster.node("b")]
    client = cluster.client(nodes)
    made = []

    def factory(id):
        made.append(id)
        if len(made) == 2:
            raise ValueError("bad request for the second node")
        return p.Inventory(id=id)
    with pytest.raises(ValueError, match="second node"):
        client.call(factory)
    assert client.inventory()["a"].ok  # the client still works, and the first node was never asked
    assert [type(r) for r in nodes[0].received] == [p.Inventory] and len(nodes[1].received) == 1


def test_error_reply_raises_placement_error_with_the_code(cluster):
    def handler(req):
        return [(0.0, p.Error(id=req.id, code=p.ErrorCode.STATE, message="device 0 is RUN"))]
    node = cluster.node("n", handler)
    client = cluster.client([node])
    with pytest.raises(PlacementError) as err:
        client.lend("n", 0, "job-a")
    assert err.value.code == "E_STATE" and err.value.node == "n" and "device 0 is RUN" in str(err.value)
    result = client.call(lambda id: p.Lend(id=id, device=0, borrower="job-a"))["n"]
    assert isinstance(result.reply, p.Error) and result.error.code == "E_STATE" and not result.ok


def test_unexpected_reply_type_is_a_bad_reply(cluster):
    node = cluster.node("n", lambda req: [(0.0, p.Ok(id=req.id))])
    with pytest.raises(PlacementError, match="expected LifecycleReply, got Ok") as err:
        cluster.client([node]).lend("n", 0, "job-a")
    assert err.value.code == "E_BAD_REPLY"


class _UnknownReply(msgspec.Struct, tag_field="op", tag="no_such_reply", kw_only=True):
    """A reply a node may send that this client cannot decode (a newer daemon's, or a lying one)."""

    id: int


def test_an_undecodable_reply_answers_its_request_as_a_bad_reply(cluster):
    """Undecodable frames are matched by the id read from them: one for no pending request is
    skipped, the one for ours ends the call with E_BAD_REPLY (not a timeout)."""
    node = cluster.node("n", lambda req: [(0.0, _UnknownReply(id=req.id + 1000)), (0.0, _UnknownReply(id=req.id))])
    result = cluster.client([node]).call(p.Inventory)["n"]
    assert result.reply is None and result.error.code == "E_BAD_REPLY"
    assert "invalid message from daemon" in str(result.error)


def test_reclaim_waits_for_its_deadline_beyond_the_client_timeout(cluster):
    def handler(req):
        return [(0.4, p.ReclaimReply(id=req.id, device=req.device, state="PROTECT", free_ms=400.0,
                                     outcomes={"s1": "suspended"}, changed=True))]
    node = cluster.node("n", handler)
    client = cluster.client([node], timeout_ms=200)
    reply = client.reclaim("n", 1, deadline_ms=1000)
    assert reply.outcomes == {"s1": "suspended"} and node.received[0].deadline_ms == 1000
    with pytest.raises(NodeTimeoutError):
        client.reclaim("n", 1, deadline_ms=1000, timeout_ms=100)


def test_each_operation_sends_its_request(cluster):
    def handler(req):
        replies = {
            p.Drain: lambda: p.LifecycleReply(id=req.id, device=req.device, state="DRAINING", borrower=None,
                                             changed=True),
            p.SetPolicy: lambda: p.PolicyReply(id=req.id, device=req.device, policy=p.PolicyInfo(
                quanta_ms=req.quanta_ms or {}, grace_ms=req.grace_ms or 100.0, protect_s=req.protect_s or 60.0)),
            p.Partition: lambda: p.PartitionReply(id=req.id, device=req.device, shares={"s": 50},
                                                  memory_limits_mb={}, stale=[]),
            p.SuspendSession: lambda: p.SuspendResult(id=req.id, session=req.session, outcome="suspended",
                                                      elapsed_ms=5.0),
            p.ResumeSession: lambda: p.Ok(id=req.id),
        }
        return [(0.0, replies[type(req)]())]
    node = cluster.node("n", handler)
    client = cluster.client([node])
    assert client.drain("n", 2).state == "DRAINING"
    client.drain("n", 2, cancel=True)
    assert client.set_policy("n", 0, protect_s=30.0, grace_ms=50.0).policy.protect_s == 30.0
    assert client.partition("n", 0, {"s": 50}).shares == {"s": 50}
    assert client.suspend("n", "s1", deadline_ms=100).outcome == "suspended"
    assert isinstance(client.resume("n", "s1"), p.Ok)
    sent = node.received
    assert [type(r) for r in sent] == [p.Drain, p.Drain, p.SetPolicy, p.Partition, p.SuspendSession,
                                       p.ResumeSession]
    assert sent[1].cancel and sent[2].protect_s == 30.0 and sent[2].quanta_ms is None
    assert sent[4].deadline_ms == 100


def lending_handler(outcomes: dict[str, str], refuse_lend: bool = False, no_session: str = "") -> Handler:
    """A node that lends (or refuses), suspends each session with its scripted outcome, reclaims, resumes."""
    def handle(req):
        if isinstance(req, p.Lend):
            if refuse_lend:
                return [(0.0, p.Error(id=req.id, code=p.ErrorCode.STATE, message="device 0 is PROTECT"))]
            return [(0.0, p.LifecycleReply(id=req.id, device=req.device, state="LENT", borrower=req.borrower,
                                           changed=True))]
        if isinstance(req, (p.SuspendSession, p.ResumeSession)) and req.session == no_session:
            return [(0.0, p.Error(id=req.id, code=p.ErrorCode.NO_SESSION, message=f"no session {no_session}"))]
        if isinstance(req, p.SuspendSession):
            return [(0.0, p.SuspendResult(id=req.id, session=req.session, outcome=outcomes[req.session],
                                          elapsed_ms=3.0))]
        if isinstance(req, p.Reclaim):
            return [(0.0, p.ReclaimReply(id=req.id, device=req.device, state="PROTECT", free_ms=9.0,
                                         outcomes={"trainer": "suspended"}, changed=True))]
        if isinstance(req, p.ResumeSession):
            return [(0.0, p.Ok(id=req.id))]
        return [(0.0, p.Error(id=req.id, code=p.ErrorCode.BAD_REQUEST, message="not scripted"))]
    return handle


def test_a_lend_puts_the_named_sessions_to_sleep_and_a_reclaim_wakes_them_in_the_same_call(cluster):
    node = cluster.node("n", lending_handler({"llm": "suspended"}))
    client = cluster.client([node])
    lent = client.lend("n", 0, "job-7", suspend=["llm"], deadline_ms=800)
    assert lent.state == "LENT" and lent.borrower == "job-7"
    reclaimed = client.reclaim("n", 0, deadline_ms=500, resume=["llm"])
    assert reclaimed.free_ms == 9.0 and reclaimed.outcomes == {"trainer": "suspended"}
    sent = node.received
    # The lend first (a refused one must suspend nothing), the wake only once the device is back.
    assert [type(r) for r in sent] == [p.Lend, p.SuspendSession, p.Reclaim, p.ResumeSession]
    assert sent[1].session == "llm" and sent[1].deadline_ms == 800 and sent[3].session == "llm"
    # Without sessions to name, both are the plain operations.
    client.lend("n", 0, "job-7")
    client.reclaim("n", 0)
    assert [type(r) for r in node.received[4:]] == [p.Lend, p.Reclaim]


def test_a_refused_lend_suspends_nothing(cluster):
    node = cluster.node("n", lending_handler({"llm": "suspended"}, refuse_lend=True))
    with pytest.raises(PlacementError) as err:
        cluster.client([node]).lend("n", 0, "job-7", suspend=["llm"])
    assert err.value.code == p.ErrorCode.STATE
    assert [type(r) for r in node.received] == [p.Lend]


def test_a_session_that_does_not_end_suspended_is_named_after_every_one_was_asked(cluster):
    node = cluster.node("n", lending_handler({"llm": "stopped", "ok": "suspended"}, no_session="gone"))
    with pytest.raises(PlacementError) as err:
        cluster.client([node]).lend("n", 0, "job-7", suspend=["llm", "gone", "ok"])
    assert err.value.code == "E_NOT_SUSPENDED" and err.value.node == "n"
    assert "device 0 is lent to job-7" in str(err.value)
    assert "llm (stopped)" in str(err.value) and "gone (E_NO_SESSION: no session gone)" in str(err.value)
    assert [getattr(r, "session", None) for r in node.received] == [None, "llm", "gone", "ok"]


def test_a_reclaim_resumes_every_named_session_and_raises_the_first_failure(cluster):
    node = cluster.node("n", lending_handler({}, no_session="gone"))
    with pytest.raises(PlacementError) as err:
        cluster.client([node]).reclaim("n", 0, resume=["gone", "llm"])
    assert err.value.code == p.ErrorCode.NO_SESSION
    assert [(type(r), getattr(r, "session", None)) for r in node.received] == [
        (p.Reclaim, None), (p.ResumeSession, "gone"), (p.ResumeSession, "llm")]


# ---------------------------------------------------------------- authentication


def test_a_client_whose_key_is_not_allowed_gets_no_reply(cluster, tmp_path):
    node = cluster.node("n")
    stranger = node_keys.generate(str(tmp_path / "stranger"), clients=["stranger"])
    client = cluster.client([node], keys=ClientKeys.load(stranger.clients["stranger"]), timeout_ms=800)
    assert isinstance(client.inventory()["n"].error, NodeTimeoutError)
    assert node.received == []


def test_key_loading_helpers(tmp_path):
    paths = node_keys.generate(str(tmp_path / "k"), clients=["placement"])
    keys = ClientKeys.load(paths.clients["placement"])
    assert zmq.curve_public(keys.secret) == keys.public
    assert load_server_public(paths.server_public) == node_keys.server_public(paths.keys_dir)
    with pytest.raises(ValueError, match="only a public key"):
        ClientKeys.load(paths.allowed["placement"])
    with pytest.raises(ValueError, match="cannot load"):
        ClientKeys.load(str(tmp_path / "missing"))


def test_constructor_errors_name_what_to_fix():
    keys = ClientKeys(*zmq.curve_keypair())
    with pytest.raises(ValueError, match="no server public key for node 'a'"):
        PlacementClient({"a": "tcp://127.0.0.1:1"}, keys=keys)
    with pytest.raises(ValueError, match="not an endpoint"):
        PlacementClient(["127.0.0.1:1"], keys=None)
    with pytest.raises(ValueError, match="empty"):
        PlacementClient([], keys=None)
    with pytest.raises(ValueError, match="one per node"):
        PlacementClient(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], keys=None, events=["tcp://127.0.0.1:3"])
    with pytest.raises(ValueError, match="not in nodes: b"):
        PlacementClient({"a": "tcp://127.0.0.1:1"}, keys=None, events={"b": "tcp://127.0.0.1:3"})
    with PlacementClient({"a": "tcp://127.0.0.1:1"}, keys=keys, server_keys=keys.public) as client:
        with pytest.raises(ValueError, match="unknown node"):
            client.lend("zzz", 0, "job")
        with pytest.raises(ValueError, match="subscribes to no events"):
            next(client.events(timeout_ms=10))


# ---------------------------------------------------------------- events


def event(node: str, seq: int, kind: str = "lend", device: int = 0) -> p.Event:
    return p.Event(node=node, seq=seq, boot=7, time=1.0e9 + seq, kind=kind, device=device, data={"borrower": "j"})


def test_events_from_several_nodes_arrive_as_one_stream(cluster):
    nodes = [cluster.node(f"n{i}", pub=True) for i in range(3)]
    client = cluster.client(nodes, events=True)
    for node in nodes:
        assert node.subscribed.wait(5), f"{node.name}: the client's SUB never subscribed"
    for seq in (1, 2, 3):
        for node in nodes:
            node.publish(event(node.name, seq, kind="device_state" if seq == 2 else "lend"))
    got: dict[str, list[p.Event]] = {n.name: [] for n in nodes}
    for name, ev in client.events(timeout_ms=2000):
        got[name].append(ev)
        if sum(map(len, got.values())) == 9:
            break
    for node in nodes:
        assert [e.seq for e in got[node.name]] == [1, 2, 3]
        assert all(e.node == node.name and e.boot == 7 for e in got[node.name])
        assert got[node.name][1].kind == "device_state" and got[node.name][0].data == {"borrower": "j"}
    assert client.event_gaps == {"n0": 0, "n1": 0, "n2": 0}
    # Nothing more: the iterator ends after the idle timeout.
    start = time.monotonic()
    assert list(client.events(timeout_ms=200)) == []
    assert time.monotonic() - start >= 0.19


def test_event_gaps_are_counted(cluster):
    node = cluster.node("n", pub=True)
    client = cluster.client([node], events=True)
    assert node.subscribed.wait(5)
    for seq in (1, 2, 5):
        node.publish(event("n", seq))
    seen = [ev.seq for _, ev in zip(range(3), (ev for _, ev in client.events(timeout_ms=2000)))]
    assert seen == [1, 2, 5]
    assert client.event_gaps == {"n": 2}


# ---------------------------------------------------------------- a real daemon, local socket


def test_local_socket_serves_placement_ops_to_root_only(inproc_daemon):
    """A node-local agent (a device plugin, say) may use PlacementClient over the ipc socket without keys;
    the daemon treats the peer as an operator only if it is root."""
    with PlacementClient({"local": inproc_daemon.endpoint}, keys=None, timeout_ms=5000) as client:
        result = client.inventory()["local"]
        if os.geteuid() != 0:
            assert result.error is not None and result.error.code == p.ErrorCode.FORBIDDEN
            return
        assert result.ok and result.reply.devices[0].state == "FREE"
        first = client.lend("local", 0, "job-x")
        assert first.state == "LENT" and first.changed
        assert client.lend("local", 0, "job-x").changed is False
        with pytest.raises(PlacementError) as err:
            client.lend("local", 0, "job-y")
        assert err.value.code == p.ErrorCode.STATE and "job-x" in str(err.value)
        reclaimed = client.reclaim("local", 0, deadline_ms=500)
        assert reclaimed.changed and reclaimed.outcomes == {}
        assert client.inventory()["local"].reply.devices[0].borrower is None
