"""Weighted fair share: do training sessions get the device in proportion to their weights?

Training clients (default weights 1, 1, 2) share device 0 for ``--seconds``.
Each holds the token back to back, doing real work units of about 1 ms
(SHA-256 over 64 KiB) and calling ``yield_point()`` after each, so it gives
the token up when the daemon asks (its quantum ended and others wait). All
clients connect first and start together at one instant, so start-up skew is
not measured.

Each client measures its own held time (grant observed to the yield point
that released, clipped to the window); measured_share is each one's part of
the total. Baseline: the asked share, weights normalised. The daemon's own
accounting (``gpu_time_s`` from its status, read before the sessions close) is
reported beside it as daemon_share. The project's goal: every client within
2 points of its asked share.
"""

from __future__ import annotations

import time

from bench import common
from client_lib import Client

_CONNECT_TIMEOUT_S = 30.0
_START_DELAY_S = 0.1  # every client is waiting on the start line when it comes


def _trainer(ctl: common.WorkerControl, endpoint: str, index: int, weight: float,
             seconds: float, rounds: int) -> None:
    client = Client(f"bench-fair-{index}", workload="training", weight=weight, device=0,
                    endpoint=endpoint)
    work = common.Work(rounds)
    try:
        start_ns = ctl.ready((client.session_id, client.slice_ms))
        common.sleep_until_ns(start_ns)
        result = common.train_until(client, work, (start_ns, start_ns + int(seconds * 1e9)))
        ctl.result(result)
    finally:
        client.close()  # waits for the bye's answer, so the session ends as a goodbye


def parse_weights(text: str) -> list[float]:
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise SystemExit(f"--weights: expected numbers separated by commas, got {text!r}") from None
    if len(weights) < 2 or any(not w > 0 for w in weights):
        raise SystemExit(f"--weights: need at least two positive weights, got {text!r}")
    return weights


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("fairness", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip())
    ap.add_argument("--seconds", type=common.positive_float, default=10.0,
                    help="length of the measured window (default: 10)")
    ap.add_argument("--weights", default="1,1,2", help="one training client per weight (default: 1,1,2)")
    ap.add_argument("--quantum-ms", type=common.positive_float, default=50.0,
                    help="training quantum for the daemon started here (default: 50); "
                         "an external daemon keeps its own")
    ap.add_argument("--unit-ms", type=common.positive_float, default=1.0,
                    help="length of one work unit between yield points (default: 1)")
    args = ap.parse_args(argv)
    weights = parse_weights(args.weights)

    wall0 = time.monotonic()
    work = common.Work.calibrated(args.unit_ms)
    daemon_args = ["--quantum-ms", f"training={args.quantum_ms:g}"]
    with common.daemon(daemon_args) as handle, common.Workers() as workers:
        for i, weight in enumerate(weights):
            workers.start(_trainer, handle.endpoint, i, weight, args.seconds, work.rounds)
        sessions = workers.wait_ready(_CONNECT_TIMEOUT_S)
        common.log(f"[fairness] {len(weights)} training clients connected, weights {weights}; "
                   f"running {args.seconds:g} s")
        workers.go(_START_DELAY_S)
        results = workers.results(args.seconds + _CONNECT_TIMEOUT_S)
        status = common.daemon_status(handle.endpoint)  # before the sessions close
    gpu_time = {s.id: s.gpu_time_s for d in status.devices if d.index == 0 for s in d.sessions}

    quantum_ms = sessions[0][1]
    if handle.kind == common.EXTERNAL and quantum_ms != args.quantum_ms:
        common.log(f"[fairness] the external daemon's training quantum is {quantum_ms:g} ms "
                   f"(not the {args.quantum_ms:g} ms asked for)")
    held = [r["held_ns"] for r in results]
    daemon_held = [gpu_time.get(sid, 0.0) for sid, _ in sessions]
    asked = [w / sum(weights) for w in weights]
    measured = [h / sum(held) for h in held]
    by_daemon = [t / sum(daemon_held) for t in daemon_held] if sum(daemon_held) else []
    error = max(abs(a - m) for a, m in zip(asked, measured)) * 100
    result = {
        "benchmark": "fairness",
        "backend": status.backend,
        "endpoint_kind": handle.kind,
        "sessions": len(weights),
        "weights": weights,
        "seconds": args.seconds,
        "quantum_ms": quantum_ms,
        "unit_ms": args.unit_ms,
        "samples": sum(r["grants"] for r in results),
        "asked_share": [round(a, 4) for a in asked],
        "measured_share": [round(m, 4) for m in measured],
        "daemon_share": [round(d, 4) for d in by_daemon],
        "max_error_points": round(error, 2),
        "daemon_max_error_points": (round(max(abs(a - d) for a, d in zip(asked, by_daemon)) * 100, 2)
                                    if by_daemon else None),
        "goal_met": error <= 2.0,
        "held_s": [round(h / 1e9, 3) for h in held],
        "grants": [r["grants"] for r in results],
        "units": [r["units"] for r in results],
        "utilization": round(sum(held) / 1e9 / args.seconds, 4),
    }
    common.log(f"[fairness] asked {result['asked_share']} measured {result['measured_share']} "
               f"daemon {result['daemon_share']}: max error {error:.2f} points (goal <= 2: "
               f"{'met' if result['goal_met'] else 'MISSED'}); token held {100 * result['utilization']:.1f}% "
               f"of the window; took {time.monotonic() - wall0:.1f} s")
    common.emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
