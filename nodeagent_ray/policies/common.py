"""From a policy's target (how many devices each job should hold) to decisions: the loans a
job holds beyond its target are taken back (released: the job hands its state off and
shrinks or stops), free devices go to jobs below theirs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from nodeagent_ray.policy import Decision, Lend, Reclaim, Round, Then


def running(r: Round, job: str) -> int:
    """Devices the job trains on now (its ACTIVE loans left by rules 1-4; a parked loan is not one)."""
    return len(r.active.get(job, ()))


def capacity(r: Round) -> int:
    """Devices training may hold after this round: the free ones and those training holds."""
    return len(r.candidates) + sum(len(loans) for loans in r.active.values())


def dedicated_capacity(r: Round) -> int:
    """The part of :func:`capacity` on dedicated nodes (no inference takes it back)."""
    return (sum(1 for d in r.candidates if r.dedicated(d.node))
            + sum(1 for loans in r.active.values() for loan in loans if r.dedicated(loan.node)))


def realise(r: Round, targets: Mapping[str, int], order: Iterable[str], *, take_reason: str, give_reason: str,
            dedicated_first: Callable[[str], bool] = lambda job: True,
            lease_s: Mapping[str, float] | None = None) -> list[Decision]:
    """Reclaims of loans beyond each job's target (loans on dedicated nodes first: they are free
    again at once, where a reclaimed inference device waits out its protect window), then Lends
    of free devices to the jobs below target, in ``order``; each job takes a device on a
    dedicated node first or last as ``dedicated_first`` says."""
    out: list[Decision] = []
    for job in sorted(r.jobs):
        excess = running(r, job) - targets.get(job, 0)
        if excess <= 0:
            continue
        loans = sorted(r.active[job], key=lambda loan: (not r.dedicated(loan.node), loan.node, loan.device))
        out += [Reclaim(loan.node, loan.device, job, Then.RELEASE, take_reason) for loan in loans[:excess]]
    free = list(r.candidates)
    for job in order:
        want = targets.get(job, 0) - r.held.get(job, 0)
        while want > 0 and free:
            prefer = dedicated_first(job)
            device = next((d for d in free if r.dedicated(d.node) == prefer), free[0])
            free.remove(device)
            out.append(Lend(device.node, device.index, job, give_reason, (lease_s or {}).get(job)))
            want -= 1
    return out
