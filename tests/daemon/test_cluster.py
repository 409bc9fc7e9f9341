"""The cluster endpoint of a real daemon over real tcp loopback sockets with CURVE:
who may talk to it, every placement operation and its errors, events, restart."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import zmq

from client_lib import Client, DaemonError
from client_lib import protocol as p
from nodeagent import keys
from tests.conftest import wait_for, free_port
from tests.rawpeer import RawPeer
from tests.proc_tools import assert_stopped, proc_state
from tests.nonroot import nobody_daemon  # noqa: F401  (a fixture)
from tests.cluster_nodes import ClusterNode, write_cluster_config, CurvePeer, inventory_or_none


@pytest.fixture
def inproc_cluster_node(start_inproc_daemon, workdir):
    """As :func:`cluster_node`, the daemon in this process (tests.inproc): for the tests of what the
    cluster endpoint answers, where no signal, kill or restart reaches the daemon's process."""

    def start(*args: str, endpoint: str | None = None, **config) -> ClusterNode:
        node = write_cluster_config(workdir, **config)
        node.daemon = start_inproc_daemon(*args, endpoint=endpoint)
        return node

    return start


def holder(device: p.DeviceInventory) -> str | None:
    """The session holding the device's token (or asked to yield it), if any."""
    return next((s.id for s in device.sessions if s.state in ("holding", "yielding")), None)


def session_info(peer: CurvePeer, name: str) -> p.SessionInfo:
    inventory = peer.call(p.Inventory(id=0))
    return next(s for d in inventory.devices for s in d.sessions if s.name == name)


# ------------------------------------------------------------------ who may talk


def test_only_a_peer_with_an_allowed_key_gets_any_reply(cluster_node):
    node = cluster_node()
    allowed = node.peer()
    reply = allowed.call(p.Inventory(id=0))
    assert isinstance(reply, p.InventoryReply) and reply.node == "n1" and len(reply.devices) == 1
    stranger = node.peer(keypair=zmq.curve_keypair())  # a valid CURVE key, not in keys/allowed
    plain = CurvePeer(node.endpoint, None, None)  # no CURVE at all
    for peer in (stranger, plain):
        with pytest.raises(TimeoutError):
            peer.call(p.Inventory(id=0), timeout=1.5)
        peer.close()
    # The allowed one still works, and the stranger's attempt left a trace in the log.
    assert isinstance(allowed.call(p.Inventory(id=0)), p.InventoryReply)
    assert "DENIED" in node.daemon.log() or "Unknown key" in node.daemon.log()
    allowed.close()


def test_a_client_key_added_later_is_let_in_after_sighup(cluster_node):
    node = cluster_node()
    late = keys.generate(node.keys_dir, clients=("late",), server=False).clients["late"]
    early = node.peer(keys.load_client(late))
    with pytest.raises(TimeoutError):
        early.call(p.Inventory(id=0), timeout=1.0)
    early.close()
    node.daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reloaded allowed clients=late,placement" in node.daemon.log())
    peer = node.peer(keys.load_client(late))
    assert isinstance(peer.call(p.Inventory(id=0)), p.InventoryReply)
    assert node.daemon.proc.poll() is None  # SIGHUP reloads; it does not stop the daemon
    peer.close()


def test_a_bad_key_file_at_reload_keeps_the_keys_in_force(cluster_node):
    node = cluster_node()
    with open(os.path.join(node.keys_dir, keys.ALLOWED_DIR, "broken.key"), "w") as f:
        f.write("not a certificate\n")
    node.daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "keys reload failed, the old ones stay in force" in node.daemon.log())
    peer = node.peer()
    assert isinstance(peer.call(p.Inventory(id=0)), p.InventoryReply)
    peer.close()


def test_a_cluster_endpoint_that_cannot_be_bound_stops_the_start_naming_the_setting(workdir, start_daemon):
    keys.generate(os.path.join(workdir, "keys"), clients=("placement",))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write(f'[cluster]\nendpoint = "tcp://127.0.0.1:{taken.getsockname()[1]}"\n'
                f'keys_dir = "{workdir}/keys"\nevents_endpoint = ""\n')
    with pytest.raises(RuntimeError) as info:
        start_daemon()
    taken.close()
    assert "cannot bind cluster.endpoint" in str(info.value)


def test_events_reach_only_an_allowed_subscriber(inproc_cluster_node):
    node = inproc_cluster_node()
    allowed, stranger = node.subscriber(), node.subscriber(keypair=zmq.curve_keypair())
    allowed.wait_for(lambda e: e.kind == "health")  # published every 0.2 s here
    stranger.pump(1.0)
    assert stranger.events == []
    allowed.close()
    stranger.close()


def test_sessions_are_refused_on_the_cluster_endpoint(inproc_cluster_node):
    node = inproc_cluster_node()
    peer = node.peer()
    for msg in (p.Hello(id=0, protocol=p.PROTOCOL_VERSION, name="x", pid=os.getpid()), p.Acquire(id=0),
                p.Heartbeat(id=0, session="s-1", key="k")):
        reply = peer.call(msg)
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.FORBIDDEN, reply
        assert "sessions connect locally" in reply.message
    reply = peer.call(p.StatusRequest(id=0))  # read-only requests are fine
    assert isinstance(reply, p.StatusReply)
    # operator requests of the local protocol pass the root check: partition reaches its own validation
    reply = peer.call(p.Partition(id=0, device=0, shares={}))
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.DEVICE and "no MPS daemon" in reply.message
    peer.close()


def test_a_daemon_without_keys_refuses_to_start_naming_the_setting(workdir, start_daemon):
    missing = os.path.join(workdir, "no-keys")
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write(f'[cluster]\nendpoint = "tcp://127.0.0.1:{free_port()}"\nkeys_dir = "{missing}"\n')
    with pytest.raises(RuntimeError) as info:
        start_daemon()
    assert "cluster.keys_dir" in str(info.value) and "nodeagent keys generate" in str(info.value)


# ------------------------------------------------------------------ operations


def test_every_operation_refuses_bad_devices_and_values(inproc_cluster_node):
    node = inproc_cluster_node()
    peer = node.peer()
    for msg in (p.Lend(id=0, device=3, borrower="job"), p.Reclaim(id=0, device=-1), p.Drain(id=0, device=9),
                p.SetPolicy(id=0, device=1, grace_ms=5.0)):
        reply = peer.call(msg)
        assert reply.code == p.ErrorCode.DEVICE and "devices 0..0" in reply.message, reply
    for msg, fragment in ((p.Lend(id=0, device=0, borrower=" "), "borrower"),
                          (p.Lend(id=0, device=0, borrower="job", max_s=-1.0), "max_s"),
                          (p.Reclaim(id=0, device=0, deadline_ms=0.0), "deadline_ms"),
                          (p.SetPolicy(id=0, device=0, quanta_ms={"gaming": 5.0}), "gaming"),
                          (p.SetPolicy(id=0, device=0, grace_ms=-1.0), "grace_ms"),
                          (p.SetPolicy(id=0, device=0, protect_s=float("nan")), "protect_s")):
        reply = peer.call(msg)
        assert reply.code == p.ErrorCode.INVALID and fragment in reply.message, reply
    reply = peer.call(p.Inventory(id=0))  # nothing changed
    assert (reply.devices[0].state, reply.devices[0].policy.grace_ms) == ("FREE", 100.0)
    peer.close()


def test_lend_is_refused_while_inference_runs_or_is_protected(cluster_node):
    node = cluster_node(protect_s=30.0)
    peer = node.peer()
    with Client("ranker", workload="inference", endpoint=node.daemon.endpoint) as ranker:
        ranker.acquire(timeout=5)
        reply = peer.call(p.Lend(id=0, device=0, borrower="job"))
        assert reply.code == p.ErrorCode.STATE and "RUN" in reply.message, reply
        ranker.release()
        wait_for(lambda: peer.call(p.Inventory(id=0)).devices[0].state == "PROTECT")
        reply = peer.call(p.Lend(id=0, device=0, borrower="job"))
        assert reply.code == p.ErrorCode.STATE and "PROTECT" in reply.message and "lent in" in reply.message
        # a shorter protect window ends it: then the device may be lent
        policy = peer.call(p.SetPolicy(id=0, device=0, protect_s=0.0))
        assert policy.policy.protect_s == 0.0
        reply = peer.call(p.Lend(id=0, device=0, borrower="job"))
        assert (reply.state, reply.borrower, reply.changed) == ("LENT", "job", True)
        # inference is still admitted on a lent device, and the device stays lent
        ranker.acquire(timeout=5)
        ranker.release()
        assert peer.call(p.Inventory(id=0)).devices[0].state == "LENT"
    peer.close()


def test_repeated_lend_is_a_no_op_and_another_borrower_is_refused(inproc_cluster_node):
    node = inproc_cluster_node()
    peer = node.peer()
    first = peer.call(p.Lend(id=0, device=0, borrower="job-a", max_s=600.0))
    again = peer.call(p.Lend(id=0, device=0, borrower="job-a", max_s=600.0))
    assert (first.changed, again.changed, again.state, again.borrower) == (True, False, "LENT", "job-a")
    other = peer.call(p.Lend(id=0, device=0, borrower="job-b"))
    assert other.code == p.ErrorCode.STATE and "job-a" in other.message
    device = peer.call(p.Inventory(id=0)).devices[0]
    assert device.borrower == "job-a" and 590 < device.lent_until - time.time() <= 600
    reclaimed = peer.call(p.Reclaim(id=0, device=0))
    assert (reclaimed.changed, reclaimed.state, reclaimed.outcomes) == (True, "PROTECT", {})
    not_lent = peer.call(p.Reclaim(id=0, device=0))
    assert (not_lent.changed, not_lent.free_ms, not_lent.state) == (False, 0.0, "PROTECT")
    peer.close()


def test_a_training_session_of_a_borrower_joins_only_a_device_lent_to_it(cluster_node):
    node = cluster_node("--cpu-devices", "2")
    peer = node.peer()
    with pytest.raises(DaemonError) as info:
        Client("t", workload="training", endpoint=node.daemon.endpoint, borrower="job", reconnect=False)
    assert info.value.code == p.ErrorCode.STATE and "not lent to 'job'" in str(info.value)
    with Client("local", workload="training", endpoint=node.daemon.endpoint):  # local jobs: anywhere
        pass
    assert peer.call(p.Lend(id=0, device=1, borrower="job")).changed
    with Client("t", workload="training", endpoint=node.daemon.endpoint, borrower="job") as trainer:
        assert trainer.device == 1  # the lent one, though device 0 is as empty
        info = session_info(peer, "t")
        assert info.borrower == "job"
    with pytest.raises(DaemonError) as info:
        Client("u", workload="training", endpoint=node.daemon.endpoint, borrower="other-job", reconnect=False)
    assert info.value.code == p.ErrorCode.STATE and "lent to 'job', not to 'other-job'" in str(info.value)
    peer.close()


def test_drain_refuses_new_sessions_and_notifies_those_there(cluster_node):
    node = cluster_node()
    peer = node.peer()
    there = RawPeer(node.daemon.endpoint)
    there.hello("there")
    reply = peer.call(p.Drain(id=0, device=0))
    assert (reply.state, reply.changed) == ("DRAINING", True)
    assert there.next_notice(p.DrainNotice).device == 0
    with pytest.raises(DaemonError) as info:
        Client("late", endpoint=node.daemon.endpoint, workload="inference", reconnect=False)
    assert info.value.code == p.ErrorCode.STATE and "DRAINING" in str(info.value)
    assert peer.call(p.Drain(id=0, device=0)).changed is False
    lend = peer.call(p.Lend(id=0, device=0, borrower="job"))
    assert lend.code == p.ErrorCode.STATE and "DRAINING" in lend.message
    undrained = peer.call(p.Drain(id=0, device=0, cancel=True))
    assert (undrained.state, undrained.changed) == ("FREE", True)
    with Client("late", endpoint=node.daemon.endpoint):
        pass
    there.close()
    peer.close()


def test_set_policy_changes_the_quantum_a_new_welcome_reports(inproc_cluster_node):
    node = inproc_cluster_node()
    peer = node.peer()
    with Client("before", endpoint=node.daemon.endpoint) as before:
        assert (before.welcome.slice_ms, before.welcome.grace_ms) == (200.0, 100.0)
    reply = peer.call(p.SetPolicy(id=0, device=0, quanta_ms={"training": 70.0}, grace_ms=30.0, protect_s=5.0))
    assert reply.policy == p.PolicyInfo(quanta_ms={"inference": 50.0, "training": 70.0, "best-effort": 200.0},
                                        grace_ms=30.0, protect_s=5.0)
    with Client("after", endpoint=node.daemon.endpoint) as after:
        assert (after.welcome.slice_ms, after.welcome.grace_ms) == (70.0, 30.0)
    # fields left out keep their values
    reply = peer.call(p.SetPolicy(id=0, device=0, quanta_ms={"inference": 20.0}))
    assert (reply.policy.quanta_ms["training"], reply.policy.grace_ms, reply.policy.protect_s) == (70.0, 30.0, 5.0)
    assert peer.call(p.Inventory(id=0)).devices[0].policy == reply.policy
    peer.close()


# ------------------------------------------------------------------ reclaim


def test_reclaim_suspends_a_cooperative_borrower_and_reports_when_the_device_was_free(cluster_node, spawn):
    node = cluster_node()
    peer = node.peer()
    assert peer.call(p.Lend(id=0, device=0, borrower="job")).changed
    trainer = spawn(node.daemon.endpoint, "loop", "--name", "trainer", "--borrower", "job", "--seconds", "60",
                    "--park-bytes", "4096")
    sid = trainer.expect("SESSION")[2]
    trainer.expect("GRANT")
    reply = peer.call(p.Reclaim(id=0, device=0, deadline_ms=3000.0))
    assert isinstance(reply, p.ReclaimReply), reply
    assert (reply.changed, reply.state, reply.outcomes) == (True, "PROTECT", {sid: "suspended"})
    assert 0 < reply.free_ms < 3000
    trainer.expect("PARKED")
    device = peer.call(p.Inventory(id=0)).devices[0]
    assert holder(device) is None and device.borrower is None
    assert [(s.id, s.suspended, s.bytes_parked) for s in device.sessions] == [(sid, "suspended", 4096)]
    # The session was not lost: resumed over the cluster endpoint, it carries on.
    assert isinstance(peer.call(p.ResumeSession(id=0, session=sid)), p.Ok)
    trainer.expect("UNPARKED")
    trainer.expect("GRANT", count=2)
    peer.close()


def test_reclaim_stops_a_borrower_that_ignores_it_at_the_deadline(cluster_node, spawn):
    node = cluster_node()
    peer = node.peer()
    peer.call(p.Lend(id=0, device=0, borrower="job"))
    hog = spawn(node.daemon.endpoint, "stubborn", "--name", "hog", "--borrower", "job")
    sid = hog.expect("SESSION")[2]
    hog.expect("TICK", count=2)
    reply = peer.call(p.Reclaim(id=0, device=0, deadline_ms=300.0))
    assert reply.outcomes == {sid: "stopped"} and 300 <= reply.free_ms < 2000, reply
    assert_stopped(hog.proc.pid)
    assert holder(peer.call(p.Inventory(id=0)).devices[0]) is None
    peer.call(p.ResumeSession(id=0, session=sid))
    wait_for(lambda: proc_state(hog.proc.pid) != "T")
    peer.close()


def test_a_borrower_that_cannot_be_verified_is_refused(cluster_node):
    # Over a tcp local endpoint the daemon cannot verify a client (no peer credentials): it may not
    # claim a lent device's borrower (issue 32), so no borrower there is one it could not stop.
    node = cluster_node(endpoint=f"tcp://127.0.0.1:{free_port()}")
    peer = node.peer()
    peer.call(p.Lend(id=0, device=0, borrower="job", borrower_uids=[os.getuid()]))
    with pytest.raises(DaemonError) as refused:
        Client("hog", workload="training", borrower="job", endpoint=node.daemon.endpoint)
    assert refused.value.code == p.ErrorCode.FORBIDDEN and "an unverifiable peer may not join" in str(refused.value)
    with Client("ranker", workload="inference", endpoint=node.daemon.endpoint) as ranker:
        ranker.acquire(timeout=2)  # inference still may
    peer.close()


def test_a_second_reclaim_joins_the_one_under_way_and_a_session_that_dies_counts_as_gone(cluster_node, spawn):
    node = cluster_node()
    first, second = node.peer(), node.peer()
    first.call(p.Lend(id=0, device=0, borrower="job"))
    second.call(p.Inventory(id=0))  # its CURVE handshake is done: what it sends next arrives at once
    hog = spawn(node.daemon.endpoint, "stubborn", "--name", "hog", "--borrower", "job")
    sid = hog.expect("SESSION")[2]
    hog.expect("TICK", count=2)
    first_id = first.send(p.Reclaim(id=0, device=0, deadline_ms=60_000.0))
    wait_for(lambda: "[cluster] reclaim device=0" in node.daemon.log())
    second_id = second.send(p.Reclaim(id=0, device=0, deadline_ms=60_000.0))
    wait_for(lambda: "joins the one under way" in node.daemon.log())
    hog.kill()  # dies while asked to suspend: its session ends, and the device is free
    a, b = first.reply(first_id), second.reply(second_id)
    assert a.outcomes == b.outcomes == {sid: "gone"} and a.free_ms == b.free_ms < 10_000
    first.close()
    second.close()


def test_a_reclaim_under_way_at_shutdown_is_answered(cluster_node, spawn):
    node = cluster_node()
    peer = node.peer()
    peer.call(p.Lend(id=0, device=0, borrower="job"))
    hog = spawn(node.daemon.endpoint, "stubborn", "--name", "hog", "--borrower", "job")
    hog.expect("TICK", count=2)
    request_id = peer.send(p.Reclaim(id=0, device=0, deadline_ms=60_000.0))
    wait_for(lambda: "[cluster] reclaim device=0" in node.daemon.log())
    assert node.daemon.stop() == 0
    reply = peer.reply(request_id)
    assert reply.code == p.ErrorCode.SHUTTING_DOWN and "did not finish" in reply.message
    peer.close()


def test_a_lend_that_runs_out_is_reclaimed(cluster_node, spawn):
    node = cluster_node()
    peer = node.peer()
    trainer_args = ("loop", "--name", "trainer", "--borrower", "job", "--seconds", "60", "--park-bytes", "1")
    peer.call(p.Lend(id=0, device=0, borrower="job", max_s=3.0))
    trainer = spawn(node.daemon.endpoint, *trainer_args)
    sid = trainer.expect("SESSION")[2]
    trainer.expect("GRANT")
    trainer.expect("PARKED", timeout=10)
    # PARKED is printed just before the client tells the daemon
    device = wait_for(lambda: (d := peer.call(p.Inventory(id=0)).devices[0]).sessions[0].suspended == "suspended"
                      and d)
    assert (device.state, device.borrower) == ("PROTECT", None)
    assert "lend expired device=0 borrower=job" in node.daemon.log()
    assert session_info(peer, "trainer").id == sid
    peer.close()


# ------------------------------------------------------------------ events, restart


def test_events_arrive_for_join_grant_lend_and_reclaim_numbered_without_gaps(cluster_node, spawn):
    node = cluster_node()
    events = node.subscriber()
    events.wait_for(lambda e: e.kind == "health")
    peer = node.peer()
    peer.call(p.Lend(id=0, device=0, borrower="job"))
    trainer = spawn(node.daemon.endpoint, "loop", "--name", "trainer", "--borrower", "job", "--seconds", "60",
                    "--park-bytes", "1")
    sid = trainer.expect("SESSION")[2]
    trainer.expect("GRANT")
    peer.call(p.Reclaim(id=0, device=0, deadline_ms=3000.0))
    reclaim = events.wait_for(lambda e: e.kind == "reclaim")
    lend = events.wait_for(lambda e: e.kind == "lend")
    join = events.wait_for(lambda e: e.kind == "session_join")
    grant = events.wait_for(lambda e: e.kind == "grant")
    suspended = events.wait_for(lambda e: e.kind == "suspend" and e.data["outcome"] == "suspended")
    states = [(e.data["old"], e.data["new"]) for e in events.events if e.kind == "device_state"]
    assert states[:2] == [("FREE", "LENT"), ("LENT", "PROTECT")]
    assert lend.data["borrower"] == "job" and (join.session, join.data["borrower"]) == (sid, "job")
    assert grant.session == sid and grant.data["waited_ms"] >= 0
    assert suspended.session == sid and reclaim.data["suspended"] == 1 and reclaim.data["free_ms"] > 0
    assert lend.seq < join.seq < grant.seq < suspended.seq < reclaim.seq
    seqs = [e.seq for e in events.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
    assert {(e.node, e.boot) for e in events.events} == {("n1", 1)}
    assert all(abs(e.time - time.time()) < 60 for e in events.events)
    events.close()
    peer.close()


def test_events_nobody_subscribed_to_are_not_built(inproc_cluster_node):
    node = inproc_cluster_node()
    events = node.subscriber(topics=(b"device_state", b"health"))
    events.wait_for(lambda e: e.kind == "health")
    peer = node.peer()
    peer.call(p.Lend(id=0, device=0, borrower="job"))
    with Client("t", endpoint=node.daemon.endpoint, borrower="job") as trainer:  # join, grants, leave: unwanted
        for _ in range(20):
            trainer.acquire(timeout=5)
            trainer.release()
    peer.call(p.Reclaim(id=0, device=0))  # reclaim: unwanted; its device_state is wanted
    events.wait_for(lambda e: e.kind == "device_state" and e.data["new"] == "PROTECT")
    assert {e.kind for e in events.events} == {"device_state", "health"}
    seqs = [e.seq for e in events.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # the 40-odd events between were never numbered
    events.close()
    peer.close()


def test_lending_drain_and_policies_survive_a_daemon_restart(cluster_node, start_daemon):
    node = cluster_node("--cpu-devices", "3")
    peer = node.peer()
    peer.call(p.Lend(id=0, device=0, borrower="job", max_s=3600.0))
    peer.call(p.Drain(id=0, device=1))
    peer.call(p.SetPolicy(id=0, device=2, quanta_ms={"training": 70.0}, protect_s=12.0))
    before = peer.call(p.Inventory(id=0))
    node.daemon.proc.send_signal(signal.SIGKILL)
    node.daemon.proc.wait()
    start_daemon("--cpu-devices", "3")  # same endpoints, config and state dir
    after = wait_for(lambda: inventory_or_none(peer))
    assert after.boot == before.boot + 1
    assert [(d.state, d.borrower) for d in after.devices] == [("LENT", "job"), ("DRAINING", None), ("FREE", None)]
    assert abs(after.devices[0].lent_until - before.devices[0].lent_until) < 1.0
    assert after.devices[2].policy == before.devices[2].policy
    assert after.devices[2].policy.quanta_ms["training"] == 70.0 and after.devices[2].policy.protect_s == 12.0
    with Client("after", endpoint=node.daemon.endpoint, device=2) as client:
        assert client.welcome.slice_ms == 70.0
    assert peer.call(p.Lend(id=0, device=0, borrower="job")).changed is False  # still lent to it
    peer.close()


def test_a_journalled_state_that_breaks_the_lifecycle_is_ignored(inproc_cluster_node, workdir):
    from nodeagent.journal import Journal
    with Journal(os.path.join(workdir, "state", "state.db")) as journal:
        journal.put_device_state(0, "LENT", {})  # lent to nobody
        journal.put_policy(0, {"quanta_ms": {"training": -5}})
    node = inproc_cluster_node()
    peer = node.peer()
    device = peer.call(p.Inventory(id=0)).devices[0]
    assert (device.state, device.borrower, device.policy.quanta_ms["training"]) == ("FREE", None, 200.0)
    log = node.daemon.log()
    assert "journalled state of device 0 ignored" in log and "journalled policy of device 0 ignored" in log
    peer.close()


_JOIN_AS_JOBX = r"""
import sys
from client_lib import Client, DaemonError
try:
    with Client("claims-jobX", workload="training", borrower="jobX", device=0, endpoint=sys.argv[1]) as c:
        c.acquire(timeout=10)
        print("JOINED", flush=True)
except DaemonError as exc:
    print("REFUSED", exc.code, exc, flush=True)
"""


def test_a_borrower_is_who_the_lend_names_not_whoever_claims_it(nobody_daemon):
    """Issue 32, item 10: device 0 lent to jobX for uid 1234 (its user); another user (uid 65534,
    a real process) saying borrower=jobX is refused E_FORBIDDEN and counted, and charges jobX
    nothing. Lent again naming 65534, the same program joins."""
    import urllib.request

    from tests.nonroot import NOBODY_UID, run_as_nobody

    port = free_port()
    d = nobody_daemon("--metrics-port", str(port))
    root = RawPeer(d.endpoint)
    lent = root.call(p.Lend(id=root.take_id(), device=0, borrower="jobX", borrower_uids=[1234]))
    assert isinstance(lent, p.LifecycleReply) and lent.state == "LENT", lent
    done = run_as_nobody(_JOIN_AS_JOBX, d.endpoint)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"REFUSED {p.ErrorCode.FORBIDDEN}"), done.stdout
    assert f"uid {NOBODY_UID} may not join as 'jobX'" in done.stdout and "names uids 1234" in done.stdout
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'nodeagent_refused_claims_total{claim="borrower"} 1.0' in scrape
    inventory = root.call(p.Inventory(id=root.take_id()))
    assert inventory.devices[0].sessions == [] and inventory.attained_gpu_s.get("jobX", 0.0) == 0.0
    again = root.call(p.Lend(id=root.take_id(), device=0, borrower="jobX", borrower_uids=[1234, NOBODY_UID]))
    assert isinstance(again, p.LifecycleReply) and not again.changed
    done = run_as_nobody(_JOIN_AS_JOBX, d.endpoint)
    assert done.stdout.startswith("JOINED"), done.stdout + done.stderr
    root.close()
