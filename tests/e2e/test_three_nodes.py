"""Three daemons on the cpu backend, on loopback ports, driven by one PlacementClient as a
placement layer would: lend two devices to a training job, see inference arrive on one,
reclaim it, and check the reclaim time and that no training session was lost."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time

import pytest

from client_lib import protocol as p
from client_lib.placement import ClientKeys, NodeTimeoutError, PlacementClient
from nodeagent import keys
from tests.conftest import Daemon, wait_for
from tests.cluster_nodes import ClusterNode, write_cluster_config

JOB = "job-7"
NAMES = ("n1", "n2", "n3")


@pytest.fixture
def three_nodes():
    """n1, n2, n3: one cpu device each, their own server keys, one shared placement client key."""
    workdirs = [tempfile.mkdtemp(prefix=f"na-{name}-") for name in NAMES]
    nodes: dict[str, ClusterNode] = {}
    try:
        for name, workdir in zip(NAMES, workdirs):
            nodes[name] = write_cluster_config(workdir, node=name, allow=nodes.get("n1"), health_interval_s=1.0)
        for node, workdir in zip(nodes.values(), workdirs):
            node.daemon = Daemon(workdir, []).start()
        yield nodes
    finally:
        for node in nodes.values():
            if node.daemon is not None and node.daemon.proc.poll() is None:
                assert node.daemon.stop() == 0, node.daemon.log()
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


def test_lend_two_devices_reclaim_one_under_inference_and_lose_no_session(three_nodes, spawn):
    nodes = three_nodes
    placement = PlacementClient({n: node.endpoint for n, node in nodes.items()},
                                keys=ClientKeys.load(nodes["n1"].client_secret),
                                server_keys={n: keys.server_public(node.keys_dir) for n, node in nodes.items()},
                                events={n: node.events for n, node in nodes.items()}, timeout_ms=5000)
    with placement:
        # Every node's events socket has our subscription once its periodic health event reaches us.
        healthy: set[str] = set()
        for node, event in placement.events(timeout_ms=5000):
            healthy.add(node)
            if healthy == set(NAMES):
                break
        assert healthy == set(NAMES)
        inventory = placement.inventory()
        assert all(r.ok for r in inventory.values()), inventory
        assert {n: [d.state for d in r.reply.devices] for n, r in inventory.items()} == \
            {"n1": ["FREE"], "n2": ["FREE"], "n3": ["FREE"]}

        # Lend a device on n1 and on n2 to the job; its training processes join them.
        for name in ("n1", "n2"):
            reply = placement.lend(name, 0, JOB)
            assert (reply.state, reply.borrower, reply.changed) == ("LENT", JOB, True)
        trainers = {name: spawn(nodes[name].daemon.endpoint, "loop", "--name", f"{JOB}-{name}", "--borrower", JOB,
                                "--seconds", "120", "--park-bytes", str(64 << 20))
                    for name in ("n1", "n2")}
        sessions = {name: t.expect("SESSION")[2] for name, t in trainers.items()}
        for t in trainers.values():
            t.expect("GRANT")
        lent = placement.inventory()
        for name in ("n1", "n2"):
            device = lent[name].reply.devices[0]
            assert (device.state, device.borrower) == ("LENT", JOB)
            assert [(s.id, s.borrower) for s in device.sessions] == [(sessions[name], JOB)]
        assert lent["n3"].reply.devices[0].sessions == []

        # Inference load arrives on n1: it outranks the trainer at once, and the device stays lent
        # until the placement layer decides; it reclaims the device for inference.
        ranker = spawn(nodes["n1"].daemon.endpoint, "loop", "--name", "ranker", "--workload", "inference",
                       "--seconds", "120")
        ranker.expect("GRANT")
        assert placement.inventory(["n1"])["n1"].reply.devices[0].state == "LENT"
        asked = time.monotonic()
        reclaimed = placement.reclaim("n1", 0, deadline_ms=3000)
        call_ms = (time.monotonic() - asked) * 1000
        assert reclaimed.outcomes == {sessions["n1"]: "suspended"}, reclaimed
        assert 0 < reclaimed.free_ms < 3000 and reclaimed.free_ms <= call_ms
        assert reclaimed.state == "RUN"  # PROTECT resolved at once: inference is active there
        trainers["n1"].expect("PARKED")

        # No session was lost: n1's trainer is there, suspended; n2's still trains on its lent device.
        after = placement.inventory()
        n1 = after["n1"].reply.devices[0]
        assert (n1.state, n1.borrower) == ("RUN", None)
        trainer_n1 = next(s for s in n1.sessions if s.id == sessions["n1"])
        assert (trainer_n1.suspended, trainer_n1.bytes_parked, trainer_n1.borrower) == ("suspended", 64 << 20, JOB)
        n2 = after["n2"].reply.devices[0]
        assert (n2.state, [s.id for s in n2.sessions]) == ("LENT", [sessions["n2"]])
        assert n2.sessions[0].suspended is None

        # The events of all three nodes arrive as one stream, each node numbering its own.
        seen: dict[tuple[str, str], p.Event] = {}
        deadline = time.monotonic() + 10
        for node, event in placement.events(timeout_ms=2000):
            seen.setdefault((node, event.kind), event)
            if {("n1", "reclaim"), ("n1", "lend"), ("n2", "lend"), ("n3", "health")} <= set(seen) \
                    or time.monotonic() > deadline:
                break
        assert seen[("n1", "reclaim")].data["free_ms"] == pytest.approx(reclaimed.free_ms, abs=0.01)
        assert seen[("n1", "lend")].data["borrower"] == JOB and seen[("n2", "lend")].node == "n2"
        assert ("n3", "health") in seen and placement.event_gaps == {"n1": 0, "n2": 0, "n3": 0}

        # The inference load ends; told to, the suspended trainer resumes where it was.
        ranker.kill()
        assert isinstance(placement.resume("n1", sessions["n1"]), p.Ok)
        trainers["n1"].expect("UNPARKED")
        trainers["n1"].expect("GRANT", count=2, timeout=15)
        assert len(trainers["n2"].events("GRANT")) >= 1 and trainers["n2"].proc.poll() is None

        # A node that stops answering costs only the timeout; the others answer.
        nodes["n3"].daemon.proc.send_signal(signal.SIGKILL)
        nodes["n3"].daemon.proc.wait()
        started = time.monotonic()
        partial = placement.call(p.Inventory, timeout_ms=1000)
        assert time.monotonic() - started < 3.0
        assert partial["n1"].ok and partial["n2"].ok
        assert isinstance(partial["n3"].error, NodeTimeoutError)
        # the ranker's session ended with its process; the trainer's stayed
        wait_for(lambda: {s.id for s in placement.inventory(["n1"])["n1"].reply.devices[0].sessions}
                 == {sessions["n1"]})
