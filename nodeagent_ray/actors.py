"""The Ray side of nodeagent's placement layer: :class:`LoanAgent` (one per GPU node: a loan is a
Ray node of its own), :class:`Controller` (the placement layer as a restartable Ray actor running
:class:`nodeagent_ray.core.ControllerCore`) and the job helpers. Detail: docs/internals.md.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

import ray

from client_lib.placement import ClientKeys, PlacementClient, load_server_public
from nodeagent_ray import core as core_mod
from nodeagent_ray import policy as pol
from nodeagent_ray.jobsignals import JobSignals
from nodeagent_ray.raynode import RayNodeProcess, RayNodeSpec, host_start_lock

log = logging.getLogger("nodeagent_ray")

__all__ = ["Controller", "ControllerSettings", "JobTracker", "LoanAgent", "LoanSettings", "NodeSettings", "RayJobs",
           "RayLoanNodes", "TrainingJob", "check_name", "create_job", "finish_job", "job_tracker", "loan_resource",
           "poke_ray_train"]

NAMESPACE = "nodeagent"
CONTROLLER_NAME = "controller"
LOAN_RESOURCE = "nodeagent_loan"
LABEL_NODE = "nodeagent.io/node"
LABEL_DEVICE = "nodeagent.io/device"
LABEL_BORROWER = "nodeagent.io/borrower"
ENV_BORROWER = "NODEAGENT_BORROWER"
ENV_ENDPOINT = "NODEAGENT_ENDPOINT"
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
_RAY_CALL_S = 5.0  # an actor that does not answer in this long is taken as unavailable this round


def _log_to_stderr() -> None:
    """Inside a Ray worker: our INFO lines to its log file (stderr), with their prefixes."""
    logger = logging.getLogger("nodeagent_ray")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{what} {name!r} must be 1-63 of A-Z a-z 0-9 _ . - starting and ending with a letter or "
                         "digit (it becomes a Ray label value)")
    return name


def loan_resource(job: str) -> str:
    """The custom resource a loan node lent to ``job`` offers: its workers ask for one unit."""
    return f"{LOAN_RESOURCE}:{check_name('job', job)}"


def agent_name(node: str) -> str:
    return f"loans:{node}"


def job_tracker_name(job: str) -> str:
    return f"job:{job}"


def poke_ray_train(requester: str = "nodeagent") -> bool:
    """Make Ray Train's elastic scaling see a node that came or went now, not at its next 20 s tick.

    Ray Train 2.60 sizes an elastic worker group from the reservations of Ray Data's
    ``AutoscalingCoordinator`` actor, which re-reads the cluster every 20 s; asking it for a
    reservation with ``recompute=True`` re-reads it at once. An internal actor, so this is
    version-bound (the ``ray`` extra pins 2.60.x): False when it is not there (no Ray Train job
    has started yet, or another Ray, or no Ray at all) and nothing was done."""
    if not ray.is_initialized():  # ray.get_actor would start a local Ray instance of its own
        return False
    try:
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
        ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True), timeout=_RAY_CALL_S)
        return True
    except Exception as exc:  # not started, or an internal API that moved
        log.debug("[ray] AutoscalingCoordinator not poked: %s", exc)
        return False


# ---------------------------------------------------------------- loan nodes


def loan_node_spec(s: "LoanSettings", node: str, device: int, job: str, uuid: str = "") -> RayNodeSpec:
    """The Ray node that carries ``node``'s ``device`` lent to ``job``."""
    env = {ENV_BORROWER: job, ENV_ENDPOINT: s.endpoint}
    if s.gpu:
        env["CUDA_VISIBLE_DEVICES"] = uuid
    return RayNodeSpec(temp_dir=s.temp_dir, plasma_dir=s.state_dir, num_cpus=s.num_cpus,
                       num_gpus=1 if s.gpu else 0, memory_bytes=s.memory_bytes,
                       object_store_bytes=s.object_store_bytes,
                       resources={LOAN_RESOURCE: 1, loan_resource(job): 1},
                       labels={LABEL_NODE: node, LABEL_DEVICE: str(device), LABEL_BORROWER: job},
                       env=env, node_ip=s.node_ip)


@dataclass(frozen=True)
class LoanSettings:
    """How a node's agent starts loan nodes."""

    address: str  # the Ray head's GCS address
    state_dir: str  # pidfiles and logs of this node's loan nodes
    temp_dir: str  # Ray's temp dir for them (short path: unix sockets live there)
    endpoint: str  # this node's nodeagent local endpoint, for the loan's workers
    num_cpus: float = 1
    memory_bytes: int = 512 << 20
    object_store_bytes: int = 80 << 20
    gpu: bool = False  # a loan node gets the lent GPU: --num-gpus 1 and CUDA_VISIBLE_DEVICES=<uuid>
    start_timeout_s: float = 60.0
    node_ip: str | None = None  # the loan nodes' --node-ip-address; None: Ray's choice
    # A file the agents of one host lock while a loan node starts, until it joins (raynode.host_start_lock):
    # set where several agents share a host, as in a one-host demo; None on a cluster.
    start_lock: str | None = None


@ray.remote(num_cpus=0, max_concurrency=4)
class LoanAgent:
    """Starts and stops the loan nodes of one GPU node (it must run on that node)."""

    def __init__(self, node: str, settings: LoanSettings) -> None:
        _log_to_stderr()
        self.node = check_name("node", node)
        self.settings = settings
        os.makedirs(settings.state_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._procs: dict[int, RayNodeProcess] = {}
        for path in glob.glob(os.path.join(settings.state_dir, "loan-*.json")):  # an agent that restarted
            proc = RayNodeProcess.from_pidfile(path)
            if proc is not None:
                self._procs[int(proc.meta["device"])] = proc
                log.info("[loans] node=%s adopted loan node pid=%d device=%s job=%s", node, proc.pid,
                         proc.meta["device"], proc.meta["job"])

    def list(self) -> dict[int, tuple[str, float]]:
        """device -> (job, since) for each loan node still running."""
        with self._lock:
            return {d: (p.meta["job"], p.meta["since"]) for d, p in self._procs.items() if p.alive()}

    def start(self, device: int, job: str, uuid: str = "") -> float:
        """Start a loan node for ``device`` lent to ``job``; returns once Ray lists it (ms)."""
        check_name("job", job)
        started = time.monotonic()
        with host_start_lock(self.settings.start_lock):
            return self._start(device, job, uuid, started)

    def _start(self, device: int, job: str, uuid: str, started: float) -> float:
        """``start`` once this host starts no other Ray node; the ms reported count from ``started``."""
        with self._lock:
            proc = self._procs.get(device)
            if proc is not None and proc.alive():
                if proc.meta["job"] != job:
                    raise core_mod.LoanNodeError(f"node {self.node} device {device} has a loan node for "
                                                 f"{proc.meta['job']!r}; stop it before lending to {job!r}")
            else:
                s = self.settings
                spec = loan_node_spec(s, self.node, device, job, uuid)
                proc = RayNodeProcess.start(spec, s.address, log_path=os.path.join(s.state_dir, f"loan-{device}.log"),
                                            pidfile=os.path.join(s.state_dir, f"loan-{device}.json"),
                                            meta={"device": device, "job": job, "since": time.time(),
                                                  "node": self.node})
                self._procs[device] = proc
        deadline = time.monotonic() + self.settings.start_timeout_s  # from now: not the wait for the lock
        while time.monotonic() < deadline:
            if _find_ray_node(self.node, device, job, alive=True) is not None:
                ms = (time.monotonic() - started) * 1000.0
                log.info("[loans] node=%s device=%d job=%s loan node up in %.0f ms", self.node, device, job, ms)
                return ms
            if not proc.alive():
                raise core_mod.LoanNodeError(f"the loan node for node {self.node} device {device} exited while "
                                             f"starting; see {self.settings.state_dir}/loan-{device}.log")
            time.sleep(0.05)
        self.stop(device)
        raise core_mod.LoanNodeError(f"the loan node for node {self.node} device {device} did not join Ray within "
                                     f"{self.settings.start_timeout_s:g} s")

    def stop(self, device: int) -> str | None:
        """SIGTERM the loan node of ``device`` and return its Ray node id (None: there was none).
        Its process is reaped on a thread of this agent (SIGKILL after 10 s)."""
        with self._lock:
            proc = self._procs.pop(device, None)
        if proc is None or not proc.alive():
            return None
        ray_node = _find_ray_node(self.node, device, proc.meta["job"], alive=True)
        proc.terminate()
        threading.Thread(target=proc.stop, name=f"reap-loan-{device}", daemon=True).start()
        log.info("[loans] node=%s device=%d loan node pid=%d told to stop", self.node, device, proc.pid)
        return ray_node

    def stop_all(self) -> list[str]:
        """Stop every loan node of this node and wait for them; returns the step each took."""
        with self._lock:
            procs, self._procs = list(self._procs.values()), {}
        return [proc.stop() for proc in procs]


def _find_ray_node(node: str, device: int, job: str, alive: bool) -> str | None:
    """The Ray node id of the loan node for ``device`` of ``node`` lent to ``job``, by its labels."""
    want = {LABEL_NODE: node, LABEL_DEVICE: str(device), LABEL_BORROWER: job}
    for info in ray.nodes():
        labels = info.get("Labels") or {}
        if all(labels.get(k) == v for k, v in want.items()) and info["Alive"] == alive:
            return info["NodeID"]
    return None


class _RefPending:
    """A loan node starting: a Ray ObjectRef seen as :class:`nodeagent_ray.core.Pending`."""

    def __init__(self, ref) -> None:
        self._ref = ref

    def done(self) -> bool:
        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def result(self) -> float:
        try:
            return ray.get(self._ref, timeout=_RAY_CALL_S)
        except ray.exceptions.RayTaskError as exc:
            raise core_mod.LoanNodeError(str(exc.cause if hasattr(exc, "cause") else exc)) from None
        except Exception as exc:
            raise core_mod.LoanNodeError(f"the loan agent failed: {exc}") from None


class RayLoanNodes:
    """The core's :class:`~nodeagent_ray.core.LoanNodes`, through each node's :class:`LoanAgent`."""

    def __init__(self, caught_up_timeout_s: float = 5.0) -> None:
        self._agents: dict[str, object] = {}
        self.caught_up_timeout_s = caught_up_timeout_s

    def _agent(self, node: str):
        agent = self._agents.get(node)
        if agent is None:
            try:
                agent = ray.get_actor(agent_name(node), namespace=NAMESPACE)
            except ValueError:
                raise core_mod.LoanNodeError(f"no loan agent for node {node!r} (actor {agent_name(node)!r} in "
                                             f"namespace {NAMESPACE!r})") from None
            self._agents[node] = agent
        return agent

    def list(self, node: str) -> dict[int, core_mod.LoanRecord]:
        try:
            loans = ray.get(self._agent(node).list.remote(), timeout=_RAY_CALL_S)
        except core_mod.LoanNodeError:
            raise
        except Exception as exc:
            self._agents.pop(node, None)
            raise core_mod.LoanNodeError(f"the loan agent of node {node!r} did not answer: {exc}") from None
        return {int(d): core_mod.LoanRecord(job, since) for d, (job, since) in loans.items()}

    def start(self, node: str, device: int, job: str, uuid: str) -> core_mod.Pending:
        return _RefPending(self._agent(node).start.remote(device, job, uuid))

    def stop(self, node: str, device: int) -> core_mod.StopResult:
        """Stop the loan node, then watch the GCS until it shows the node dead and its loan unit gone."""
        started = time.monotonic()
        try:
            ray_node = ray.get(self._agent(node).stop.remote(device), timeout=_RAY_CALL_S)
        except core_mod.LoanNodeError:
            raise
        except Exception as exc:
            raise core_mod.LoanNodeError(f"the loan agent of node {node!r} did not stop device {device}: {exc}") \
                from None
        stop_ms = (time.monotonic() - started) * 1000.0
        if ray_node is None:
            return core_mod.StopResult(stop_ms, None)
        deadline = started + self.caught_up_timeout_s
        while time.monotonic() < deadline:
            if not _ray_node_alive(ray_node):
                return core_mod.StopResult(stop_ms, round((time.monotonic() - started) * 1000.0, 3))
            time.sleep(0.005)
        log.warning("[ray] loan node %s of node=%s device=%d still alive in Ray after %.0f s", ray_node, node, device,
                    self.caught_up_timeout_s)
        return core_mod.StopResult(stop_ms, None)


def _ray_node_alive(node_id: str) -> bool:
    return any(info["NodeID"] == node_id and info["Alive"] for info in ray.nodes())


# ---------------------------------------------------------------- jobs


class RayJobs:
    """The core's :class:`~nodeagent_ray.core.Jobs`: every :class:`TrainingJob` tracker in the namespace."""

    def list(self) -> dict[str, pol.JobView]:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE and a["name"].startswith("job:")]
        refs = [ray.get_actor(name, namespace=NAMESPACE).view.remote() for name in names]
        views = ray.get(refs, timeout=_RAY_CALL_S)  # one that does not answer: jobs unknown this round
        return {v["name"]: job_view(v) for v in views if not v["finished"]}

    def loan_started(self, job: str) -> None:
        job_tracker(job).resize_coming.remote()  # it asks the workers to hand off, then pokes Ray Train

    def loan_stopped(self, job: str) -> None:
        poke_ray_train()


_SIGNALS = ("submitted_at", "steps_per_s", "steps_done", "expected_steps", "deadline", "last_resize_at")


def job_view(view: dict) -> pol.JobView:
    """A tracker's :meth:`JobTracker.view` as the policy's JobView (a tracker of an older release
    reports no signals: they stay unknown)."""
    return pol.JobView(view["name"], view["max_workers"], view["steps_since_checkpoint"],
                       **{k: view[k] for k in _SIGNALS if k in view})


def job_tracker(job: str):
    return ray.get_actor(job_tracker_name(check_name("job", job)), namespace=NAMESPACE)


def finish_job(job: str, timeout_s: float = 10.0) -> None:
    """Training job ``job`` is over (call it after the trainer's fit returns): the controller takes its
    loans back and lends it nothing more. A driver that exits without it ends the job too (the
    tracker goes with it), only later. Not from a worker: other ranks may still be returning."""
    ray.get(job_tracker(job).finished.remote(), timeout=timeout_s)


def create_job(job: str, max_workers: int, *, expected_steps: int | None = None, deadline: float | None = None):
    """The tracker of training job ``job`` (made if it does not exist): the controller lends to it from now on.
    ``expected_steps`` (its whole length) and ``deadline`` (unix time: an SLO job) are what the
    knapsack and deadline policies plan with (docs/cluster.md, section 8)."""
    if not (isinstance(max_workers, int) and max_workers >= 1):
        raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
    JobSignals(created_at=0.0, expected_steps=expected_steps, deadline=deadline)  # checks them here, not in the actor
    # Owned by the caller: when the job's driver goes, so does the job, and the controller takes its loans back.
    # On the caller's node, as Ray Train places its own controller: a tracker Ray put on a loan node (any
    # node will do for an actor of no resources) died when that loan was reclaimed.
    return TrainingJob.options(name=job_tracker_name(check_name("job", job)), namespace=NAMESPACE,
                               get_if_exists=True, label_selector=_this_node()).remote(
        job, max_workers, expected_steps=expected_steps, deadline=deadline)


def _this_node() -> dict[str, str]:
    """A label selector for the node this process runs on."""
    return {ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}


class JobTracker:
    """One elastic training job's tracker; :data:`TrainingJob` is this class as a Ray actor (named
    ``job:<name>``; made by :func:`create_job`).

    Rank 0 of the job calls :meth:`step_done` after every step and :meth:`started` when a
    worker group starts; the controller reads :meth:`view` and calls :meth:`resize_coming`
    when a loan node for the job is up. The reply to ``step_done`` carries the notices the
    workers act on together (``pause``: hand the state off and wait to be resized; ``stop``).
    A stop outranks a pause: once one is asked no pause is given, and a group already waiting
    for a resize learns it from :meth:`stop_asked` and trains on to the stop step."""

    def __init__(self, job: str, max_workers: int, *, expected_steps: int | None = None,
                 deadline: float | None = None) -> None:
        self.job = job
        self.max_workers = int(max_workers)
        self._signals = JobSignals(created_at=time.time(), expected_steps=expected_steps, deadline=deadline)
        self._cond = threading.Condition()
        self._step = 0  # the highest step a worker reported done
        self._step_at = 0.0  # when (unix time)
        self._checkpoint_step = 0
        self._world_size = 0
        self._group_from = 0  # the step the current worker group started from
        self._pause_epoch = 0
        self._handed_off_epoch = 0
        self._stop_at: int | None = None
        self._finished = False
        self.history: list[dict] = []  # starts, hand-offs, parks, resumes, pauses, in order

    def view(self) -> dict:
        with self._cond:
            return {"name": self.job, "max_workers": self.max_workers, "finished": self._finished,
                    "steps_since_checkpoint": max(0, self._step - self._checkpoint_step),
                    **self._signals.view_fields()}

    # -------- from the workers

    def started(self, world_size: int, resumed_from: int, pid_of_rank0: int) -> int:
        """A worker group began: ``resumed_from`` is the step its state is from. Returns the
        notice epoch it starts at (older notices are not for it)."""
        with self._cond:
            redone = max(0, self._step - resumed_from)
            self._world_size = world_size
            self._step = resumed_from
            self._group_from = resumed_from
            self._checkpoint_step = resumed_from
            self.history.append({"event": "start", "time": time.time(), "world_size": world_size,
                                 "resumed_from": resumed_from, "redone": redone, "pid": pid_of_rank0})
            self._handed_off_epoch = self._pause_epoch
            self._signals.group_started(world_size, resumed_from, time.time())
            self._cond.notify_all()
            return self._pause_epoch

    def step_done(self, step: int, world_size: int) -> dict:
        with self._cond:
            if step > self._step:
                self._step, self._step_at = step, time.time()
            self._world_size = world_size
            self._signals.step_done(step, world_size, time.time())
            stop = self._stop_at is not None and step >= self._stop_at
            return {"pause_epoch": self._pause_epoch, "stop": stop}

    def handed_off(self, step: int, why: str, epoch: int = 0) -> None:
        with self._cond:
            self._checkpoint_step = max(self._checkpoint_step, step)
            self._handed_off_epoch = max(self._handed_off_epoch, epoch)
            self.history.append({"event": "hand_off", "time": time.time(), "step": step, "why": why})
            self._cond.notify_all()

    def parked(self, step: int, pid: int) -> None:
        with self._cond:
            self.history.append({"event": "park", "time": time.time(), "step": step, "pid": pid})
            self._signals.paused()

    def unparked(self, step: int, pid: int) -> None:
        with self._cond:
            self.history.append({"event": "resume", "time": time.time(), "step": step, "pid": pid})
            self._signals.paused()

    def workers_done(self, step: int) -> None:
        """Rank 0 left its loop at ``step`` (the job is not over until its driver says so)."""
        with self._cond:
            self.history.append({"event": "workers_done", "time": time.time(), "step": step})

    def finished(self) -> None:
        """The driver's word, once fit() returned: the controller takes the job's loans back."""
        with self._cond:
            self._finished = True
            self.history.append({"event": "finish", "time": time.time(), "step": self._step})

    # -------- from the controller and the driver

    def resize_coming(self, timeout_s: float = 5.0) -> bool:
        """A loan node for this job is up. If the job is training, ask its workers to hand their
        state off at the end of the current step and wait (so a resize redoes no step), then
        make Ray Train look at the cluster now. True when the hand-off came in time."""
        with self._cond:
            # Not once a stop is asked: a group waiting for a resize that may never come (the loan node
            # adds nothing Ray Train can use) would not reach the stop step until its wait ran out.
            training = self._world_size > 0 and time.time() - self._step_at < 2.0 and not self._finished \
                and self._stop_at is None
            handed = False
            if training:
                self._pause_epoch += 1
                epoch = self._pause_epoch
                self.history.append({"event": "pause", "time": time.time(), "epoch": epoch, "step": self._step})
                self._signals.paused()
                handed = self._cond.wait_for(lambda: self._handed_off_epoch >= epoch, timeout_s)
        poke_ray_train(f"nodeagent-job-{self.job}")
        return handed

    def stop(self, after_steps: int = 1) -> int:
        """Finish the job ``after_steps`` steps from the last one reported; returns that step."""
        with self._cond:
            self._stop_at = self._step + max(1, int(after_steps))
            return self._stop_at

    def stop_asked(self) -> bool:
        """Rank 0 of a group waiting for a resize: True once a stop is asked (stop waiting, train on to it)."""
        with self._cond:
            return self._stop_at is not None

    def progress(self) -> dict:
        with self._cond:
            return {"step": self._step, "world_size": self._world_size, "step_at": self._step_at,
                    "group_from": self._group_from, "checkpoint_step": self._checkpoint_step,
                    "finished": self._finished}

    def report(self) -> dict:
        with self._cond:
            return {"job": self.job, "step": self._step, "history": list(self.history)}


TrainingJob = ray.remote(num_cpus=0, max_concurrency=8)(JobTracker)


# ---------------------------------------------------------------- the controller


@dataclass(frozen=True)
class NodeSettings:
    name: str
    endpoint: str  # the daemon's cluster endpoint, tcp://HOST:PORT
    events: str  # its events endpoint
    server_key: str  # path of its server.key


@dataclass(frozen=True)
class ControllerSettings:
    nodes: tuple[NodeSettings, ...]
    client_key: str  # path of the controller's .key_secret
    state_dir: str  # records.jsonl: what it did, kept across its restarts
    timeout_ms: float = 1000.0
    core: dict = field(default_factory=dict)  # CoreConfig fields (policy: PolicyConfig fields)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Controller:
    """The placement layer as a Ray actor. Ray restarts it when it dies; the new one reads
    every node, loan node and job again and carries on (``records`` lists its starts)."""

    def __init__(self, settings: ControllerSettings) -> None:
        _log_to_stderr()
        self.settings = settings
        os.makedirs(settings.state_dir, exist_ok=True)
        self._records_path = os.path.join(settings.state_dir, "records.jsonl")
        self._records_lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._core: core_mod.ControllerCore | None = None
        self._error: str | None = None
        self._record({"kind": "controller_start", "pid": os.getpid()})
        self._thread = threading.Thread(target=self._run, name="nodeagent-controller", daemon=True)
        self._thread.start()

    def _record(self, rec: dict) -> None:
        rec = {"time": round(time.time(), 3), **rec}
        with self._records_lock, open(self._records_path, "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")

    def _run(self) -> None:
        s = self.settings
        try:
            # The loop's thread makes the ZeroMQ sockets and is the only one to use them.
            placement = PlacementClient({n.name: n.endpoint for n in s.nodes}, keys=ClientKeys.load(s.client_key),
                                        server_keys={n.name: load_server_public(n.server_key) for n in s.nodes},
                                        events={n.name: n.events for n in s.nodes}, timeout_ms=s.timeout_ms)
        except Exception as exc:
            self._error = f"cannot reach the nodes: {exc}"
            log.error("[controller] %s", self._error)
            self._ready.set()
            return
        config = dict(s.core)
        config["policy"] = pol.PolicyConfig(**config.get("policy", {}))
        core = core_mod.ControllerCore(placement, RayLoanNodes(), RayJobs(), config=core_mod.CoreConfig(**config),
                                       record=self._record)
        self._core = core
        with placement:
            try:
                core.refresh()
            except Exception as exc:  # a bug: say so in ready(), and let the loop read everything again
                log.exception("[controller] first read failed")
                self._error = f"first read failed: {exc}"
            self._ready.set()
            core.run(self._stop)

    def ready(self, timeout_s: float = 30.0) -> dict:
        """Once the first read of every node is done: the pid and any error."""
        self._ready.wait(timeout_s)
        return {"pid": os.getpid(), "ready": self._ready.is_set(), "error": self._error}

    @ray.method(max_task_retries=0)  # not again after a restart: it would take back more loans than asked
    def want_inference_devices(self, count: int, timeout_s: float = 30.0) -> list[tuple[str, int]]:
        """A serving layer scaling up: reclaim the ``count`` cheapest loans; returns (node, device) of each."""
        if self._core is None:
            raise RuntimeError(self._error or "the controller is not running yet")
        return self._core.request_inference_devices(count).result(timeout_s)

    def records(self) -> list[dict]:
        with self._records_lock:
            try:
                with open(self._records_path) as f:
                    return [json.loads(line) for line in f if line.strip()]
            except FileNotFoundError:
                return []

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
