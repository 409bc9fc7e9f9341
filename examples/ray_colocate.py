"""Inference and elastic training sharing three GPU nodes under Ray, with nodeagent's
controller lending idle inference devices to training and taking them back.

    python examples/ray_colocate.py            # a summary on stderr
    python examples/ray_colocate.py --json     # one JSON object on stdout (the end-to-end test reads it)

On this one machine it starts a Ray head and three Ray nodes ``n1``-``n3`` (each with
its own cpu-backend nodeagent daemon, endpoint, state dir, cluster port and keys),
the controller (a Ray actor), a loan agent per node, inference replicas (Ray actors
whose sessions are ``Client(workload="inference")``) and a Ray Train job that wants
up to three workers. Then:

1. ``n1`` serves steady inference (never lent); ``n3`` serves a warm-up; ``n2`` is idle.
   The controller lends ``n2``: the job starts with one worker.
2. ``n3``'s warm-up ends; after its protect window ``n3`` is lent: the job grows to two.
3. The controller is killed; Ray restarts it and it reads its state back from the nodes.
4. Inference demand rises on ``n2``: a replica joins there. The controller reclaims
   ``n2`` and stops its loan node: the job shrinks to one worker, from the hand-off.
5. Demand rises on ``n3`` too: the job's last worker is parked, its loan node kept.
6. ``n3``'s demand falls: ``n3`` is lent again, the parked worker resumes in-process.
7. ``n2``'s demand falls: ``n2`` is lent again and the job grows back to two workers.

The script is two processes: a supervisor, which never imports Ray, and the scenario's
Ray driver, its child. Every process the driver starts has a pidfile in the run directory;
when the driver is done (or fails, or is stopped: SIGTERM, Ctrl-C), the supervisor stops
each of them by its pid (never ``ray stop``), then anything descending from them that still
runs, and removes the run directory (``--keep`` keeps it, with every log). A Ray driver
cannot do this itself: it dies with its cluster.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from client_lib import query_status  # noqa: E402
from nodeagent import keys  # noqa: E402
from nodeagent_ray.raynode import MiB, RayNodeProcess, RayNodeSpec, free_port, wait_for_head_address  # noqa: E402

JOB = "job-7"
NODES = ("n1", "n2", "n3")
PROTECT_S = 3.0  # per node: how long a device whose inference went idle stays unlendable
STEP_S = 0.03  # one training step's compute (plus the all-reduce)
# Ray Train: resize quickly (issue 13 measured 68 s with the default 60 s start timeout).
TRAIN_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "3", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
             "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
             "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def say(msg: str) -> None:
    print(f"[ray_colocate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- what runs inside Ray


def train_fn(config: dict) -> None:
    """The Ray Train loop of every worker: a small MLP, data-parallel over the lent devices."""
    import torch

    import ray.train.torch
    from nodeagent_ray.train import LentWorker

    worker = LentWorker(config["job"], config["handoff_dir"], checkpoint_every=config["checkpoint_every"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    model = ray.train.torch.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = worker.start(model, opt)
    gen = torch.Generator().manual_seed(worker.rank)
    # A job of a known length splits one global batch over its workers: a step takes step_s / n.
    step_s = config["step_s"] / (worker.world_size if "steps" in config else 1)
    while True:
        started = time.perf_counter()
        x = torch.randn(32, 64, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        time.sleep(max(0.0, step_s - (time.perf_counter() - started)))
        # A job of a known length (examples/ray_policies.py) ends there; every rank counts the same steps.
        if worker.step_done(step) or step >= config.get("steps", math.inf):
            break
    worker.close()


def make_replica_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=2)
    class InferenceReplica:
        """One inference replica on the node it was placed on: a session of workload inference
        with that node's daemon (NODEAGENT_ENDPOINT is in the node's environment)."""

        def __init__(self, name: str) -> None:
            from client_lib import Client
            self.client = Client(name, workload="inference")
            self._stop = threading.Event()

        def serve(self, rate_hz: float, compute_ms: float) -> dict:
            """Requests at ``rate_hz`` until stop(): each holds the device's token for ``compute_ms``."""
            from client_lib import DaemonError
            waits, errors, period = [], 0, 1.0 / rate_hz
            next_at = time.monotonic()
            while not self._stop.is_set():
                asked = time.perf_counter()
                try:
                    with self.client.slice(timeout=10.0):
                        waits.append((time.perf_counter() - asked) * 1000.0)
                        until = time.perf_counter() + compute_ms / 1000.0
                        while time.perf_counter() < until:
                            pass
                except DaemonError:
                    errors += 1
                next_at += period
                self._stop.wait(max(0.0, next_at - time.monotonic()))
            return {"waits_ms": waits, "errors": errors}

        def stop(self) -> None:
            self._stop.set()

        def close(self) -> None:
            self.client.close()

    return InferenceReplica


# ---------------------------------------------------------------- processes on this machine


@dataclass
class Node:
    name: str
    dir: str
    endpoint: str  # local ipc endpoint
    cluster: str
    events: str
    keys_dir: str
    daemon: subprocess.Popen | None = None


class Run:
    """Everything the scenario's driver starts, each with a pidfile in the run directory, so that
    the supervisor (which never touches Ray) can stop it by pid whatever became of the driver."""

    def __init__(self, workdir: str, node_ip: str = "127.0.0.1", node_names: tuple[str, ...] = NODES) -> None:
        self.dir = workdir
        self.node_names = node_names
        self.node_ip = node_ip  # every Ray node and daemon binds this address (--node-ip)
        os.makedirs(self.dir, exist_ok=True)
        self.ray_tmp = os.path.join(self.dir, "ray")
        self.nodes: dict[str, Node] = {}
        self.fit_proc: subprocess.Popen | None = None  # the training job's driver

    # -------- nodeagent daemons

    def start_daemons(self) -> str:
        """One cpu-backend daemon per node, each with its own keys; returns the controller's key file."""
        controller_secret = None
        first_keys = None
        for name in self.node_names:
            d = os.path.join(self.dir, name)
            os.makedirs(d)
            keys_dir = os.path.join(d, "keys")
            if first_keys is None:  # what `nodeagent keys generate --dir keys --client controller` writes
                controller_secret = keys.generate(keys_dir, clients=("controller",)).clients["controller"]
                first_keys = keys_dir
            else:  # this node's own server key; the controller's public key allowed in
                keys.generate(keys_dir, clients=())
                os.makedirs(os.path.join(keys_dir, keys.ALLOWED_DIR), exist_ok=True)
                shutil.copy(os.path.join(first_keys, keys.ALLOWED_DIR, "controller.key"),
                            os.path.join(keys_dir, keys.ALLOWED_DIR, "controller.key"))
            node = Node(name, d, f"ipc://{d}/agent.sock", self.tcp_endpoint(), self.tcp_endpoint(), keys_dir)
            with open(os.path.join(d, "nodeagent.toml"), "w") as f:
                f.write(f'[cluster]\nendpoint = "{node.cluster}"\nevents_endpoint = "{node.events}"\n'
                        f'keys_dir = "{keys_dir}"\nnode = "{name}"\nprotect_s = {PROTECT_S}\n'
                        'health_interval_s = 1.0\n')
            with open(os.path.join(d, "daemon.log"), "ab") as log:
                node.daemon = subprocess.Popen(
                    [sys.executable, "-m", "nodeagent", "serve", "--config", os.path.join(d, "nodeagent.toml"),
                     "--backend", "cpu", "--endpoint", node.endpoint, "--state-dir", os.path.join(d, "state"),
                     "--ctxpool", "off"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            write_pidfile(node.daemon.pid, os.path.join(d, "daemon.json"), {"what": f"daemon {name}"})
            self.nodes[name] = node
        for node in self.nodes.values():
            deadline = time.monotonic() + 30
            while True:
                try:
                    query_status(node.endpoint, timeout=0.5)
                    break
                except Exception:
                    if node.daemon.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"daemon {node.name} did not start; the end of its log: "
                                           f"{log_tail(os.path.join(node.dir, 'daemon.log'))}") from None
                    time.sleep(0.05)
        return controller_secret

    def tcp_endpoint(self) -> str:
        """A daemon's cluster or events endpoint: a free port on ``node_ip``."""
        host = f"[{self.node_ip}]" if ":" in self.node_ip else self.node_ip
        return f"tcp://{host}:{free_port()}"

    # -------- Ray

    def spec(self, resources: dict, env: dict | None = None, labels: dict | None = None) -> RayNodeSpec:
        return RayNodeSpec(temp_dir=self.ray_tmp, plasma_dir=self.dir, num_cpus=1, memory_bytes=512 * MiB,
                           object_store_bytes=80 * MiB, resources=resources, labels=labels or {},
                           node_ip=self.node_ip,
                           env={"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                                **(env or {})})

    def start_ray(self) -> str:
        """A head, then one Ray node per nodeagent node (one at a time: nodes of one host that
        start together race for the same socket names)."""
        head = RayNodeProcess.start(self.spec({"nodeagent_head": 100}), None,
                                    log_path=os.path.join(self.dir, "ray-head.log"),
                                    pidfile=os.path.join(self.dir, "ray-head.json"))
        try:
            address = wait_for_head_address(self.ray_tmp, head._proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; the end of ray-head.log: {log_tail(os.path.join(self.dir, 'ray-head.log'))}") \
                from None
        import ray
        ray.init(address=address, namespace="nodeagent", logging_level="WARNING", log_to_driver=False)
        for name, node in self.nodes.items():
            proc = RayNodeProcess.start(
                self.spec({f"nodeagent_node:{name}": 100}, {"NODEAGENT_ENDPOINT": node.endpoint},
                          {"nodeagent.io/node": name}),
                address, log_path=os.path.join(self.dir, f"ray-{name}.log"),
                pidfile=os.path.join(self.dir, f"ray-{name}.json"))
            deadline = time.monotonic() + 60
            while ray.cluster_resources().get(f"nodeagent_node:{name}", 0) < 100:
                if not proc.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"Ray node {name} did not join; the end of ray-{name}.log: "
                                       f"{log_tail(os.path.join(self.dir, f'ray-{name}.log'))}")
                time.sleep(0.05)
        return address


class PidWatch:
    """Every pid descending from the processes we started, sampled twice a second while the run
    lasts, so that what is left in /dev/shm at the end can be told apart from other people's."""

    def __init__(self, roots) -> None:
        self._roots = roots  # a callable: the pids started so far
        self.pids: set[int] = set()
        self.start_ticks: dict[int, int] = {}  # pid -> its start time: to know it is still the same process
        self._stop = threading.Event()
        self.sample()  # now: the root is surely the process just started
        self._thread = threading.Thread(target=self._run, name="pidwatch", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        stat = f.read()
                    children.setdefault(int(stat[stat.rfind(b")") + 2:].split()[1]), []).append(int(entry))
                except (OSError, IndexError, ValueError):
                    pass
        from nodeagent.procwatch import process_start_ticks
        # From every process seen before that is still that process (what a driver started lives on,
        # re-parented, after the driver exits), and from a root not seen yet. A pid that no longer
        # is the process first seen under it (exited, perhaps reused) leads nowhere.
        todo = [*(pid for pid in self._roots() if pid not in self.start_ticks),
                *(pid for pid, ticks in self.start_ticks.items() if process_start_ticks(pid) == ticks)]
        expanded: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid in expanded:
                continue
            expanded.add(pid)
            if pid not in self.pids:
                self.pids.add(pid)
                ticks = process_start_ticks(pid)
                if ticks is not None:
                    self.start_ticks[pid] = ticks
            todo.extend(children.get(pid, ()))

    def still_running(self) -> list[int]:
        """Descendants seen during the run that are still the same processes (start time checked)
        and not zombies (dead, waiting for a parent to reap them)."""
        from nodeagent.procwatch import read_stat
        running = []
        for pid, ticks in self.start_ticks.items():
            stat = read_stat(pid)
            if pid != os.getpid() and stat is not None and stat.start_ticks == ticks and stat.state != "Z":
                running.append(pid)
        return sorted(running)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def ours_in_shm(names, pids: set[int]) -> list[str]:
    """The /dev/shm names with one of our pids as a field (nodeagent's ``na-in-<pid>-...`` and torch's
    ``torch_<pid>_...`` segments name their maker)."""
    import re
    return sorted(n for n in names if any(tok.isdigit() and int(tok) in pids for tok in re.split(r"[-_.]", n)))


def leftover_processes(marker: str) -> list[int]:
    """Processes whose command line names our run directory, or that hold a file in it open
    (Ray's agents rename themselves ``ray::...`` but keep their logs there): there should be
    none, other than this one and its parents (a wrapper that passed us the directory).
    Reported, never signalled: that a process names a path is no proof that we started it."""
    from nodeagent.procwatch import ancestors
    mine = {os.getpid(), *ancestors(os.getpid())}
    inside = marker.rstrip(os.sep) + os.sep
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found = marker.encode() in f.read()
            if not found:
                fds = f"/proc/{entry}/fd"
                found = any(os.readlink(os.path.join(fds, fd)).startswith(inside) for fd in os.listdir(fds))
        except OSError:
            continue
        if found:
            out.append(int(entry))
    return out


def write_pidfile(pid: int, path: str, meta: dict) -> None:
    """What :meth:`RayNodeProcess.from_pidfile` reads: the pid and its start time, so that the
    supervisor signals that very process and never one that reused its pid."""
    from nodeagent.procwatch import process_start_ticks
    with open(f"{path}.tmp", "w") as f:
        json.dump({"pid": pid, "start_ticks": process_start_ticks(pid), "meta": meta}, f)
    os.replace(f"{path}.tmp", path)


def stop_everything(run_dir: str, pidwatch: PidWatch, shm_before: set[str]) -> dict:
    """The supervisor's cleanup: every process the driver started, by its pidfile, newest first
    (the job's driver, which takes Ray Train with it; loan nodes; Ray nodes, the head last;
    daemons), then whatever descends from them and still runs, by start time; report what is left."""
    report: dict = {"loan_nodes": [], "ray_nodes": [], "daemons": {}}
    pidwatch.sample()
    pidwatch.stop()

    def stop(pidfile: Path) -> str:
        proc = RayNodeProcess.from_pidfile(str(pidfile))  # None: that process is gone already
        return proc.stop() if proc is not None else "exited"

    if (Path(run_dir) / "fit.json").exists():
        report["fit_driver"] = stop(Path(run_dir) / "fit.json")
    for pidfile in sorted(Path(run_dir).glob("fit-*.json")):  # one per job where a run has several
        report.setdefault("job_drivers", {})[pidfile.stem[4:]] = stop(pidfile)
    for pidfile in sorted(Path(run_dir).glob("*/loans/loan-*.json")):
        report["loan_nodes"].append(stop(pidfile))
    # Ray nodes: every other one first, newest first, then the head.
    nodes = sorted(Path(run_dir).glob("ray-*.json"), key=lambda f: (f.name == "ray-head.json", -f.stat().st_mtime))
    for pidfile in nodes:
        report["ray_nodes"].append(stop(pidfile))
    for pidfile in sorted(Path(run_dir).glob("*/daemon.json")):
        report["daemons"][pidfile.parent.name] = stop(pidfile)
    # Workers a raylet did not take down with it (Ray's own helper actors, renamed ``ray::...``):
    # descendants of what we started that are still those very processes. Stopped by pid.
    stragglers = pidwatch.still_running()
    for pid in stragglers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    report["stragglers_killed"] = stragglers
    if stragglers:
        time.sleep(0.5)
    report["leftover_processes"] = leftover_processes(run_dir)
    new = set(os.listdir("/dev/shm")) - shm_before
    report["shm_left"] = ours_in_shm(new, pidwatch.pids)
    report["shm_new_not_ours"] = len(new) - len(report["shm_left"])  # other people's tests, same machine
    return report


# ---------------------------------------------------------------- the scenario


class Scenario:
    """The seven steps of the module docstring, each waited for with a timeout, and what they measured."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.t0 = time.time()
        self.marks: dict[str, float] = {}
        self.serving: dict[str, tuple[object, object]] = {}  # name -> (replica, serve ref)
        self.inference: list[dict] = []

    def mark(self, what: str) -> None:
        self.marks[what] = round(time.time() - self.t0, 2)
        say(f"{what} (t={self.marks[what]:.1f} s)")

    def wait(self, what: str, predicate, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                self.mark(what)
                return value
            failed = self.fit_failed()
            if failed:
                raise RuntimeError(f"the training job failed while waiting for {what}: {failed}")
            time.sleep(0.1)
        raise TimeoutError(f"{what}: not within {timeout_s:g} s")

    def start(self) -> None:
        import ray

        from nodeagent_ray.actors import (NAMESPACE, Controller, ControllerSettings, LoanAgent, LoanSettings,
                                          NodeSettings, agent_name, create_job)
        os.environ.update(TRAIN_ENV)
        run = self.run
        controller_key = run.start_daemons()
        self.mark("daemons up")
        address = self.address = run.start_ray()
        self.mark("Ray cluster up (head + 3 nodes)")
        self.agents = {}  # held: an actor nobody holds a handle to is stopped by Ray
        for name, node in run.nodes.items():
            settings = LoanSettings(address=address, state_dir=os.path.join(node.dir, "loans"), temp_dir=run.ray_tmp,
                                    endpoint=node.endpoint, node_ip=run.node_ip)
            self.agents[name] = LoanAgent.options(name=agent_name(name), namespace=NAMESPACE,
                                                  resources={f"nodeagent_node:{name}": 1}).remote(name, settings)
        settings = ControllerSettings(
            nodes=tuple(NodeSettings(n.name, n.cluster, n.events, os.path.join(n.keys_dir, "server.key"))
                        for n in run.nodes.values()),
            client_key=controller_key, state_dir=os.path.join(run.dir, "controller"),
            core={"tick_ms": 100.0, "resync_s": 1.0, "reclaim_deadline_ms": 3000.0})
        self.Replica = make_replica_class()
        # n1: steady inference all along; n3: a warm-up, so the job starts on n2 alone.
        self.serve("n1", rate_hz=4, compute_ms=5)
        self.serve("n3", rate_hz=10, compute_ms=5)
        self.controller = Controller.options(name="controller", namespace=NAMESPACE,
                                             resources={"nodeagent_head": 1}).remote(settings)
        ready = ray.get(self.controller.ready.remote())
        if ready["error"]:
            raise RuntimeError(f"controller: {ready['error']}")
        self.mark("controller, loan agents and inference replicas up")
        self.tracker = create_job(JOB, max_workers=3)
        self.start_training()

    def serve(self, node: str, rate_hz: float, compute_ms: float) -> None:
        """A replica on ``node`` (its session joins once it is up), serving until stop_serving."""
        import ray
        replica = self.Replica.options(resources={f"nodeagent_node:{node}": 1}).remote(f"ranker-{node}")
        ray.get(replica.__ray_ready__.remote(), timeout=60)
        self.serving[node] = (replica, replica.serve.remote(rate_hz, compute_ms))

    def stop_serving(self, node: str) -> None:
        import ray
        replica, ref = self.serving.pop(node)
        replica.stop.remote()
        stats = ray.get(ref, timeout=30)
        ray.get(replica.close.remote(), timeout=30)
        ray.kill(replica)
        stats["node"] = node
        self.inference.append(stats)

    def start_training(self) -> None:
        """The job's driver, a process of its own as in production: it runs ``fit()`` and then
        ends the job (``finish_job``). Stopping it by pid at cleanup takes Ray Train down with it
        (its controller and workers are owned by it), whatever state the run is in."""
        self.fit_log = os.path.join(self.run.dir, "fit.log")
        with open(self.fit_log, "ab") as log:
            self.run.fit_proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--fit-driver", self.address, "--workdir", self.run.dir],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **TRAIN_ENV))
        write_pidfile(self.run.fit_proc.pid, os.path.join(self.run.dir, "fit.json"), {"what": "the job's driver"})

    def fit_failed(self) -> str | None:
        """Why the job's driver exited with an error, if it did."""
        code = self.run.fit_proc.poll()
        if code is None or code == 0:
            return None
        return f"its driver exited with status {code}: {log_tail(self.fit_log)}"

    def progress(self) -> dict:
        import ray
        return ray.get(self.tracker.progress.remote(), timeout=10)

    def training_at(self, world_size: int, since_step: int | None = None, steps: int = 20):
        """Training with ``world_size`` workers, ``steps`` past ``since_step`` (default: now), and that
        many made by the current worker group: a group that only said it started (its rank 0 calls
        ``started`` before its ranks take their devices' tokens) has not trained yet."""
        base = self.progress()["step"] if since_step is None else since_step
        return lambda: (lambda pr: pr["world_size"] == world_size
                        and pr["step"] >= max(base, pr["group_from"]) + steps and pr)(self.progress())

    def records(self, kind: str | None = None) -> list[dict]:
        import ray
        recs = ray.get(self.controller.records.remote(), timeout=10)
        return [r for r in recs if kind is None or r["kind"] == kind]

    def history(self, event: str) -> list[dict]:
        import ray
        return [h for h in ray.get(self.tracker.report.remote(), timeout=10)["history"] if h["event"] == event]

    def phases(self) -> None:
        import ray
        self.wait("1. job trains with one worker on n2", self.training_at(1, since_step=0, steps=10), 300)
        self.stop_serving("n3")
        self.wait("2. n3 lent after its protect window: job grows to two", self.training_at(2, steps=10), 120)

        pid = ray.get(self.controller.ready.remote())["pid"]
        ray.kill(self.controller, no_restart=False)
        self.wait("3. controller restarted by Ray",
                  lambda: (lambda r: r["ready"] and r["pid"] != pid)(ray.get(self.controller.ready.remote())), 60)
        lends_before = len(self.records("lend"))
        self.wait("   ... and training goes on, nothing lent twice", self.training_at(2, steps=10), 60)
        if len(self.records("lend")) != lends_before:
            raise RuntimeError("the restarted controller lent again what was already lent")

        self.serve("n2", rate_hz=20, compute_ms=5)
        self.wait("4. inference joins n2: reclaimed, job shrinks to one worker", self.training_at(1, steps=10), 120)
        self.serve("n3", rate_hz=20, compute_ms=5)
        self.wait("5. inference joins n3: the job's last worker is parked",
                  lambda: self.history("park") and [r for r in self.records("reclaim") if r["then"] == "park"], 60)
        time.sleep(1.0)  # the job waits, parked, while both nodes serve
        self.stop_serving("n3")
        trains_on = self.training_at(1, steps=10)
        self.wait("6. n3 lent again: the parked worker resumes in-process",
                  lambda: self.history("resume") and trains_on(), 60)
        self.stop_serving("n2")
        self.wait("7. n2 lent again: the job grows back to two", self.training_at(2, steps=10), 120)
        stop_at = ray.get(self.tracker.stop.remote(5))
        try:
            self.run.fit_proc.wait(60)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the job did not finish at step {stop_at}: its driver is still running") from None
        if self.fit_failed():
            raise RuntimeError(f"the job did not finish at step {stop_at}: {self.fit_failed()}")
        self.mark("job finished")
        self.stop_serving("n1")

    def result(self) -> dict:
        import ray
        recs = self.records()
        report = ray.get(self.tracker.report.remote(), timeout=10)
        starts = [h for h in report["history"] if h["event"] == "start"]
        parks = [h for h in report["history"] if h["event"] == "park"]
        resumes = [h for h in report["history"] if h["event"] == "resume"]
        waits = sorted(w for s in self.inference for w in s["waits_ms"])
        reclaims = [{k: r.get(k) for k in ("node", "device", "then", "reason", "free_ms", "ray_caught_up_ms",
                                           "join_to_free_ms", "outcomes")} for r in recs if r["kind"] == "reclaim"]
        lends = []
        for r in recs:
            if r["kind"] == "lend":
                up = [u for u in recs if u["kind"] == "loan_node" and u["node"] == r["node"] and u["time"] >= r["time"]]
                lends.append({**{k: r.get(k) for k in ("node", "device", "job", "reason", "lend_ms")},
                              "ray_node_ms": up[0]["ray_node_ms"] if up else None})
        resizes = []
        for prev, start in zip(starts, starts[1:]):
            if start["world_size"] == prev["world_size"]:
                continue
            kind = "loan_node" if start["world_size"] > prev["world_size"] else "reclaim"
            causes = [r for r in recs if r["kind"] == kind and prev["time"] <= r["time"] <= start["time"]]
            resizes.append({"from": prev["world_size"], "to": start["world_size"],
                            "seconds": round(start["time"] - causes[-1]["time"], 2) if causes else None,
                            "resumed_from_step": start["resumed_from"], "redone": start["redone"]})
        lost = sum(s["errors"] for s in self.inference) + sum(
            1 for r in reclaims for outcome in (r["outcomes"] or {}).values() if outcome != "suspended")
        # A park the same process came back from: resumed in-process (the others were let go).
        pairs = [(pk, rs) for rs in resumes for pk in parks if pk["pid"] == rs["pid"] and pk["time"] <= rs["time"]]
        pk, rs = pairs[-1] if pairs else ({}, {})
        resumed = [r for r in recs if r["kind"] == "resume"]
        park = {"parks": len(parks), "parked_at_step": pk.get("step"), "resumed_at_step": rs.get("step"),
                "parked_s": round(rs["time"] - pk["time"], 2) if pairs else None, "same_process": bool(pairs),
                "resume_ms": resumed[-1]["resume_ms"] if resumed else None}
        out = {
            "nodes": list(NODES),
            "lends": lends,
            "reclaims": reclaims,
            "train_workers_max": max((s["world_size"] for s in starts), default=0),
            "train_steps": report["step"],
            "train_steps_redone": sum(s["redone"] for s in starts),
            "train_resizes": resizes,
            "park_resume": park,
            "inference_requests": len(waits),
            "inference_wait_p50_ms": round(waits[len(waits) // 2], 2) if waits else None,
            "inference_wait_p99_ms": round(waits[min(len(waits) - 1, int(len(waits) * 0.99))], 2) if waits else None,
            "sessions_lost": lost,
            "controller_restarts": sum(1 for r in recs if r["kind"] == "controller_start") - 1,
            "phases_s": self.marks,
        }
        released = [r for r in reclaims if r["then"] == "release"]
        done = [h["time"] for h in report["history"] if h["event"] == "workers_done"]
        finish = [h["time"] for h in report["history"] if h["event"] == "finish"]
        checks = {
            "job_ended_by_its_driver_after_its_workers": bool(done and finish) and finish[-1] >= done[-1],
            "three_nodes": len(out["nodes"]) >= 3,
            "n1_never_lent": all(lend["node"] != "n1" for lend in lends),
            "grew_to_two": out["train_workers_max"] >= 2,
            "reclaimed_released_and_parked": bool(released) and any(r["then"] == "park" for r in reclaims),
            "ray_caught_up_within_1s": bool(released) and all(
                r["ray_caught_up_ms"] is not None and r["ray_caught_up_ms"] < 1000 for r in released),
            "no_step_redone": out["train_steps_redone"] == 0,
            "resumed_in_process": park["same_process"] and park["parked_at_step"] == park["resumed_at_step"],
            "no_session_lost": lost == 0,
            "controller_restarted": out["controller_restarts"] >= 1,
        }
        out["checks"] = checks
        return out


# ---------------------------------------------------------------- design A against design B


def measure_designs(run: Run, repeats: int = 3) -> dict:
    """What Ray's side of a lend and a reclaim costs in each design, on a head and one node
    (nodeagent's own lend and reclaim are the same in both, and measured by the scenario).

    A: the node offers ``nodeagent_lend: 1``; a placement group holds it while inference owns the
       device. Lend = remove the group; reclaim = kill the borrower's worker (Ray cannot take the
       unit back from a live actor) and create the group again.
    B: a loan is a Ray node of its own, started at lend, stopped (SIGTERM) at reclaim; and once,
       stopped with SIGKILL, to see how long Ray takes to notice a node that did not say goodbye."""
    import statistics

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    head = RayNodeProcess.start(run.spec({"nodeagent_head": 100}), None, log_path=os.path.join(run.dir, "ray-head.log"),
                                pidfile=os.path.join(run.dir, "ray-head.json"))
    address = wait_for_head_address(run.ray_tmp, head._proc)
    ray.init(address=address, namespace="nodeagent", logging_level="WARNING", log_to_driver=False)
    RayNodeProcess.start(run.spec({"nodeagent_lend": 1, "nodeagent_node:n1": 100}), address,
                         log_path=os.path.join(run.dir, "ray-n1.log"), pidfile=os.path.join(run.dir, "ray-n1.json"))
    until(lambda: ray.cluster_resources().get("nodeagent_lend", 0) >= 1, 60)

    @ray.remote(num_cpus=0)
    class Worker:
        def pid(self) -> int:
            return os.getpid()

    def ms(since: float) -> float:
        return round((time.monotonic() - since) * 1000.0, 1)

    a: dict[str, list[float]] = {"lend_ms": [], "worker_up_ms": [], "reclaim_caught_up_ms": []}
    for _ in range(repeats):
        pg = placement_group([{"nodeagent_lend": 1}])
        ray.get(pg.ready(), timeout=30)
        t = time.monotonic()
        remove_placement_group(pg)
        until(lambda: ray.available_resources().get("nodeagent_lend", 0) >= 1, 30)
        a["lend_ms"].append(ms(t))
        t = time.monotonic()
        worker = Worker.options(resources={"nodeagent_lend": 1}).remote()
        ray.get(worker.pid.remote(), timeout=60)
        a["worker_up_ms"].append(ms(t))
        t = time.monotonic()
        ray.kill(worker)
        pg = placement_group([{"nodeagent_lend": 1}])
        ray.get(pg.ready(), timeout=30)
        a["reclaim_caught_up_ms"].append(ms(t))
        remove_placement_group(pg)

    b: dict[str, list[float]] = {"lend_ms": [], "worker_up_ms": [], "reclaim_caught_up_ms": []}

    def loan(i: int) -> RayNodeProcess:
        t = time.monotonic()
        proc = RayNodeProcess.start(run.spec({"nodeagent_loan": 1, f"nodeagent_loan:probe{i}": 1}), address,
                                    log_path=os.path.join(run.dir, f"ray-loan{i}.log"),
                                    pidfile=os.path.join(run.dir, f"ray-loan{i}.json"))
        until(lambda: ray.cluster_resources().get(f"nodeagent_loan:probe{i}", 0) >= 1, 60)
        b["lend_ms"].append(ms(t))
        return proc

    for i in range(repeats):
        proc = loan(i)
        t = time.monotonic()
        worker = Worker.options(resources={f"nodeagent_loan:probe{i}": 1}).remote()
        ray.get(worker.pid.remote(), timeout=60)
        b["worker_up_ms"].append(ms(t))
        t = time.monotonic()
        proc.terminate()
        until(lambda: ray.cluster_resources().get(f"nodeagent_loan:probe{i}", 0) == 0
              and not any(n["Alive"] and n["Resources"].get(f"nodeagent_loan:probe{i}") for n in ray.nodes()), 60)
        b["reclaim_caught_up_ms"].append(ms(t))
        proc.stop()
    proc = loan(repeats)
    b["lend_ms"].pop()
    t = time.monotonic()
    os.killpg(proc.pid, signal.SIGKILL)  # the raylet and its agents die without a word to the GCS
    until(lambda: not any(n["Alive"] and n["Resources"].get(f"nodeagent_loan:probe{repeats}") for n in ray.nodes()),
          120)
    sigkill_s = round(time.monotonic() - t, 1)
    proc.stop()
    med = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in (("A", a), ("B", b))}
    return {"repeats": repeats, "median": med, "all": {"A": a, "B": b}, "B_sigkill_node_dead_s": sigkill_s}


def make_trainer(run_dir: str, job: str = JOB, max_workers: int = 3, steps: int | None = None,
                 step_s: float = STEP_S):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from nodeagent_ray.actors import loan_resource
    return TorchTrainer(
        train_fn,
        train_loop_config={"job": job, "handoff_dir": os.path.join(run_dir, "handoff", job), "step_s": step_s,
                           "checkpoint_every": 200, **({} if steps is None else {"steps": steps})},
        scaling_config=ScalingConfig(num_workers=(1, max_workers), resources_per_worker={loan_resource(job): 1},
                                     elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name=job, storage_path=os.path.join(run_dir, "train"),
                             failure_config=FailureConfig(max_failures=-1)))


def fit_driver(address: str, run_dir: str, job: str = JOB, max_workers: int = 3, steps: int | None = None,
               step_s: float = STEP_S) -> int:
    """``--fit-driver``: the training job's driver (the scenario starts it; the job is registered).
    ``steps``: the job ends there (examples/ray_policies.py's jobs), else when its tracker says stop."""
    import ray

    from nodeagent_ray.actors import NAMESPACE, finish_job
    ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    try:
        make_trainer(run_dir, job, max_workers, steps, step_s).fit()
    except Exception as exc:
        say(f"fit failed: {type(exc).__name__}: {exc}")
        return 1
    finish_job(job)  # only now: a loan stopped before every rank has returned is a failed worker to Ray Train
    say("fit returned; job finished")
    return 0


def log_tail(path: str, lines: int = 6) -> str:
    """The last lines of a log, on one line, for an error that the run directory will not outlive."""
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:] if line.strip()) or "(empty)"
    except OSError as exc:
        return f"(unreadable: {exc.strerror})"


def until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s:g} s")
        time.sleep(0.005)


def drive(args, body=None) -> None:
    """``--driver``: the scenario, the design measurement, or ``body(run)`` (another example's run,
    examples/ray_policies.py) as a Ray driver. Its result goes to ``result.json`` in the run
    directory, and it exits without cleaning up: the supervisor does that, because a Ray driver
    dies with its cluster (``ray.shutdown()`` after an interrupted call, or its raylet stopped
    under it) before its own cleanup could finish."""
    result: dict = {"ok": False}
    try:
        run = Run(args.workdir, args.node_ip)
        if body is not None:
            result = body(run)
        elif args.measure_designs:
            result = measure_designs(run)
            result["checks"] = {}
        else:
            scenario = Scenario(run)
            scenario.start()
            scenario.phases()
            result = scenario.result()
    except BaseException as exc:  # SIGTERM arrives as SystemExit (Ray's handler), Ctrl-C as KeyboardInterrupt
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["interrupted"] = isinstance(exc, (KeyboardInterrupt, SystemExit))
        say(f"FAILED: {result['error']}")
    path = os.path.join(args.workdir, "result.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(result, f)
    os.replace(f"{path}.tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not Ray's exit hooks: the supervisor stops the cluster


def supervise(args, script: str = __file__, driver_args: list[str] | None = None) -> int:
    """Run the driver (``script --driver``, with ``driver_args``) as a child, then stop everything
    it started by pid, whatever became of it; print the driver's result with what the cleanup found.
    examples/ray_policies.py runs its own driver under this same supervisor."""
    started = time.monotonic()
    if args.workdir and os.path.exists(args.workdir) and (not os.path.isdir(args.workdir)
                                                            or os.listdir(args.workdir)):
        say(f"--workdir {args.workdir} must be a new or empty directory: the run removes it at the end "
            "(unless --keep)")
        return 2
    run_dir = args.workdir or tempfile.mkdtemp(prefix="rc-", dir="/tmp")  # short: unix socket paths
    os.makedirs(run_dir, exist_ok=True)
    shm_before = set(os.listdir("/dev/shm"))
    # Ray writes warnings to a driver's stdout: the driver's goes to our stderr, stdout is the JSON's.
    if driver_args is None:
        driver_args = ["--measure-designs"] if args.measure_designs else []
    child = subprocess.Popen([sys.executable, os.path.abspath(script), "--driver", "--workdir", run_dir,
                              "--node-ip", args.node_ip, *driver_args],
                             stdout=sys.stderr, stdin=subprocess.DEVNULL, cwd=REPO)
    pidwatch = PidWatch(lambda: [child.pid])
    stopping: list[int] = []

    def on_signal(signum, frame):  # a test's timeout, Ctrl-C: the driver writes what it has, then we clean up
        stopping.append(signum)
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deadline = None
    while child.poll() is None:
        if stopping and deadline is None:
            deadline = time.monotonic() + 30.0
        if deadline is not None and time.monotonic() > deadline:
            child.kill()
        try:
            child.wait(0.5)
        except subprocess.TimeoutExpired:
            pass
    try:
        with open(os.path.join(run_dir, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"ok": False, "error": f"the scenario's driver exited with status {child.returncode} and no result"}
    if stopping:
        result["interrupted"] = True
    if "error" in result:
        say(f"FAILED: {result['error']} (run dir {run_dir}{'' if args.keep else ', removed'})")
    result["cleanup"] = stop_everything(run_dir, pidwatch, shm_before)
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    checks = result.setdefault("checks", {})
    checks["nothing_left_running"] = not result["cleanup"]["leftover_processes"]
    checks["nothing_left_in_dev_shm"] = not result["cleanup"]["shm_left"]
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["ok"] = "error" not in result and all(checks.values())
    if args.json:
        print(json.dumps(result, indent=1), flush=True)
    else:
        say(json.dumps({k: v for k, v in result.items() if k not in ("lends", "cleanup")}, indent=1))
    return 0 if result["ok"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--workdir", help="run directory (default: a new one under /tmp, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory and its logs")
    ap.add_argument("--measure-designs", action="store_true",
                    help="instead of the scenario: time Ray's side of a lend and a reclaim in designs A and B")
    ap.add_argument("--node-ip", default="127.0.0.1", metavar="ADDRESS",
                    help="the address every Ray node and nodeagent daemon of the run binds (default: 127.0.0.1, "
                         "so nothing listens beyond this host)")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the scenario's Ray driver (internal)
    ap.add_argument("--fit-driver", metavar="ADDRESS", help=argparse.SUPPRESS)  # the job's driver (internal)
    ap.add_argument("--job", default=JOB, help=argparse.SUPPRESS)  # with --fit-driver: which job
    ap.add_argument("--max-workers", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--step-s", type=float, default=STEP_S, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fit_driver:
        return fit_driver(args.fit_driver, args.workdir, args.job, args.max_workers, args.steps, args.step_s)
    if args.driver:
        drive(args)
    return supervise(args)


if __name__ == "__main__":
    raise SystemExit(main())
