"""Preemption: how long an inference request waits for a device a trainer is using.

A training client holds device 0 back to back (real work units of about 1 ms,
``yield_point()`` after each). An inference client, every ``--period-ms``,
does ``with client.slice(): <small real work>`` and records its wait, from
calling acquire to observing the grant. The daemon asks the trainer to yield
at once (inference outranks training); the trainer gives the token up at its
next yield point and gets it back when the inference slice ends.

Baselines, same run: the same inference requests while the trainer has not
started yet (the token is free: the floor of a request's wait), and the
training slice length, the bound the project sets for the wait
(goal: inference wait p99 <= one training slice).
"""

from __future__ import annotations

import time

from bench import common
from client_lib import Client

_CONNECT_TIMEOUT_S = 30.0
_START_DELAY_S = 0.1
_IDLE_PHASE_S = 0.5  # inference alone, spaced _IDLE_PERIOD_S apart: the free-token baseline
_IDLE_PERIOD_S = 0.005
_SETTLE_S = 0.2  # the trainer gets going before requests are measured


def _inference(ctl: common.WorkerControl, endpoint: str, seconds: float, period_ms: float,
               rounds: int) -> None:
    client = Client("bench-preempt-inference", workload="inference", device=0, endpoint=endpoint)
    work = common.Work(rounds)
    try:
        start = ctl.ready(client.slice_ms)
        trainer_start = start + int(_IDLE_PHASE_S * 1e9)
        idle = common.timed_requests(client, work, start, int(_IDLE_PERIOD_S * 1e9), trainer_start).waits_ns
        contended = common.timed_requests(client, work, trainer_start + int(_SETTLE_S * 1e9), int(period_ms * 1e6),
                                          trainer_start + int(seconds * 1e9)).waits_ns
        ctl.result({"idle_waits_ns": idle, "waits_ns": contended})
    finally:
        client.close()


def _trainer(ctl: common.WorkerControl, endpoint: str, seconds: float, rounds: int) -> None:
    client = Client("bench-preempt-trainer", workload="training", device=0, endpoint=endpoint)
    work = common.Work(rounds)
    try:
        start = ctl.ready((client.slice_ms, client.welcome.grace_ms))
        trainer_start = start + int(_IDLE_PHASE_S * 1e9)
        common.sleep_until_ns(trainer_start)
        ctl.result(common.train_until(client, work, (trainer_start, trainer_start + int(seconds * 1e9))))
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("preempt", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip())
    ap.add_argument("--seconds", type=common.positive_float, default=10.0,
                    help="how long the trainer runs (default: 10)")
    ap.add_argument("--period-ms", type=common.positive_float, default=50.0,
                    help="time between inference requests (default: 50)")
    ap.add_argument("--unit-ms", type=common.positive_float, default=1.0,
                    help="trainer's work between yield points (default: 1)")
    ap.add_argument("--request-ms", type=common.positive_float, default=0.5,
                    help="work an inference request does while holding the token (default: 0.5)")
    args = ap.parse_args(argv)

    wall0 = time.monotonic()
    train_work = common.Work.calibrated(args.unit_ms)
    request_rounds = max(1, round(train_work.rounds * args.request_ms / args.unit_ms))
    with common.daemon() as handle, common.Workers() as workers:
        workers.start(_trainer, handle.endpoint, args.seconds, train_work.rounds)
        workers.start(_inference, handle.endpoint, args.seconds, args.period_ms, request_rounds)
        (slice_ms, grace_ms), _ = workers.wait_ready(_CONNECT_TIMEOUT_S)
        common.log(f"[preempt] trainer and inference client connected; inference alone for "
                   f"{_IDLE_PHASE_S:g} s, then with the trainer for {args.seconds:g} s")
        workers.go(_START_DELAY_S)
        trained, served = workers.results(_IDLE_PHASE_S + args.seconds + _CONNECT_TIMEOUT_S)
        backend = common.daemon_status(handle.endpoint).backend

    ms = 1e-6
    waits, idle = served["waits_ns"], served["idle_waits_ns"]
    p50, p99 = common.percentile(waits, 50) * ms, common.percentile(waits, 99) * ms
    result = {
        "benchmark": "preempt",
        "backend": backend,
        "endpoint_kind": handle.kind,
        "sessions": 2,
        "seconds": args.seconds,
        "period_ms": args.period_ms,
        "unit_ms": args.unit_ms,
        "request_ms": args.request_ms,
        "samples": len(waits),
        "requests": len(waits),
        "inference_wait_p50_ms": common.rounded(p50),
        "inference_wait_p99_ms": common.rounded(p99),
        "inference_wait_max_ms": common.rounded(max(waits) * ms),
        "idle_wait_p50_ms": common.rounded(common.percentile(idle, 50) * ms),
        "idle_requests": len(idle),
        "training_slice_ms": slice_ms,
        "wait_p99_over_slice": common.rounded(p99 / slice_ms, 4),
        "goal_met": p99 <= slice_ms,
        "grace_ms": grace_ms,
        "training_units": trained["units"],
        "training_grants": trained["grants"],
        "training_held_share": common.rounded(trained["held_ns"] / (args.seconds * 1e9)),
    }
    common.log(f"[preempt] inference wait p50 {p50:.3f} ms p99 {p99:.3f} ms max {result['inference_wait_max_ms']} ms "
               f"over {len(waits)} requests (free token: p50 {result['idle_wait_p50_ms']} ms); training slice "
               f"{slice_ms:g} ms (goal p99 <= slice: {'met' if result['goal_met'] else 'MISSED'}); trainer did "
               f"{trained['units']} units in {trained['grants']} grants; took {time.monotonic() - wall0:.1f} s")
    common.emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
