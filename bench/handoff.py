"""Token handoff latency through the real daemon, against a pipe ping-pong in the same rounds.

Handoff: the time from holder A sending the release of grant g to the next
holder B observing grant g+1. ``--sessions`` client processes (one session
each, all on device 0) loop acquire -> release -> acquire as fast as they can,
so the queue is never empty and every release hands the token on. Each
worker records (grant id, grant observed, release called: stamped just
before ``release()``, so client_lib's own cost counts); grant ids rise by one
per grant on a device, so the parent pairs the release of g with the
observation of g+1 after the run. The sessions hand off in ``--rounds``
rounds after a warm-up round; in each round the first and the last
``sessions`` grants (everyone arriving, the queue draining) are discarded.

Baselines, same run, same machine (see bench/baselines.py), interleaved with
the handoff round by round (pipe, handoff, relay, pipe, ...; while one runs,
the others sleep):

* pipe ping-pong: two processes bounce one byte over two pipes with blocking
  reads, the floor of "a message to another process and one back". On a VM
  the floor moves with the CPUs' idle states (about 5 to 25 us here), so each
  round's handoff p50 is divided by the p50 of the pipe blocks just before
  and just after it, and ``ratio_pipe_p50`` is the median of those per-round
  ratios;
* relay: a broker passes a token around as many processes as sessions over
  unix stream sockets with the daemon's framing and codec, no scheduler: the
  transport floor of a two-hop design (release to the daemon, grant to the
  next holder);
* zmq ping-pong: a raw pyzmq ROUTER<->DEALER round trip over ipc (the local
  transport the daemon used before), in blocks before and after the rounds:
  ``baseline_rtt_p50_us`` and ``ratio_p50``, kept for comparison with older
  results.

``--sessions`` takes a list (default ``2,64``): each count is measured in
turn against the same daemon; the top-level keys are those of the last count,
and ``by_sessions`` holds every count's. Goals: ``ratio_pipe_p50`` <= 2.5 at
every count, and p99 < 1 ms at the largest (``goals`` lists each with its
measured value).

With --work-device cuda every session is a CUDA process that, while it holds
the token, runs a 1024x1024 matmul on the GPU and waits for it before its
release: the handoff among processes that each hold a CUDA context and use
the GPU (the work itself is not part of a handoff's time).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

from bench import baselines, common
from client_lib import Client

_WORKER_TIMEOUT_S = 45.0
GOAL_RATIO_PIPE_P50 = 2.5
GOAL_P99_US = 1000.0


def _gpu_work(work_device: str):
    """While holding: one matmul on the GPU, waited for (None: no work). In the forked child only."""
    if work_device != "cuda":
        return None
    import torch

    x = torch.randn(1024, 1024, device="cuda")

    def work() -> None:
        torch.mm(x, x)
        torch.cuda.synchronize()

    work()  # the context and the kernel exist before the start
    return work


def _hold(hold_us: float):
    """Work while holding the token: spin for ``hold_us`` (None: none)."""
    if hold_us <= 0:
        return None
    hold_ns = int(hold_us * 1000)

    def work() -> None:
        end = time.monotonic_ns() + hold_ns
        while time.monotonic_ns() < end:
            pass
    return work


def _contender(ctl: common.WorkerControl, endpoint: str, index: int, plan: list[int], gate: common.RoundGate,
               work_device: str = "none", hold_us: float = 0.0) -> None:
    """One session: in each round, take the token, give it straight back, ask again; ``plan[r]`` times."""
    work = _gpu_work(work_device) or _hold(hold_us)
    client = Client(f"bench-handoff-{index}", workload="training", device=0, endpoint=endpoint)
    now = time.monotonic_ns
    # (round, grant id, grant observed, release call started, release call returned)
    records = []
    ctl.ready(client.session_id)
    try:
        for round_index, loops in enumerate(plan):
            gate.enter()
            for _ in range(loops):
                grant = client.acquire()
                t_grant = now()
                if work is not None:
                    work()
                # Stamped before the call: a stamp after it could land after the next
                # holder already saw its grant when this process is descheduled.
                t_release = now()
                client.release()
                records.append((round_index, grant, t_grant, t_release, now()))
            gate.leave()
        ctl.result(records)
    finally:
        client.close()  # waits for the bye's answer, so the session ends as a goodbye


class Contenders:
    """``sessions`` forked processes contending for device 0 in rounds (see
    :func:`_contender`); ``plan[r]``: grants each takes in round ``r``."""

    def __init__(self, endpoint: str, sessions: int, plan: list[int], work_device: str = "none",
                 hold_us: float = 0.0) -> None:
        self.sessions = sessions
        self.plan = list(plan)
        self._gate = common.RoundGate(sessions)
        self._workers = common.Workers()
        self._args = (endpoint, plan, work_device, hold_us)
        self.session_ids: list[str] = []

    def __enter__(self) -> "Contenders":
        endpoint, plan, work_device, hold_us = self._args
        for i in range(self.sessions):
            self._workers.start(_contender, endpoint, i, plan, self._gate, work_device, hold_us)
        self.session_ids = self._workers.wait_ready(_WORKER_TIMEOUT_S)
        self._workers.go()
        return self

    def run_round(self) -> tuple[int, int]:
        return self._gate.run_round()

    def records(self) -> list[tuple[int, int, int, int, int]]:
        return [r for worker in self._workers.results(_WORKER_TIMEOUT_S) for r in worker]

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self._gate.abort()
        self._workers.__exit__(*exc)


def pair_handoffs(records, edge: int) -> tuple[dict[int, list[int]], int]:
    """Handoff times (ns) per round: the release of grant g paired with the observation
    of g+1 in the same round, the first and last ``edge`` grants of each round left
    out; and how many kept releases had no observed successor (another client's grant).

    ``records``: (round, grant, observed, release started, release returned)."""
    by_round: dict[int, dict[int, tuple]] = {}
    for r in records:
        by_round.setdefault(r[0], {})[r[1]] = r
    handoffs: dict[int, list[int]] = {}
    unpaired = 0
    for round_index, by_grant in sorted(by_round.items()):
        grants = sorted(by_grant)
        kept = grants[edge:len(grants) - edge]
        out = handoffs.setdefault(round_index, [])
        for g in kept:
            nxt = by_grant.get(g + 1)
            if nxt is None:
                unpaired += 1
                continue
            out.append(nxt[2] - by_grant[g][3])
    return handoffs, unpaired


def plan(sessions: int, handoffs: int, rounds: int) -> list[int]:
    """Grants each session takes per round: round 0 is the warm-up (at least
    ``max(2 * sessions, 200)`` grants), then ``rounds`` rounds that together give
    ``handoffs`` measured handoffs once each round's edges are left out."""
    warmup = max(2 * sessions, 200)
    per_round = math.ceil(handoffs / rounds)
    return [math.ceil(warmup / sessions)] + [math.ceil((per_round + 2 * sessions + 1) / sessions)] * rounds


def interleaved(endpoint: str, sessions: int, handoffs: int, rounds: int, pipe: baselines.PipePingPong,
                pipe_round_trips: int, relay: bool = True, work_device: str = "none",
                hold_us: float = 0.0) -> dict:
    """The handoff, the pipe floor and (``relay``) the unix relay, round by round:
    per measured round the handoffs, the relay's passes, and the pipe samples taken
    in the block before and the block after the round's handoffs."""
    grants = plan(sessions, handoffs, rounds)
    pipe_blocks: list[list[int]] = []
    windows = []
    t0 = time.monotonic()
    relay_cm = baselines.UnixRelay(sessions, grants) if relay else None
    with Contenders(endpoint, sessions, grants, work_device, hold_us) as contenders:
        if relay_cm is not None:
            relay_cm.__enter__()
        try:
            startup_s = time.monotonic() - t0
            common.log(f"[handoff] {sessions} sessions connected in {startup_s:.1f} s; {rounds} rounds of "
                       f"{grants[1]} grants each after a warm-up of {grants[0]}")
            for round_index in range(len(grants)):
                pipe_blocks.append(pipe.block(pipe_round_trips))
                windows.append(contenders.run_round())
                if relay_cm is not None:
                    relay_cm.run_round()
            pipe_blocks.append(pipe.block(pipe_round_trips))
            records = contenders.records()
            relay_records = relay_cm.records() if relay_cm is not None else []
        except BaseException as exc:
            if relay_cm is not None:
                relay_cm.__exit__(type(exc), exc, exc.__traceback__)
                relay_cm = None
            raise
        finally:
            if relay_cm is not None:
                relay_cm.__exit__(None, None, None)
    per_round, unpaired = pair_handoffs(records, sessions)
    relay_per_round, _ = pair_handoffs(relay_records, sessions)
    measured = range(1, len(grants))  # round 0: warm-up
    return {
        "handoffs": [per_round.get(r, []) for r in measured],
        "pipe": [pipe_blocks[r] + pipe_blocks[r + 1] for r in measured],
        "relay": [relay_per_round.get(r, []) for r in measured],
        "unpaired": unpaired,
        "grants": sum(1 for r in records if r[0] > 0),
        "run_s": sum(end - start for start, end in windows[1:]) / 1e9,
        "release_call": [r[4] - r[3] for r in records if r[0] > 0],
        "startup_s": startup_s,
        "warmup": grants[0] * sessions,
    }


def paired_ratio(numerators: list[list[int]], denominators: list[list[int]]) -> tuple[float, list[float]]:
    """Median over rounds of (p50 of round's numerator samples / p50 of its denominator's)."""
    ratios = [statistics.median(n) / statistics.median(d) for n, d in zip(numerators, denominators) if n and d]
    return (statistics.median(ratios) if ratios else math.nan), ratios


def daemon_counters(handle: common.DaemonHandle) -> tuple[float, float] | None:
    """The own daemon's handoff histogram (count, sum in s), None without metrics."""
    if handle.metrics_port is None:
        return None
    try:
        m = common.scrape_metrics(handle.metrics_port)
    except OSError as exc:
        common.log(f"[handoff] could not read the daemon's metrics: {exc}")
        return None
    return (m.get('nodeagent_token_handoff_seconds_count{device="0"}', 0.0),
            m.get('nodeagent_token_handoff_seconds_sum{device="0"}', 0.0))


def measure(handle: common.DaemonHandle, sessions: int, args, pipe: baselines.PipePingPong) -> dict:
    """Every figure for one session count (the keys documented in bench/README.md)."""
    before = daemon_counters(handle)
    run = interleaved(handle.endpoint, sessions, args.handoffs, args.rounds, pipe, args.pipe_round_trips,
                      relay=not args.no_relay, work_device=args.work_device, hold_us=args.hold_us)
    after = daemon_counters(handle)
    us = 1e-3
    pairs = [h for r in run["handoffs"] for h in r]
    pipes = [s for r in run["pipe"] for s in r]
    relays = [s for r in run["relay"] for s in r]
    if not pairs:
        raise RuntimeError("no handoff could be paired (is another client using device 0?)")
    h50, h99 = common.percentile(pairs, 50) * us, common.percentile(pairs, 99) * us
    pipe50 = common.percentile(pipes, 50) * us
    ratio_pipe, per_round = paired_ratio(run["handoffs"], run["pipe"])
    result = {
        "sessions": sessions,
        "processes": sessions,
        "rounds": args.rounds,
        "samples": len(pairs),
        "handoffs": len(pairs),
        "handoff_p50_us": common.rounded(h50, 1),
        "handoff_p99_us": common.rounded(h99, 1),
        "handoff_max_us": common.rounded(max(pairs) * us, 1),
        "pipe_rtt_p50_us": common.rounded(pipe50, 1),
        "pipe_rtt_p99_us": common.rounded(common.percentile(pipes, 99) * us, 1),
        "pipe_samples": len(pipes),
        "pipe_rtt_p50_us_per_round": [common.rounded(statistics.median(r) * us, 1) for r in run["pipe"]],
        "handoff_p50_us_per_round": [common.rounded(statistics.median(r) * us, 1) if r else None
                                     for r in run["handoffs"]],
        "ratio_pipe_p50": common.rounded(ratio_pipe, 2),
        "ratio_pipe_p50_per_round": [common.rounded(r, 2) for r in per_round],
        "ratio_pipe_p50_pooled": common.rounded(h50 / pipe50, 2),
        "goal_ratio_pipe_p50": GOAL_RATIO_PIPE_P50,
        "goal_p50_met": bool(ratio_pipe <= GOAL_RATIO_PIPE_P50),
        "goal_p99_us": GOAL_P99_US,
        "goal_p99_met": bool(h99 < GOAL_P99_US),
        "release_call_p50_us": common.rounded(common.percentile(run["release_call"], 50) * us, 1),
        "handoffs_per_s": round(run["grants"] / run["run_s"]) if run["run_s"] > 0 else None,
        "warmup_grants_discarded": run["warmup"],
        "edge_grants_discarded_per_round": 2 * sessions,
        "unpaired_releases": run["unpaired"],
        "startup_s": common.rounded(run["startup_s"], 2),
        "hold_us": args.hold_us,
    }
    if relays:
        r50 = common.percentile(relays, 50) * us
        relay_ratio, _ = paired_ratio(run["relay"], run["pipe"])
        result.update({
            "relay_transport": "unix stream socket, length-prefixed MessagePack (the daemon's framing)",
            "relay_p50_us": common.rounded(r50, 1),
            "relay_p99_us": common.rounded(common.percentile(relays, 99) * us, 1),
            "ratio_p50_vs_relay": common.rounded(h50 / r50, 2),
            "ratio_relay_pipe_p50": common.rounded(relay_ratio, 2),
        })
    if before is not None and after is not None and after[0] > before[0]:
        result["daemon_internal_mean_us"] = common.rounded(1e6 * (after[1] - before[1]) / (after[0] - before[0]), 1)
    common.log(f"[handoff] {sessions} sessions: handoff p50 {h50:.1f} us p99 {h99:.1f} us over {len(pairs)}; "
               f"pipe p50 {pipe50:.1f} us; paired ratio p50 {ratio_pipe:.2f} (goal <= {GOAL_RATIO_PIPE_P50}: "
               f"{'met' if result['goal_p50_met'] else 'MISSED'})"
               + (f"; relay p50 {result['relay_p50_us']} us ({result['ratio_relay_pipe_p50']}x the pipe)"
                  if relays else ""))
    return result


def session_counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts separated by commas, got {text!r}") from None
    if not counts or any(c < 2 for c in counts):
        raise argparse.ArgumentTypeError(f"every count must be at least 2 for a handoff, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("handoff", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip())
    ap.add_argument("--sessions", type=session_counts, default=[2, 64],
                    help="contending client sessions, one process each; a list is measured count by count "
                         "(default: 2,64)")
    ap.add_argument("--handoffs", type=common.positive_int, default=5000,
                    help="handoffs to measure per session count after the warm-up (default: 5000)")
    ap.add_argument("--rounds", type=common.positive_int, default=10,
                    help="rounds the handoffs are split into, each paired with pipe blocks (default: 10)")
    ap.add_argument("--pipe-round-trips", type=common.positive_int, default=200,
                    help="pipe ping-pong round trips per block, one block between rounds (default: 200)")
    ap.add_argument("--no-relay", action="store_true", help="skip the unix-socket relay baseline")
    ap.add_argument("--round-trips", type=common.positive_int, default=1000,
                    help="zmq ping-pong round trips per process pair (default: 1000)")
    ap.add_argument("--pairs", type=common.positive_int, default=6,
                    help="zmq ping-pong process pairs, half before and half after the handoffs (default: 6)")
    ap.add_argument("--work-device", choices=("none", "cuda"), default="none",
                    help="cuda: each session runs a matmul on the GPU while it holds the token (default: none)")
    ap.add_argument("--hold-us", type=float, default=0.0,
                    help="each holder spins this long before it releases, as a slice's work would (default: 0, "
                         "back to back)")
    args = ap.parse_args(argv)
    if args.hold_us < 0:
        ap.error("--hold-us must be >= 0")

    wall0 = time.monotonic()
    by_sessions = {}
    with common.daemon(metrics=True) as handle:
        backend = common.daemon_status(handle.endpoint).backend
        common.log(f"[handoff] baseline: raw zmq ipc ping-pong, {args.pairs // 2 or 1} process pair(s)")
        rtt_pairs = baselines.ping_pong(args.round_trips, args.pairs // 2 or 1)
        with baselines.PipePingPong() as pipe:
            for sessions in args.sessions:
                common.log(f"[handoff] {sessions} sessions contending for device 0, interleaved with the pipe"
                           + ("" if args.no_relay else " and the relay"))
                by_sessions[str(sessions)] = measure(handle, sessions, args, pipe)
        if args.pairs > 1:
            common.log(f"[handoff] baseline: raw zmq ipc ping-pong, {args.pairs - args.pairs // 2} more pair(s)")
            rtt_pairs += baselines.ping_pong(args.round_trips, args.pairs - args.pairs // 2)

    us = 1e-3
    rtts = [rtt for pair in rtt_pairs for rtt in pair]
    b50, b99 = common.percentile(rtts, 50) * us, common.percentile(rtts, 99) * us
    zmq_keys = {
        "baseline_rtt_p50_us": common.rounded(b50, 1),
        "baseline_rtt_p99_us": common.rounded(b99, 1),
        "baseline_samples": len(rtts),
        "baseline_rtt_p50_us_per_pair": [common.rounded(common.percentile(p, 50) * us, 1) for p in rtt_pairs],
    }
    for r in by_sessions.values():
        r["ratio_p50"] = common.rounded(r["handoff_p50_us"] / b50, 2)
        r["ratio_p99"] = common.rounded(r["handoff_p99_us"] / b99, 2)
    last = by_sessions[str(args.sessions[-1])]
    goals = [{"goal": f"ratio_pipe_p50 <= {GOAL_RATIO_PIPE_P50}", "sessions": int(n), "value": r["ratio_pipe_p50"],
              "met": r["goal_p50_met"]} for n, r in by_sessions.items()]
    goals.append({"goal": f"handoff_p99_us < {GOAL_P99_US:g}", "sessions": last["sessions"],
                  "value": last["handoff_p99_us"], "met": last["goal_p99_met"]})
    result = {
        "benchmark": "handoff",
        "backend": backend,
        "work_device": args.work_device,
        "endpoint_kind": handle.kind,
        **last,
        **zmq_keys,
        "session_counts": args.sessions,
        "by_sessions": by_sessions,
        "goals": goals,
        "all_goals_met": all(g["met"] for g in goals),
        "loadavg_after": list(os.getloadavg()),
    }
    for g in goals:
        common.log(f"[handoff] goal {g['goal']} at {g['sessions']} sessions: {g['value']} "
                   f"({'met' if g['met'] else 'MISSED'})")
    common.log(f"[handoff] zmq ipc RTT p50 {b50:.1f} us (the old transport's floor); took "
               f"{time.monotonic() - wall0:.1f} s")
    if not result["all_goals_met"]:
        for r in by_sessions.values():
            explain(r)
    common.emit(result, args.json)
    return 0


def explain(r: dict) -> None:
    """Where a handoff's time goes, as far as this run measured it (stderr)."""
    n = r["sessions"]
    lines = [f"{n} sessions: the pipe floor (one round trip between two processes) was {r['pipe_rtt_p50_us']} us "
             f"(p50) in the same rounds"]
    if r.get("relay_p50_us") is not None:
        lines.append(f"{n} sessions: a broker relaying a token over unix sockets with the same framing and codec, "
                     f"no scheduler (two hops, as the daemon's handoff) took {r['relay_p50_us']} us (p50), "
                     f"{r['ratio_relay_pipe_p50']}x the pipe: what any two-hop design pays here")
    lines.append(f"{n} sessions: client side: client_lib's release() takes {r['release_call_p50_us']} us (p50) of "
                 "the handoff before its frame leaves")
    if r.get("daemon_internal_mean_us") is not None:
        lines.append(f"{n} sessions: daemon: {r['daemon_internal_mean_us']} us (mean) from reading a release to "
                     "having sent the grant (its nodeagent_token_handoff_seconds)")
    for line in lines:
        common.log(f"[handoff] where the time goes: {line}")


if __name__ == "__main__":
    raise SystemExit(main())
