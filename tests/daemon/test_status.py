"""A status at a thousand sessions is built a chunk per loop turn: a token handoff that
arrives meanwhile is served between chunks, not after the whole status (issue 12).

The server runs in this process with its local endpoint replaced by a recorder, so
the order in which the daemon sends things is exact, not a matter of timing."""

from __future__ import annotations

import os
import time

import pytest
from prometheus_client import CollectorRegistry

from client_lib import codec
from client_lib import protocol as p
from nodeagent.config import ServeConfig
from nodeagent.daemon import server as server_module
from nodeagent.daemon.server import AgentServer
from nodeagent.daemon.sessions import Session
from nodeagent.devices import CpuBackend
from nodeagent.metrics import Metrics
from nodeagent.procwatch import PeerCredentials, own_namespaces
from sharing import Workload
from tests.daemon_parts import RecordingLocal
from tests.conftest import REPO
from tests.nonroot import nobody_daemon  # noqa: F401 - a fixture


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
                uid=0, workload=Workload.TRAINING, weight=1.0, device=0, memory_mb=0, last_seen=now)
    server._add_session(s, now)
    return s


def test_a_handoff_is_served_between_the_chunks_of_a_big_status(workdir):
    server, local = _server(workdir, idle_sessions=1000)
    now = time.monotonic()
    a, b = _add(server, "a", "route-a", now), _add(server, "b", "route-b", now)
    server._gate.ask(a, now)
    server._gate.ask(b, now)
    [grant_a] = local.of("route-a")
    assert isinstance(grant_a, p.Grant) and server._tokens.grant_of(b) is None

    server._queue_read("route-status", p.StatusRequest(id=7), None, now)
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
    server._queue_read("route-status", p.StatusRequest(id=3), None, time.monotonic())
    [reply] = local.of("route-status")
    assert isinstance(reply, p.StatusReply) and reply.id == 3 and not server._status_jobs


def test_statuses_under_way_are_bounded_and_a_bug_costs_only_its_own(workdir, monkeypatch):
    server, local = _server(workdir, idle_sessions=2 * server_module.STATUS_CHUNK)
    now = time.monotonic()
    for i in range(server_module.STATUS_JOBS_MAX):
        server._queue_read(f"peer-{i}", p.StatusRequest(id=i + 1), None, now)
    server._queue_read("one-too-many", p.StatusRequest(id=99), None, now)
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


class _Frame:
    """What a local connection hands a handler: the kernel's word on who sent it."""

    def __init__(self, uid: int) -> None:  # a process in this one's namespaces: uid 0 is ROOT
        self.creds = PeerCredentials(uid=uid, gid=uid, pid=1000 + uid, namespaces=own_namespaces())


def test_a_queued_status_is_answered_after_the_schedulers_saw_a_later_time(workdir):
    """Issue 32 item 5: a status queued behind a big one took the time it arrived, and the
    scheduler, told a later time meanwhile, refused it: E_INTERNAL and a traceback."""
    server, local = _server(workdir, idle_sessions=1000)
    now = time.monotonic()
    user = _Frame(uid=1000)  # one peer's requests: the second and third wait for the first
    server._queue_read("route-big", p.StatusRequest(id=1), user, now)
    server._queue_read("route-queued", p.StatusRequest(id=2), user, now)
    server._queue_read("route-inventory", p.Inventory(id=3), user, now)
    later = _add(server, "later", "route-later", time.monotonic())
    server._gate.ask(later, time.monotonic())  # the scheduler sees a time after the requests'
    while server._status_jobs:
        server._status_step()
    [queued], [inventory] = local.of("route-queued"), local.of("route-inventory")
    assert isinstance(queued, p.StatusReply) and queued.id == 2, queued
    assert queued.devices[0].holder == "later"  # as of when it started, after the grant
    assert isinstance(inventory, p.InventoryReply) and inventory.id == 3, inventory
    assert len(inventory.devices[0].sessions) == 1001
    assert server.metrics.internal_errors.labels("status")._value.get() == 0


def test_one_peer_cannot_take_every_status_slot(workdir):
    """Issue 32 item 5: the status queue is bounded per uid, however many connections it
    opens, so another user's flood leaves root room; the refused are told to wait."""
    server, local = _server(workdir, idle_sessions=2 * server_module.STATUS_CHUNK)
    now = time.monotonic()
    flooder = _Frame(uid=65534)
    for i in range(server_module.STATUS_JOBS_MAX):
        server._queue_read(f"flood-{i}", p.StatusRequest(id=i + 1), flooder, now)
    taken = [r for r in range(server_module.STATUS_JOBS_MAX) if not local.of(f"flood-{r}")]
    assert len(taken) == server_module.STATUS_JOBS_PER_PEER
    refused = local.of(f"flood-{server_module.STATUS_JOBS_MAX - 1}")[0]
    assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.UNAVAILABLE
    server._queue_read("flood-inventory", p.Inventory(id=500), flooder, now)  # the same share
    assert local.of("flood-inventory")[0].code == p.ErrorCode.UNAVAILABLE
    server._queue_read("root", p.StatusRequest(id=99), _Frame(uid=0), now)
    assert local.of("root") == []  # queued, not refused
    while server._status_jobs:
        server._status_step()
    [reply] = local.of("root")
    assert isinstance(reply, p.StatusReply) and reply.id == 99
    server._queue_read("flood-again", p.StatusRequest(id=600), flooder, now)  # its share is back once answered
    while server._status_jobs:
        server._status_step()
    assert isinstance(local.of("flood-again")[0], p.StatusReply)


def test_roots_status_is_built_before_the_chunks_of_another_users_flood(workdir):
    """Issue 32 item 5: root's status (an operator's, the device plugin's) is answered within
    two turns whatever another user has queued."""
    server, local = _server(workdir, idle_sessions=server_module.STATUS_CHUNK + 72)  # two chunks
    now = time.monotonic()
    for i in range(server_module.STATUS_JOBS_PER_PEER):
        server._queue_read(f"flood-{i}", p.StatusRequest(id=i + 1), _Frame(uid=65534), now)
    server._queue_read("root", p.StatusRequest(id=99), _Frame(uid=0), now)  # its first chunk at once
    server._status_step()  # and its second in the next turn, before the flood's
    assert [route for route, _ in local.sent] == ["root"]
    while server._status_jobs:
        server._status_step()
    assert all(isinstance(local.of(f"flood-{i}")[0], p.StatusReply)
               for i in range(server_module.STATUS_JOBS_PER_PEER))


class _ContainersRoot:
    """A real uid-0 process in new pid and mount namespaces (unshare(1)), as a container's root
    is: ``creds`` as the local endpoint reads them off its connection (the kernel's word)."""

    def __init__(self, workdir: str) -> None:
        import os
        import shutil
        import socket
        import subprocess
        import sys

        from nodeagent.daemon import loop as local_module

        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip("needs root and unshare(1) to make a process in new pid and mount namespaces")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(f"{workdir}/container.sock")
        listener.listen(1)
        listener.settimeout(30.0)
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--mount", "--fork", "--", sys.executable, "-c",
             "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); sys.stdin.read()",
             f"{workdir}/container.sock"], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            self.conn, _ = listener.accept()
        except socket.timeout:
            self.close()
            err = self.proc.stderr.read().decode(errors="replace")
            if "Operation not permitted" in err:
                pytest.skip(f"this sandbox refuses new namespaces: {err.strip()}")
            raise AssertionError(f"the namespaced process never connected: {err}")
        finally:
            listener.close()
        self.creds = local_module._peer_credentials(self.conn)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        conn = getattr(self, "conn", None)
        if conn is not None:
            conn.close()


def test_a_containers_root_takes_no_place_of_roots_in_the_status_queue(workdir):
    """Issue 32 (left over from item 2): the status queue put uid 0 first and gave it one share,
    so a container's root (uid 0, not ROOT) went before another user who asked first, and with
    its own share of four statuses left host root's refused. Keyed on the ROOT role, host root
    is queued on a share of its own and answered first, and the container's root waits its turn."""
    from nodeagent.daemon import authz

    server, local = _server(workdir, idle_sessions=server_module.STATUS_CHUNK + 72)  # two chunks each
    container = _ContainersRoot(workdir)
    try:
        assert container.creds.uid == 0 and not authz.is_root(container.creds), container.creds
        now = time.monotonic()
        server._queue_read("user", p.StatusRequest(id=1), _Frame(uid=65534), now)  # first in line
        for i in range(server_module.STATUS_JOBS_PER_PEER):  # its whole share
            server._queue_read(f"container-{i}", p.StatusRequest(id=10 + i), container, now)
        server._queue_read("root", p.StatusRequest(id=99), _Frame(uid=0), now)
        assert local.of("root") == []  # queued on its own share, not refused
        server._status_step()
        server._status_step()
        assert [route for route, _ in local.sent] == ["root", "user"]  # then the container's, in turn
        while server._status_jobs:
            server._status_step()
        assert all(isinstance(local.of(f"container-{i}")[0], p.StatusReply)
                   for i in range(server_module.STATUS_JOBS_PER_PEER))
    finally:
        container.close()


def test_an_inventory_is_built_a_chunk_per_turn_and_a_handoff_goes_between(workdir):
    """Issue 32 item 6: inventory built the whole status at once, outside status's chunking."""
    server, local = _server(workdir, idle_sessions=1000)
    now = time.monotonic()
    a, b = _add(server, "a", "route-a", now), _add(server, "b", "route-b", now)
    server._gate.ask(a, now)
    server._gate.ask(b, now)
    [grant_a] = local.of("route-a")
    server._queue_read("route-inventory", p.Inventory(id=7), None, now)
    assert local.of("route-inventory") == []  # one chunk built, the rest waits for later turns
    server._on_release("route-a", p.Release(id=8, grant=grant_a.grant, quiet=True), None, now)
    while server._status_jobs:
        server._status_step()
    order = [(route, type(msg)) for route, msg in local.sent[1:]]
    assert order == [("route-b", p.Grant), ("route-inventory", p.InventoryReply)]
    [reply] = local.of("route-inventory")
    assert reply.devices[0].state == "FREE" and len(reply.devices[0].sessions) == 1002


_FLOOD = r'''
import json, sys, time
from client_lib import codec, framing
from client_lib import protocol as p

# At least `least` statuses, and on until `seconds` have passed: root's p99 needs about a
# thousand of its own samples under the flood, whatever this machine's speed.
least, connections, window, seconds = int(sys.argv[2]), 4, int(sys.argv[3]), float(sys.argv[4])
conns = [framing.Connection(sys.argv[1], 10.0) for _ in range(connections)]
sent = [0] * connections
got = [0] * connections
codes = {}
share = least // connections
until = time.monotonic() + seconds
deadline = time.monotonic() + 60.0 + seconds
while time.monotonic() < deadline:
    more = time.monotonic() < until
    if not more and sum(got) == sum(sent) and min(sent) >= share:
        break
    for i, c in enumerate(conns):
        while (sent[i] < share or more) and sent[i] - got[i] < window:
            sent[i] += 1
            c.send(codec.encode(p.StatusRequest(id=sent[i])))
        for frame in c.recv(0.001):
            got[i] += 1
            reply = codec.decode_reply(frame)
            kind = str(reply.code) if isinstance(reply, p.Error) else type(reply).__name__
            codes[kind] = codes.get(kind, 0) + 1
print(json.dumps({"sent": sum(sent), "answered": sum(got), "codes": codes}))
'''

_CHURN = r'''
import sys, time
from client_lib import protocol as p
from tests.rawpeer import RawPeer

peer = RawPeer(sys.argv[1])
peer.hello("churn")
print("ready", flush=True)
while True:
    peer.call(p.Acquire(id=peer.take_id()))
    grant = peer.next_notice(p.Grant)
    time.sleep(0.002)  # a short slice of work
    reply = peer.call(p.Release(id=peer.take_id(), grant=grant.grant))
    if not isinstance(reply, p.Ok):
        sys.exit(f"release answered {reply}")
'''


@pytest.mark.parametrize("window", [128, 2_500], ids=["128 in flight a connection", "all pipelined at once"])
def test_status_under_another_users_flood_answers_root_and_never_fails(nobody_daemon, window):
    """Issue 32 item 5, done-when: 10,000 statuses (and more, for 3 s) from another user, with 200 sessions and
    one of them churning the token (which moves the schedulers' time on): no E_INTERNAL
    anywhere, and root's status answered within 100 ms at p99 (or 2.5x the same requests' p99
    before the flood, where this machine's load alone costs more than 40 ms). Pipelined 2,500 deep on each of
    four connections, they are handled a budget a connection a turn (local._FRAME_BUDGET), so
    root's waits behind one turn's worth, not behind a whole read of them."""
    import json
    import statistics
    import subprocess
    import sys

    from tests.nonroot import popen_as_nobody
    from tests.proc_tools import busiest, cpu_ticks
    from tests.rawpeer import RawPeer

    d = nobody_daemon()
    idle = []
    for i in range(200):
        peer = RawPeer(d.endpoint)
        peer.hello(f"idle-{i}")
        idle.append(peer)
    churner = subprocess.Popen([sys.executable, "-c", _CHURN, d.endpoint], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # its own process: not this one's GIL
    assert churner.stdout.readline().strip() == "ready", churner.stderr.read()
    root = RawPeer(d.endpoint)
    control_ms = []  # the same requests before the flood: what this machine's load alone costs
    for _ in range(200):
        began = time.perf_counter()
        root.call(p.StatusRequest(id=root.take_id()), timeout=10.0)
        control_ms.append((time.perf_counter() - began) * 1000.0)
    control_p99 = statistics.quantiles(control_ms, n=100)[98]
    ticks_before = cpu_ticks()
    flood = popen_as_nobody(_FLOOD, d.endpoint, "10000", str(window), "3")
    latencies_ms, root_replies = [], []
    try:
        while flood.poll() is None and len(latencies_ms) < 5000:  # one at a time, back to back
            began = time.perf_counter()
            reply = root.call(p.StatusRequest(id=root.take_id()), timeout=10.0)
            latencies_ms.append((time.perf_counter() - began) * 1000.0)
            root_replies.append(reply)
        out, err = flood.communicate(timeout=90)
        cpu = busiest(ticks_before, cpu_ticks())
    finally:
        flood.kill()
        alive = churner.poll() is None
        churner.kill()
    assert alive, churner.communicate()[1]
    assert flood.returncode == 0, err
    result = json.loads(out)
    assert result["sent"] >= 10_000 and result["answered"] == result["sent"], result
    assert str(p.ErrorCode.INTERNAL) not in result["codes"], result
    assert result["codes"].get("StatusReply", 0) > 0, result  # it was served, not only refused
    assert all(isinstance(r, p.StatusReply) for r in root_replies), [r for r in root_replies
                                                                     if not isinstance(r, p.StatusReply)][:3]
    assert len(latencies_ms) >= 50, len(latencies_ms)
    p99 = statistics.quantiles(latencies_ms, n=100)[98]
    said = (f"root's status under the flood: n={len(latencies_ms)} p50={statistics.median(latencies_ms):.1f} ms "
            f"p99={p99:.1f} ms (before it: p50={statistics.median(control_ms):.1f} ms p99={control_p99:.1f} ms); "
            f"flood: {result}; the CPU it took, by process: {cpu}; load {os.getloadavg()}")
    print(said)
    # The 100 ms, on a machine whose own load costs root's status less than 40 ms at p99;
    # where the load alone costs more (other jobs on a shared 2-core VM), the flood may add at
    # most 2.5x of it: the same run's baseline, as the project's speed checks read.
    assert p99 < max(100.0, 2.5 * control_p99), said
    assert "building a status failed" not in d.log()
    for peer in idle + [root]:
        peer.close()
