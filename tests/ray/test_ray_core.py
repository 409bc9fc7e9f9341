"""The controller's loop (nodeagent_ray.core) against three real daemons, with fakes for what
Ray would do (start and stop loan nodes, list jobs): no Ray here. Lends only FREE devices,
reclaims the moment inference joins a lent one, parks a job's last worker and resumes it
in-process, survives its own restart and a node's death."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time

import pytest

from client_lib.placement import ClientKeys, PlacementClient
from nodeagent import keys
from nodeagent_ray import policy as pol
from nodeagent_ray.core import ControllerCore, CoreConfig, LoanNodeError, LoanRecord, StopResult
from tests.conftest import Daemon
from tests.cluster_nodes import ClusterNode, write_cluster_config

JOB = "job-7"
NAMES = ("n1", "n2", "n3")
PROTECT_S = 0.5


class Done:
    def __init__(self, ms: float) -> None:
        self.ms = ms

    def done(self) -> bool:
        return True

    def result(self) -> float:
        return self.ms


class FakeLoans:
    """Loan nodes as a dict; ``unreachable`` nodes' agents do not answer."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[str, int], LoanRecord] = {}
        self.started: list[tuple[str, int, str]] = []
        self.stopped: list[tuple[str, int]] = []
        self.unreachable: set[str] = set()
        self.fail_start: set[str] = set()  # nodes where a loan node cannot start

    def list(self, node: str) -> dict[int, LoanRecord]:
        if node in self.unreachable:
            raise LoanNodeError(f"agent of {node} unreachable")
        return {d: rec for (n, d), rec in self.nodes.items() if n == node}

    def start(self, node: str, device: int, job: str, uuid: str) -> Done:
        if node in self.fail_start:
            raise LoanNodeError(f"ray start failed on {node}")
        self.nodes[(node, device)] = LoanRecord(job, time.time())
        self.started.append((node, device, job))
        return Done(5.0)

    def stop(self, node: str, device: int) -> StopResult:
        if node in self.unreachable:
            raise LoanNodeError(f"agent of {node} unreachable")
        existed = self.nodes.pop((node, device), None) is not None
        self.stopped.append((node, device))
        return StopResult(1.0, 2.0 if existed else None)


class FakeJobs:
    def __init__(self, *jobs: pol.JobView) -> None:
        self.jobs = {j.name: j for j in jobs}
        self.told: list[tuple[str, str]] = []

    def list(self) -> dict[str, pol.JobView]:
        return dict(self.jobs)

    def loan_started(self, job: str) -> None:
        self.told.append(("started", job))

    def loan_stopped(self, job: str) -> None:
        self.told.append(("stopped", job))


@pytest.fixture
def nodes():
    workdirs = [tempfile.mkdtemp(prefix=f"na-{name}-") for name in NAMES]
    out: dict[str, ClusterNode] = {}
    try:
        for name, workdir in zip(NAMES, workdirs):
            out[name] = write_cluster_config(workdir, node=name, allow=out.get("n1"), protect_s=PROTECT_S,
                                             health_interval_s=1.0)
        for node, workdir in zip(out.values(), workdirs):
            node.daemon = Daemon(workdir, []).start()
        yield out
    finally:
        for node in out.values():
            if node.daemon is not None and node.daemon.proc.poll() is None:
                node.daemon.stop()
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


def placement(nodes: dict[str, ClusterNode]) -> PlacementClient:
    return PlacementClient({n: node.endpoint for n, node in nodes.items()},
                           keys=ClientKeys.load(nodes["n1"].client_secret),
                           server_keys={n: keys.server_public(node.keys_dir) for n, node in nodes.items()},
                           events={n: node.events for n, node in nodes.items()}, timeout_ms=1000)


_clients: list[PlacementClient] = []


@pytest.fixture(autouse=True)
def close_clients():
    """Every core's PlacementClient closed after its test (a ZeroMQ context left to the garbage
    collector can block it for good)."""
    yield
    while _clients:
        _clients.pop().close()


def new_core(nodes, loans, jobs, records) -> ControllerCore:
    client = placement(nodes)
    _clients.append(client)
    core = ControllerCore(client, loans, jobs, record=records.append,
                          config=CoreConfig(tick_ms=50, resync_s=0.5, dead_after=2, reclaim_deadline_ms=2000))
    # Every node's events socket has our subscription once its health event arrives.
    seen: set[str] = set()
    for node, _ in core._placement.events(timeout_ms=5000):
        seen.add(node)
        if seen == set(NAMES):
            break
    core.refresh()
    return core


def turn_until(core: ControllerCore, predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        core.turn()
        value = predicate()
        if value:
            return value
    raise AssertionError(f"condition not met within {timeout} s")


def states(core: ControllerCore) -> dict[str, tuple[str, str | None]]:
    core.refresh_inventory(NAMES)
    return {n: (r.devices[0].state, r.devices[0].borrower) for n, r in core._inventory.items()}


def trainer(spawn, nodes, name: str):
    child = spawn(nodes[name].daemon.endpoint, "loop", "--name", f"{JOB}-{name}", "--borrower", JOB,
                  "--seconds", "60", "--park-bytes", str(1 << 20))
    child.expect("GRANT")
    return child


def test_lends_only_free_devices_and_reclaims_the_moment_inference_joins(nodes, spawn):
    ranker = spawn(nodes["n1"].daemon.endpoint, "loop", "--name", "ranker", "--workload", "inference",
                   "--seconds", "60")
    ranker.expect("GRANT")
    loans, jobs, records = FakeLoans(), FakeJobs(pol.JobView(JOB, max_workers=3)), []
    core = new_core(nodes, loans, jobs, records)
    core.act()
    assert states(core) == {"n1": ("RUN", None), "n2": ("LENT", JOB), "n3": ("LENT", JOB)}
    assert sorted(loans.started) == [("n2", 0, JOB), ("n3", 0, JOB)]
    core.turn()  # the started loans are collected: the job is told
    assert jobs.told == [("started", JOB), ("started", JOB)]
    trainers = {name: trainer(spawn, nodes, name) for name in ("n2", "n3")}

    spawn(nodes["n2"].daemon.endpoint, "loop", "--name", "ranker-2", "--workload", "inference", "--seconds", "60")
    reclaim = turn_until(core, lambda: [r for r in records if r["kind"] == "reclaim"])[0]
    trainers["n2"].expect("PARKED")
    # The job trains on n3 too, so n2's worker is let go: its loan node stopped, Ray told.
    assert (reclaim["node"], reclaim["then"], reclaim["reason"]) == ("n2", "release", "inference session")
    assert list(reclaim["outcomes"].values()) == ["suspended"]
    assert reclaim["join_to_free_ms"] is not None and reclaim["join_to_free_ms"] < 1000
    assert 2.0 <= reclaim["ray_caught_up_ms"] < 100 and loans.stopped == [("n2", 0)]  # from the device free
    assert ("stopped", JOB) in jobs.told
    assert states(core)["n2"][0] == "RUN" and states(core)["n3"] == ("LENT", JOB)
    assert trainers["n3"].proc.poll() is None and not trainers["n3"].events("PARKED")


def test_the_last_worker_is_parked_and_resumes_in_process_when_the_device_is_free_again(nodes, spawn):
    # n1 and n2 serve inference all along: n3 is the only device the job can have.
    for name in ("n1", "n2"):
        spawn(nodes[name].daemon.endpoint, "loop", "--name", f"ranker-{name}", "--workload", "inference",
              "--seconds", "60").expect("GRANT")
    loans, jobs, records = FakeLoans(), FakeJobs(pol.JobView(JOB, max_workers=2)), []
    core = new_core(nodes, loans, jobs, records)
    core.act()
    assert states(core) == {"n1": ("RUN", None), "n2": ("RUN", None), "n3": ("LENT", JOB)}
    node = "n3"
    worker = trainer(spawn, nodes, node)

    ranker = spawn(nodes[node].daemon.endpoint, "loop", "--name", "ranker", "--workload", "inference",
                   "--seconds", "60")
    reclaim = turn_until(core, lambda: [r for r in records if r["kind"] == "reclaim"])[0]
    worker.expect("PARKED")
    assert (reclaim["node"], reclaim["then"]) == (node, "park")
    assert reclaim["ray_caught_up_ms"] is None and loans.stopped == []  # the loan node stays
    for _ in range(5):  # while inference is there, nothing else happens to it
        core.turn()
    assert [r["kind"] for r in records].count("reclaim") == 1 and not worker.events("UNPARKED")

    ranker.kill()  # inference leaves; after the protect window the device is FREE again
    resume = turn_until(core, lambda: [r for r in records if r["kind"] == "resume"])[0]
    worker.expect("UNPARKED")
    worker.expect("GRANT", count=2)
    assert (resume["node"], resume["sessions"]) == (node, [worker.expect("SESSION")[2]])
    assert states(core)[node] == ("LENT", JOB) and loans.stopped == [] and len(loans.started) == 1


def test_a_restarted_controller_reads_the_loans_back_and_lends_nothing_twice(nodes, spawn):
    loans, jobs, records = FakeLoans(), FakeJobs(pol.JobView(JOB, max_workers=2)), []
    first = new_core(nodes, loans, jobs, records)
    first.act()
    first._placement.close()  # the controller dies
    assert len(loans.started) == 2
    # A lend whose loan node never started (the controller died between the two halves).
    half_done = next(key for key in loans.nodes if key[0] != "n1")
    del loans.nodes[half_done]

    second = new_core(nodes, loans, jobs, records)
    decisions = second.act()
    assert decisions == [pol.Lend(half_done[0], 0, JOB, "lent without a loan node")]
    assert loans.started[-1] == (half_done[0], 0, JOB) and len(loans.started) == 3
    assert second.act() == []  # and nothing more: no device lent twice, nothing taken back
    assert [r["kind"] for r in records].count("reclaim") == 0


def test_a_dead_nodes_loans_are_written_off_and_the_other_nodes_untouched(nodes, spawn):
    loans, jobs, records = FakeLoans(), FakeJobs(pol.JobView(JOB, max_workers=2)), []
    core = new_core(nodes, loans, jobs, records)
    core.act()
    lent = sorted(n for n, _ in loans.nodes)
    survivor_worker = trainer(spawn, nodes, lent[0])
    dying = nodes[lent[1]].daemon
    loans.unreachable.add(lent[1])  # the whole machine went: its agent does not answer either
    dying.proc.send_signal(signal.SIGKILL)
    dying.proc.wait()

    write_off = turn_until(core, lambda: [r for r in records if r["kind"] == "write_off"])[0]
    assert write_off == {"kind": "write_off", "node": lent[1], "loans": [[0, JOB]]}
    assert ("stopped", JOB) in jobs.told
    for _ in range(5):
        core.turn()
    # The other loan is untouched: still lent, its loan node running, its worker training.
    assert states(core)[lent[0]] == ("LENT", JOB) and (lent[0], 0) in loans.nodes
    assert [(n, d) for n, d in loans.stopped if n == lent[0]] == []
    assert survivor_worker.proc.poll() is None and not survivor_worker.events("PARKED")
    assert [r for r in records if r["kind"] in ("reclaim", "release")] == []
    # ... and the free node left over is lent in the dead one's place (max_workers=2).
    assert ("n1", 0) in loans.nodes


def test_a_serving_layers_demand_takes_back_the_cheapest_loan(nodes, spawn):
    cheap, dear = pol.JobView("cheap", max_workers=2, steps_since_checkpoint=1), pol.JobView("dear", max_workers=1)
    loans, jobs, records = FakeLoans(), FakeJobs(cheap, dear), []
    core = new_core(nodes, loans, jobs, records)
    core.act()
    lent = {n: borrower for n, (state, borrower) in states(core).items() if state == "LENT"}
    assert sorted(lent.values()) == ["cheap", "cheap", "dear"]
    # Taking dear's only device would stop that job; either of cheap's leaves it training.
    future = core.request_inference_devices(1)
    turn_until(core, future.done)
    [(node, device)] = future.result()
    assert lent[node] == "cheap" and device == 0
    assert states(core)[node][1] is None
    reclaim = next(r for r in records if r["kind"] == "reclaim")
    assert (reclaim["node"], reclaim["reason"], reclaim["then"]) == (node, "inference demand", "release")


def test_a_device_whose_loan_node_cannot_start_is_given_back_and_not_lent_again_at_once(nodes):
    loans, jobs, records = FakeLoans(), FakeJobs(pol.JobView(JOB, max_workers=3)), []
    loans.fail_start.add("n2")
    core = new_core(nodes, loans, jobs, records)
    core.act()
    turn_until(core, lambda: states(core)["n2"] != ("LENT", JOB))
    failed = [r for r in records if r["kind"] == "loan_node_failed"]
    assert [(r["node"], r["job"]) for r in failed] == [("n2", JOB)] and "ray start failed" in failed[0]["error"]
    # Its protect window (0.5 s) passes: FREE again, but it is not lent again yet; the others stay lent.
    for _ in range(20):
        core.turn()
    assert states(core) == {"n1": ("LENT", JOB), "n2": ("FREE", None), "n3": ("LENT", JOB)}
    assert [r["node"] for r in records if r["kind"] == "lend"] == ["n1", "n2", "n3"]


# ---------------------------------------------------------------- the job tracker, without Ray


def test_once_a_stop_is_asked_a_loan_node_coming_up_pauses_the_job_no_more():
    # After the last resize the driver asks for a stop 5 steps on; a late loan_started (a lend
    # again, a loan node Ray Train cannot use) must not send the workers into a wait for a
    # restart that never comes: they would not reach the stop step while they wait.
    from nodeagent_ray.actors import JobTracker
    job = JobTracker("job-7", max_workers=3)
    assert job.started(world_size=2, resumed_from=100, pid_of_rank0=1) == 0
    assert job.step_done(101, 2) == {"pause_epoch": 0, "stop": False}
    assert not job.stop_asked()
    assert job.stop(5) == 106
    assert job.stop_asked()
    started = time.monotonic()
    assert job.resize_coming(timeout_s=2.0) is False
    assert time.monotonic() - started < 1.0  # it did not wait for a hand-off either
    assert job.step_done(102, 2) == {"pause_epoch": 0, "stop": False}
    assert [h["event"] for h in job.history] == ["start"]
    assert job.step_done(106, 2)["stop"] is True


def test_a_training_job_is_paused_by_a_loan_node_coming_up_until_a_stop_is_asked():
    from nodeagent_ray.actors import JobTracker
    job = JobTracker("job-7", max_workers=3)
    job.started(world_size=1, resumed_from=0, pid_of_rank0=1)
    job.step_done(1, 1)
    assert job.resize_coming(timeout_s=0.05) is False  # nobody handed off in time
    assert job.step_done(2, 1)["pause_epoch"] == 1
    job.handed_off(2, "resize", epoch=1)
    assert job.started(world_size=2, resumed_from=2, pid_of_rank0=2) == 1
    assert job.progress()["group_from"] == 2  # the scenario waits for steps past it, not for started() alone
