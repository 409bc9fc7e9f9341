"""The controller's decisions, pure (no I/O, no clock, no Ray): which FREE device goes to
which training job, which loan inference takes back, and what becomes of a loan after that.

:func:`decide` maps a :class:`ClusterView` to actions; rules 1-4 (:func:`run_policy`) are shared,
rule 5 is an :class:`Allocator`'s. The loan states and the rules in order: docs/internals.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

__all__ = ["Allocator", "ClusterView", "Decision", "DeviceView", "JobView", "Lend", "LoanStatus", "LoanView",
           "MaxWorkers", "NodeView", "PolicyConfig", "Reclaim", "ReclaimCost", "Release", "Renew", "Resume", "Round",
           "SessionCount", "Then", "WriteOff", "choose_reclaims", "decide", "loan_status", "reclaim_cost",
           "run_policy"]

LoanKey = tuple[str, int]  # (node, device index)

INFERENCE_STATES = ("RUN", "PROTECT")


@dataclass(frozen=True)
class SessionCount:
    """A job's sessions on one device: training now, and suspended (parked)."""

    running: int = 0
    suspended: int = 0


@dataclass(frozen=True)
class DeviceView:
    """One device as the node's last inventory showed it."""

    node: str
    index: int
    state: str  # FREE | RUN | PROTECT | LENT | DRAINING
    borrower: str | None = None
    inference_sessions: int = 0
    training: Mapping[str, SessionCount] = field(default_factory=dict)  # by borrower
    uuid: str = ""

    @property
    def key(self) -> LoanKey:
        return (self.node, self.index)

    def sessions_of(self, job: str) -> SessionCount:
        return self.training.get(job, SessionCount())


@dataclass(frozen=True)
class NodeView:
    """A node: ``alive`` False once it is declared dead; ``loans_known`` False when this
    round could not read which loan nodes run there (nothing is started or stopped there then).
    ``dedicated``: a training node, where no inference is placed, so its loans are never
    taken for inference (the controller's ``dedicated_nodes``)."""

    name: str
    alive: bool
    devices: tuple[DeviceView, ...] = ()
    loans_known: bool = True
    dedicated: bool = False


@dataclass(frozen=True)
class LoanView:
    """A loan node that exists: ``job``'s worker node for ``device`` of ``node``, since ``since``."""

    node: str
    device: int
    job: str
    since: float = 0.0

    @property
    def key(self) -> LoanKey:
        return (self.node, self.device)


@dataclass(frozen=True)
class JobView:
    """A training job that wants lent devices: at most ``max_workers`` of them.

    The fields after ``steps_since_checkpoint`` are the per-job signals the policies of
    :mod:`nodeagent_ray.policies` read (``max-workers`` reads none); their defaults say
    "not known". Times are unix seconds, on the clock of ``decide``'s ``now``.
    """

    name: str
    max_workers: int
    steps_since_checkpoint: int = 0
    submitted_at: float | None = None  # when the job was created
    attained_gpu_s: float = 0.0  # GPU-seconds held so far, over all its sessions and restarts (Tiresias)
    steps_per_s: Mapping[int, float] = field(default_factory=dict)  # measured, by worker count
    steps_done: int = 0
    expected_steps: int | None = None  # the job's whole length, as it said at creation
    deadline: float | None = None  # set: an SLO job (Chronus); None: best effort
    lease_expires: float | None = None  # the SLO lease it holds, if any
    last_resize_at: float | None = None  # when its worker count last changed (start, grow, shrink, stop)


@dataclass(frozen=True)
class ClusterView:
    """Everything :func:`decide` looks at. ``jobs`` None: the jobs could not be read this
    round, so nothing is lent and no loan is released for its job being gone."""

    nodes: Mapping[str, NodeView]
    loans: Mapping[LoanKey, LoanView]
    jobs: Mapping[str, JobView] | None
    inference_wanted: int = 0

    def device(self, key: LoanKey) -> DeviceView | None:
        node = self.nodes.get(key[0])
        if node is None:
            return None
        return next((d for d in node.devices if d.index == key[1]), None)


@dataclass(frozen=True)
class PolicyConfig:
    park_max_s: float = 120.0  # how long a parked loan waits for its device before it is released
    name: str = "max-workers"  # which policy decides who gets free devices (nodeagent_ray.policies)
    options: Mapping[str, Any] = field(default_factory=dict)  # that policy's settings, by field name

    def __post_init__(self) -> None:
        if not (isinstance(self.park_max_s, (int, float)) and math.isfinite(self.park_max_s)
                and self.park_max_s >= 0):
            raise ValueError(f"park_max_s must be a finite number of seconds >= 0, got {self.park_max_s!r}")
        if self.name != MaxWorkers.name or self.options:
            from nodeagent_ray.policies import make_policy  # checks the name and the options, raising ValueError
            make_policy(self.name, self.options)


class LoanStatus(str, enum.Enum):
    ACTIVE = "active"
    PARKED = "parked"
    STALE = "stale"
    DEAD = "dead"


class Then(str, enum.Enum):
    """What becomes of a loan once its device is reclaimed."""

    RELEASE = "release"  # stop its loan node: the job loses the worker there (its state handed off)
    PARK = "park"  # keep it: the job's last worker waits, parked, to resume in-process


@dataclass(frozen=True)
class WriteOff:
    node: str
    loans: tuple[tuple[int, str], ...]  # (device, job)


@dataclass(frozen=True)
class Reclaim:
    node: str
    device: int
    job: str
    then: Then
    reason: str


@dataclass(frozen=True)
class Release:
    node: str
    device: int
    job: str
    reason: str


@dataclass(frozen=True)
class Resume:
    node: str
    device: int
    job: str


@dataclass(frozen=True)
class Lend:
    node: str
    device: int
    job: str
    reason: str = "free device"
    lease_s: float | None = None  # an SLO job's lease on the device (the deadline policy)


@dataclass(frozen=True)
class Renew:
    """Extend ``job``'s lease on a device it holds by ``lease_s`` from now (the deadline policy)."""

    node: str
    device: int
    job: str
    lease_s: float


Decision = Union[WriteOff, Reclaim, Release, Resume, Lend, Renew]


@dataclass(frozen=True, order=True)
class ReclaimCost:
    """Lower is cheaper. Compared in field order."""

    stalls_job: bool  # the job's last running worker: the whole job stops
    workers_lost: int  # the job's running sessions on the device
    steps_since_checkpoint: int  # what the job redoes if its workers there cannot hand off


def loan_status(view: ClusterView, loan: LoanView) -> LoanStatus:
    node = view.nodes.get(loan.node)
    if node is None or not node.alive:
        return LoanStatus.DEAD
    device = view.device(loan.key)
    if device is None:
        return LoanStatus.STALE
    if device.state == "LENT" and device.borrower == loan.job:
        return LoanStatus.ACTIVE
    if device.sessions_of(loan.job).suspended > 0:
        return LoanStatus.PARKED
    return LoanStatus.STALE


def _active_loans_of(view: ClusterView, job: str) -> list[LoanView]:
    return [loan for loan in view.loans.values()
            if loan.job == job and loan_status(view, loan) is LoanStatus.ACTIVE]


def reclaim_cost(view: ClusterView, loan: LoanView) -> ReclaimCost:
    device = view.device(loan.key)
    running = device.sessions_of(loan.job).running if device is not None else 0
    others = [other for other in _active_loans_of(view, loan.job) if other.key != loan.key]
    job = (view.jobs or {}).get(loan.job)
    return ReclaimCost(stalls_job=not others, workers_lost=running,
                       steps_since_checkpoint=job.steps_since_checkpoint if job is not None else 0)


def inference_may_take(view: ClusterView, loan: LoanView, exclude: frozenset[LoanKey] = frozenset()) -> bool:
    """An ACTIVE loan, not excluded, on a node where inference runs (not a dedicated training node)."""
    node = view.nodes.get(loan.node)
    return (loan.key not in exclude and node is not None and not node.dedicated
            and loan_status(view, loan) is LoanStatus.ACTIVE)


def choose_reclaims(view: ClusterView, count: int, exclude: frozenset[LoanKey] = frozenset()) -> list[LoanView]:
    """The ``count`` cheapest ACTIVE loans to take back for inference (ties: node, device)."""
    if count <= 0:
        return []
    active = [loan for loan in view.loans.values() if inference_may_take(view, loan, exclude)]
    active.sort(key=lambda loan: (reclaim_cost(view, loan), loan.node, loan.device))
    return active[:count]


def _then(view: ClusterView, loan: LoanView, reclaimed: set[LoanKey]) -> Then:
    """Park only the job's last running worker: with others still training, the job shrinks
    (a data-parallel group cannot wait for one parked member)."""
    device = view.device(loan.key)
    running_here = device is not None and device.sessions_of(loan.job).running > 0
    others = [other for other in _active_loans_of(view, loan.job)
              if other.key != loan.key and other.key not in reclaimed]
    return Then.PARK if running_here and not others else Then.RELEASE


def _lendable(view: ClusterView, device: DeviceView) -> bool:
    return device.state == "FREE" and device.inference_sessions == 0 and device.key not in view.loans


@dataclass(frozen=True)
class Round:
    """What rules 1-4 left for an :class:`Allocator` to hand out, in one call of :func:`decide`."""

    view: ClusterView
    now: float
    config: PolicyConfig
    jobs: Mapping[str, JobView]
    candidates: tuple[DeviceView, ...]  # FREE, no inference, no loan: lendable now (sorted by node, device)
    held: Mapping[str, int]  # devices each job keeps after rules 1-4: ACTIVE loans, resumed and kept parked
    active: Mapping[str, tuple[LoanView, ...]]  # each job's ACTIVE loans that were not reclaimed this round
    reclaimed: frozenset[LoanKey]  # loans rules 1-4 reclaim this round

    def dedicated(self, node: str) -> bool:
        found = self.view.nodes.get(node)
        return found is not None and found.dedicated


class Allocator(Protocol):
    """Rule 5, which is what tells policies apart: who gets the free devices, which loans one
    training job gives up for another, and which loans inference takes first."""

    name: str

    def inference_victims(self, view: ClusterView, count: int, exclude: frozenset[LoanKey],
                          now: float) -> list[LoanView]:
        """The ``count`` loans a serving layer's demand takes, cheapest first (only loans
        ``inference_may_take``)."""

    def allocate(self, r: Round) -> list[Decision]:
        """Lends of ``r.candidates``, and Reclaims (RELEASE) of loans another job should have."""


@dataclass(frozen=True)
class MaxWorkers:
    """Today's rule: each free device to the job furthest below its ``max_workers`` (ties by
    name); a loan is taken back only for inference, the cheapest by :func:`reclaim_cost`."""

    name = "max-workers"

    def inference_victims(self, view: ClusterView, count: int, exclude: frozenset[LoanKey],
                          now: float) -> list[LoanView]:
        return choose_reclaims(view, count, exclude)

    def allocate(self, r: Round) -> list[Decision]:
        out: list[Decision] = []
        held = dict(r.held)
        for device in r.candidates:
            wanting = [(r.jobs[name].max_workers - held[name], name) for name in sorted(r.jobs)
                       if r.jobs[name].max_workers - held[name] > 0]
            if not wanting:
                break
            _, job = min(wanting, key=lambda w: (-w[0], w[1]))
            out.append(Lend(device.node, device.index, job))
            held[job] += 1
        return out


def decide(view: ClusterView, now: float, config: PolicyConfig = PolicyConfig()) -> list[Decision]:
    """What to do now, in the order to do it (see docs/internals.md for the rules), by the
    policy ``config.name`` names."""
    if config.name == MaxWorkers.name and not config.options:
        return run_policy(MaxWorkers(), view, now, config)
    from nodeagent_ray.policies import make_policy
    return run_policy(make_policy(config.name, config.options), view, now, config)


def run_policy(allocator: Allocator, view: ClusterView, now: float, config: PolicyConfig) -> list[Decision]:
    """Rules 1-4, then ``allocator``'s rule 5."""
    out: list[Decision] = []

    # 1. Dead nodes: write their loans off.
    dead: dict[str, list[LoanView]] = {}
    for loan in view.loans.values():
        if loan_status(view, loan) is LoanStatus.DEAD:
            dead.setdefault(loan.node, []).append(loan)
    for node in sorted(dead):
        out.append(WriteOff(node, tuple(sorted((loan.device, loan.job) for loan in dead[node]))))

    # 2. Reclaims: inference on a lent device, then a serving layer's demand by cost.
    reclaimed: set[LoanKey] = set()
    for loan in sorted(view.loans.values(), key=lambda loan: loan.key):
        device = view.device(loan.key)
        if loan_status(view, loan) is LoanStatus.ACTIVE and device is not None and device.inference_sessions:
            out.append(Reclaim(loan.node, loan.device, loan.job, _then(view, loan, reclaimed), "inference session"))
            reclaimed.add(loan.key)
    if view.inference_wanted > 0:
        for loan in allocator.inference_victims(view, view.inference_wanted, frozenset(reclaimed), now):
            if not inference_may_take(view, loan, frozenset(reclaimed)):
                continue  # an allocator's mistake must not take a dedicated node's loan or one twice
            out.append(Reclaim(loan.node, loan.device, loan.job, _then(view, loan, reclaimed), "inference demand"))
            reclaimed.add(loan.key)
    for name in sorted(view.nodes):  # half-done lends (no loan node) that inference wants
        node = view.nodes[name]
        for d in node.devices if node.alive else ():
            if d.state == "LENT" and d.inference_sessions and d.key not in view.loans and d.borrower is not None \
                    and view.jobs is not None and d.borrower in view.jobs:
                out.append(Reclaim(d.node, d.index, d.borrower, Then.RELEASE, "inference session"))
                reclaimed.add(d.key)
    if view.jobs is not None:
        for loan in sorted(view.loans.values(), key=lambda loan: loan.key):
            if loan.job not in view.jobs and loan.key not in reclaimed \
                    and loan_status(view, loan) is LoanStatus.ACTIVE:
                out.append(Reclaim(loan.node, loan.device, loan.job, Then.RELEASE, "job gone"))
                reclaimed.add(loan.key)

    # Devices free to lend this round (a parked loan's own device is resumed, not lent).
    candidates = [d for name in sorted(view.nodes) for d in view.nodes[name].devices
                  if view.nodes[name].alive and view.nodes[name].loans_known and _lendable(view, d)]

    # 3. Parked and stale loans.
    kept_parked: dict[str, int] = {}
    for loan in sorted(view.loans.values(), key=lambda loan: loan.key):
        status = loan_status(view, loan)
        if loan.key in reclaimed or status in (LoanStatus.ACTIVE, LoanStatus.DEAD):
            continue
        if not view.nodes[loan.node].loans_known:
            continue
        gone = view.jobs is not None and loan.job not in view.jobs
        if status is LoanStatus.STALE or gone:
            out.append(Release(loan.node, loan.device, loan.job, "job gone" if gone else "device not lent"))
            continue
        device = view.device(loan.key)
        if device is not None and device.state == "FREE" and device.inference_sessions == 0 \
                and view.jobs is not None:
            out.append(Resume(loan.node, loan.device, loan.job))
        elif now - loan.since > config.park_max_s:
            out.append(Release(loan.node, loan.device, loan.job, f"parked longer than {config.park_max_s:g}s"))
        elif candidates and view.jobs is not None:
            out.append(Release(loan.node, loan.device, loan.job, "another device is free"))
        else:
            kept_parked[loan.job] = kept_parked.get(loan.job, 0) + 1

    if view.jobs is None:
        return out

    # 4. Finish half-done lends.
    held: dict[str, int] = {name: kept_parked.get(name, 0) for name in view.jobs}
    for d in out:
        if isinstance(d, Resume):
            held[d.job] = held.get(d.job, 0) + 1
    active: dict[str, list[LoanView]] = {name: [] for name in view.jobs}
    for loan in sorted(view.loans.values(), key=lambda loan: loan.key):
        if loan.job in held and loan.key not in reclaimed and loan_status(view, loan) is LoanStatus.ACTIVE:
            held[loan.job] += 1
            active[loan.job].append(loan)
    for name in sorted(view.nodes):
        node = view.nodes[name]
        if not (node.alive and node.loans_known):
            continue
        for d in node.devices:
            if d.state == "LENT" and d.borrower in view.jobs and d.key not in view.loans \
                    and d.inference_sessions == 0:
                out.append(Lend(d.node, d.index, d.borrower, "lent without a loan node"))
                held[d.borrower] += 1

    # 5. The policy's own rule.
    out += allocator.allocate(Round(view=view, now=now, config=config, jobs=view.jobs, candidates=tuple(candidates),
                                    held=held, active={k: tuple(v) for k, v in active.items()},
                                    reclaimed=frozenset(reclaimed)))
    return out
