"""The controller's decisions: which FREE device goes to which training job, which loan
inference takes back, and what becomes of a loan after that.

Pure, like :mod:`sharing.scheduler`: no I/O, no clock, no Ray. The controller's core
(:mod:`nodeagent_ray.core`) builds a :class:`ClusterView` from every node's inventory,
the loan nodes that exist and the registered jobs, calls :func:`decide`, and carries
out what it returns. The view holds everything a decision depends on, so a
controller that restarts reads the same sources, builds the same view and decides
the same things: it keeps no state of its own that a restart could lose.

A loan is one device of one node lent to one job, together with its loan node (the
Ray node the job's worker runs on). Its status follows from the view::

    ACTIVE   the device is LENT to the job                 (the worker trains)
    PARKED   not lent any more, the job's sessions there    (reclaimed while it was the job's
             are suspended                                  last running worker: kept to resume)
    STALE    neither                                        (nothing left to keep: release it)
    DEAD     its node stopped answering                     (written off)

Rules, in the order :func:`decide` applies them:

1. A dead node's loans are written off; nothing else on other nodes changes.
2. An ACTIVE loan whose device has an inference session is reclaimed at once (the
   session joining is the demand). So are the cheapest ACTIVE loans when a serving
   layer asks for devices anywhere (``inference_wanted``), by :func:`reclaim_cost`:
   a loan whose job would stall last, then the fewest workers lost, then the least
   progress since the job's last checkpoint (Aryl's preemption cost).
   After the reclaim the loan is released (its loan node stopped: the job shrinks),
   or PARKED when it held the job's last running worker, so that the job resumes
   in-process from its parked state when the device is lent to it again.
3. A PARKED loan whose device is FREE again (no inference there) is resumed: lent
   to the same job and its sessions resumed. One parked for longer than
   ``park_max_s``, or whose job can be given another device now, is released.
   STALE loans, and loans of jobs that are gone, are released.
4. FREE devices with no inference session and no loan are lent, never a device in
   RUN, PROTECT or DRAINING, each to the job furthest below its ``max_workers``.
   A device LENT to a known job whose loan node is missing (a controller that died
   between the two halves of a lend) is lent again, which finishes the lend.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

__all__ = ["ClusterView", "Decision", "DeviceView", "JobView", "Lend", "LoanStatus", "LoanView", "NodeView",
           "PolicyConfig", "Reclaim", "ReclaimCost", "Release", "Resume", "SessionCount", "Then", "WriteOff",
           "choose_reclaims", "decide", "loan_status", "reclaim_cost"]

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
    round could not read which loan nodes run there (nothing is started or stopped there then)."""

    name: str
    alive: bool
    devices: tuple[DeviceView, ...] = ()
    loans_known: bool = True


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
    """A training job that wants lent devices: at most ``max_workers`` of them."""

    name: str
    max_workers: int
    steps_since_checkpoint: int = 0


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

    def __post_init__(self) -> None:
        if not (isinstance(self.park_max_s, (int, float)) and math.isfinite(self.park_max_s)
                and self.park_max_s >= 0):
            raise ValueError(f"park_max_s must be a finite number of seconds >= 0, got {self.park_max_s!r}")


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


Decision = Union[WriteOff, Reclaim, Release, Resume, Lend]


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


def choose_reclaims(view: ClusterView, count: int, exclude: frozenset[LoanKey] = frozenset()) -> list[LoanView]:
    """The ``count`` cheapest ACTIVE loans to take back for inference (ties: node, device)."""
    if count <= 0:
        return []
    active = [loan for loan in view.loans.values()
              if loan.key not in exclude and loan_status(view, loan) is LoanStatus.ACTIVE]
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


def decide(view: ClusterView, now: float, config: PolicyConfig = PolicyConfig()) -> list[Decision]:
    """What to do now, in the order to do it (see the module docstring for the rules)."""
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
    for loan in choose_reclaims(view, view.inference_wanted, frozenset(reclaimed)):
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

    # 4. Lends: finish half-done ones, then FREE devices to the jobs furthest below max_workers.
    held: dict[str, int] = {name: kept_parked.get(name, 0) for name in view.jobs}
    for d in out:
        if isinstance(d, Resume):
            held[d.job] = held.get(d.job, 0) + 1
    for loan in view.loans.values():
        if loan.job in held and loan.key not in reclaimed and loan_status(view, loan) is LoanStatus.ACTIVE:
            held[loan.job] += 1
    for name in sorted(view.nodes):
        node = view.nodes[name]
        if not (node.alive and node.loans_known):
            continue
        for d in node.devices:
            if d.state == "LENT" and d.borrower in view.jobs and d.key not in view.loans \
                    and d.inference_sessions == 0:
                out.append(Lend(d.node, d.index, d.borrower, "lent without a loan node"))
                held[d.borrower] += 1
    for device in candidates:
        wanting = [(view.jobs[name].max_workers - held[name], name) for name in sorted(view.jobs)
                   if view.jobs[name].max_workers - held[name] > 0]
        if not wanting:
            break
        _, job = min(wanting, key=lambda w: (-w[0], w[1]))
        out.append(Lend(device.node, device.index, job))
        held[job] += 1
    return out
