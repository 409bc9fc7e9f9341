"""Scale: what N idle sessions cost the daemon, and whether they slow a handoff.

``--sessions`` N sessions are attached from ``--procs`` forked processes (each
holding N/procs Clients, its descriptor limit raised to fit) and left idle:
connected, never asking for the token. With them attached, this run reads
the daemon's /proc entries:

  idle_cpu_percent     the daemon's CPU (utime + stime of all its threads,
                       /proc/PID/stat) over ``--idle-s`` seconds with the N
                       sessions idle, in percent of one core (goal < 1%);
                       beside it the same with no idle sessions
                       (``idle_cpu_percent_empty``, a shorter window), the
                       daemon's thread wake-ups per second and the CPU the
                       holder processes spent meanwhile (client-side liveness)
  rss_per_session_kb   the daemon's RSS after attaching minus before, / N
  fds_per_session      the daemon's open descriptors, likewise
  status_ms            one ``status`` request (connect, ask, receive and decode
                       the snapshot of N sessions) from this process, median
                       of ``--status-repeats`` (and ``status_ms_empty``)

Handoff beside N idle sessions: two more sessions hand the token back and
forth (bench.handoff's contenders) in blocks of ``--handoffs``; blocks with no
idle sessions and blocks with the N attached alternate (the N are attached
and detached between blocks, ``--cycles`` times), so both see the same
machine. ``handoff_idle_over_empty_p50`` is the median over cycles of a
block's p50 over the p50 of the empty blocks before and after it; p99 is
compared pooled. Goal: both within 10%.

Status beside a handoff: in the first cycle, one more block runs with the N
attached while this process asks for ``status`` ``--status-hz`` times a second (each
lists all N), as a live view would;
``handoff_status_p99_us`` against the idle blocks' p99
(``handoff_status_over_idle_p99``) says whether building big statuses holds
handoffs up (the daemon builds one a chunk of rows per loop turn).

Last, with the daemon stopped, the scheduler's step time in this process at
10, 1,000 and 10,000 waiting sessions (``bench.scheduler_support``).
"""

from __future__ import annotations

import math
import os
import resource
import socket
import statistics
import threading
import time

from bench import common
from bench.handoff import Contenders, pair_handoffs
from client_lib import Client, NodeAgentError, codec, framing
from client_lib import protocol as p
from bench.scheduler_support import scheduler_step_us

_WORKER_TIMEOUT_S = 120.0  # attaching a thousand sessions on 2 shared cores
_SETTLE_S = 0.5  # after attaching or detaching, before anything is measured
_FD_MARGIN = 64  # descriptors a holder keeps for itself beyond its Clients
SCHEDULER_WAITING = (10, 1000, 10000)
GOAL_IDLE_CPU_PERCENT = 1.0
GOAL_HANDOFF_RATIO = 1.10
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ /proc reads


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of every thread of ``pid`` (/proc/PID/stat), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def fd_soft_limit(pid: int) -> int | None:
    """The process's RLIMIT_NOFILE soft limit (/proc/PID/limits), None if unreadable or unlimited."""
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    value = line.split()[3]
                    return int(value) if value.isdigit() else None
    except OSError:
        pass
    return None


def context_switches(pid: int) -> int | None:
    """Voluntary and involuntary context switches of every thread: how often it woke."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        total += int(line.split()[1])
        except OSError:
            continue  # a thread that ended meanwhile
    return total


def idle_window(daemon_pid: int, seconds: float, others: list[int] = ()) -> dict:
    """The daemon's CPU (percent of one core) and wake-ups per second over ``seconds``,
    and the CPU ``others`` (processes) spent meanwhile, summed."""
    cpu0, sw0 = cpu_seconds(daemon_pid), context_switches(daemon_pid)
    others0 = [cpu_seconds(pid) for pid in others]
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    cpu1, sw1 = cpu_seconds(daemon_pid), context_switches(daemon_pid)
    others1 = [cpu_seconds(pid) for pid in others]
    out = {"window_s": common.rounded(elapsed, 2), "cpu_percent": None, "wakeups_per_s": None,
           "others_cpu_percent": None}
    if cpu0 is not None and cpu1 is not None:
        out["cpu_percent"] = common.rounded(100.0 * (cpu1 - cpu0) / elapsed, 3)
    if sw0 is not None and sw1 is not None:
        out["wakeups_per_s"] = common.rounded((sw1 - sw0) / elapsed, 1)
    spent = [b - a for a, b in zip(others0, others1) if a is not None and b is not None]
    if others:
        out["others_cpu_percent"] = common.rounded(100.0 * sum(spent) / elapsed, 3)
    return out


def timed_status(endpoint: str, repeats: int) -> tuple[float, int]:
    """Median ms of ``repeats`` status requests, and the sessions the last one listed."""
    times, sessions = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        status = common.daemon_status(endpoint, timeout_s=30.0)
        times.append((time.perf_counter() - t0) * 1e3)
        sessions = sum(len(d.sessions) for d in status.devices)
    return statistics.median(times), sessions


def status_breakdown(endpoint: str, repeats: int) -> dict:
    """Where a status request's time goes, medians of ``repeats`` (raw socket, the
    documented framing): from sending it to the reply's first byte (the daemon
    building and encoding the snapshot), from there to its last byte (transfer),
    and decoding it here; and the reply's size."""
    family, address = framing.parse_endpoint(endpoint)
    first, rest, decode, size = [], [], [], 0
    for _ in range(repeats):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(30.0)
            sock.connect(address)
            t0 = time.perf_counter()
            sock.sendall(framing.pack(codec.encode(p.StatusRequest(id=1))))
            buf = sock.recv(1 << 20)
            t1 = time.perf_counter()
            frames = framing.FrameBuffer(framing.MAX_DAEMON_FRAME_BYTES)
            got = frames.feed(buf)
            while not got:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise RuntimeError("the daemon closed the connection before its status reply")
                got = frames.feed(chunk)
            t2 = time.perf_counter()
            codec.decode_reply(got[0])
            t3 = time.perf_counter()
        first.append(t1 - t0)
        rest.append(t2 - t1)
        decode.append(t3 - t2)
        size = len(got[0])
    ms = 1e3
    return {"first_byte_ms": common.rounded(statistics.median(first) * ms, 3),
            "transfer_ms": common.rounded(statistics.median(rest) * ms, 3),
            "decode_ms": common.rounded(statistics.median(decode) * ms, 3), "reply_bytes": size}


# --------------------------------------------------------------- idle holders


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        cap = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))


def _holder(ctl: common.WorkerControl, endpoint: str, index: int, count: int, cycles: int,
            gate: common.RoundGate) -> None:
    """Per cycle: attach ``count`` idle sessions (one round), then close them (the next)."""
    _raise_fd_limit(count + _FD_MARGIN)
    ctl.ready(os.getpid())
    attached, attach_s, detach_s, errors = [], [], [], []
    for _ in range(cycles):
        gate.enter()
        clients = []
        t0 = time.monotonic()
        try:
            for i in range(count):
                clients.append(Client(f"bench-idle-{index}-{i}", workload="training", device=0, endpoint=endpoint))
        except (NodeAgentError, OSError) as exc:  # reported: e.g. the daemon refusing connections
            errors.append(f"{type(exc).__name__}: {exc}")
        attach_s.append(time.monotonic() - t0)
        attached.append(len(clients))
        gate.leave()
        gate.enter()
        t0 = time.monotonic()
        for client in clients:
            client.close()
        detach_s.append(time.monotonic() - t0)
        del clients
        gate.leave()
    ctl.result({"attached": attached, "attach_s": attach_s, "detach_s": detach_s, "errors": errors})


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` counts that differ by at most one."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def holder_processes(sessions: int, asked: int, fd_hard_limit: int) -> int:
    """At least ``asked`` (at most one per session), and enough that no holder needs more
    descriptors than ``fd_hard_limit`` (RLIMIT_NOFILE's hard limit; a Client holds one)."""
    per_process = sessions if fd_hard_limit == resource.RLIM_INFINITY else max(1, fd_hard_limit - _FD_MARGIN)
    return max(1, min(sessions, max(asked, math.ceil(sessions / per_process))))


# ----------------------------------------------------------------- the run


def run(handle: common.DaemonHandle, args) -> dict:
    status = common.daemon_status(handle.endpoint)
    pid = status.daemon_pid
    if cpu_seconds(pid) is None:
        common.log(f"[scale] cannot read /proc/{pid}: daemon CPU, memory and descriptors are not measured")
    procs = holder_processes(args.sessions, args.procs, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    counts = split(args.sessions, procs)
    loops = math.ceil((args.handoffs + 5) / 2)
    # round 0 warms up; then empty, idle, empty, ..., empty (cycles idle blocks)
    plan = [max(100, loops // 4)] + [loops] * (2 * args.cycles + 2)  # + one block beside statuses
    holder_gate = common.RoundGate(procs, timeout_s=_WORKER_TIMEOUT_S)
    out: dict = {"daemon_pid": pid, "holder_processes": procs, "sessions_per_process": counts,
                 "daemon_fd_limit": fd_soft_limit(pid)}
    phases = []
    with Contenders(handle.endpoint, 2, plan) as pair, common.Workers() as holders:
        for i, count in enumerate(counts):
            holders.start(_holder, handle.endpoint, i, count, args.cycles, holder_gate)
        holder_pids = holders.wait_ready(_WORKER_TIMEOUT_S)
        holders.go()
        pair.run_round()  # warm-up
        time.sleep(_SETTLE_S)
        empty = idle_window(pid, min(args.idle_s, 5.0), holder_pids)
        out["rss_empty_kb"], out["fds_empty"] = rss_kb(pid), open_fds(pid)
        out["status_ms_empty"], _ = timed_status(handle.endpoint, args.status_repeats)
        for cycle in range(args.cycles):
            phases.append(("empty", pair.run_round()))
            rss0, fds0 = rss_kb(pid), open_fds(pid)
            t0, t1 = holder_gate.run_round()
            attach_s = (t1 - t0) / 1e9
            time.sleep(_SETTLE_S)
            if cycle == 0:
                common.log(f"[scale] {args.sessions} sessions attached from {procs} processes in {attach_s:.1f} s; "
                           f"idle for {args.idle_s:g} s")
                rss1, fds1 = rss_kb(pid), open_fds(pid)
                idle = idle_window(pid, args.idle_s, holder_pids)
                status_ms, listed = timed_status(handle.endpoint, args.status_repeats)
                out["status_breakdown"] = status_breakdown(handle.endpoint, args.status_repeats)
                out.update(first_attach_s=attach_s, rss_before_kb=rss0, rss_after_kb=rss1, fds_before=fds0,
                           fds_after=fds1, idle=idle, empty=empty, status_ms=status_ms, sessions_listed=listed)
            phases.append(("idle", pair.run_round()))
            if cycle == 0:
                with StatusStorm(handle.endpoint, args.status_hz) as storm:
                    phases.append(("status", pair.run_round()))
                out["statuses_during_block"] = storm.answered
            holder_gate.run_round()  # detach
            time.sleep(_SETTLE_S)
        phases.append(("empty", pair.run_round()))
        records = pair.records()
        held = holders.results(_WORKER_TIMEOUT_S)
    per_round, unpaired = pair_handoffs(records, 2)
    blocks = [(kind, per_round.get(i + 1, [])) for i, (kind, _) in enumerate(phases)]
    out.update(holders=held, blocks=blocks, unpaired=unpaired)
    return out


class StatusStorm:
    """Asks for ``status`` ``hz`` times a second from a thread until the block it wraps ends."""

    def __init__(self, endpoint: str, hz: float) -> None:
        self.endpoint = endpoint
        self.period_s = 1.0 / hz
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-storm", daemon=True)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            common.daemon_status(self.endpoint, timeout_s=30.0)
            self.answered += 1
            next_at += self.period_s

    def __enter__(self) -> StatusStorm:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60.0)


def summarize(raw: dict, args, backend: str, kind: str, scheduler: dict) -> dict:
    us = 1e-3
    n = args.sessions
    empty_blocks = [b for kind_, b in raw["blocks"] if kind_ == "empty"]
    idle_blocks = [b for kind_, b in raw["blocks"] if kind_ == "idle"]
    status_all = [h for kind_, b in raw["blocks"] if kind_ == "status" for h in b]
    empty_all = [h for b in empty_blocks for h in b]
    idle_all = [h for b in idle_blocks for h in b]
    ratios = []
    for i, block in enumerate(idle_blocks):
        around = empty_blocks[i] + empty_blocks[i + 1]
        if block and around:
            ratios.append(statistics.median(block) / statistics.median(around))
    e50, e99 = common.percentile(empty_all, 50) * us, common.percentile(empty_all, 99) * us
    i50, i99 = common.percentile(idle_all, 50) * us, common.percentile(idle_all, 99) * us
    ratio50 = statistics.median(ratios) if ratios else math.nan
    ratio99 = i99 / e99 if e99 else math.nan
    attached = [h["attached"][0] if h["attached"] else 0 for h in raw["holders"]]
    errors = [e for h in raw["holders"] for e in h["errors"]]

    def per_session(after, before):
        return None if after is None or before is None else common.rounded((after - before) / n, 2)

    idle, empty = raw["idle"], raw["empty"]
    idle_cpu = idle["cpu_percent"]
    result = {
        "benchmark": "scale",
        "backend": backend,
        "endpoint_kind": kind,
        "sessions": n,
        "sessions_attached": sum(attached),
        "sessions_listed": raw["sessions_listed"],
        "attach_errors": errors[:5],
        "holder_processes": raw["holder_processes"],
        "sessions_per_process": raw["sessions_per_process"],
        "attach_s": common.rounded(raw["first_attach_s"], 3),
        "detach_s": common.rounded(max(max(h["detach_s"]) for h in raw["holders"]), 3),
        "idle_s": idle["window_s"],
        "idle_cpu_percent": idle_cpu,
        "idle_wakeups_per_s": idle["wakeups_per_s"],
        "idle_cpu_percent_empty": empty["cpu_percent"],
        "idle_wakeups_per_s_empty": empty["wakeups_per_s"],
        "idle_empty_window_s": empty["window_s"],
        "clients_idle_cpu_percent": idle["others_cpu_percent"],
        "rss_empty_kb": raw["rss_empty_kb"],
        "rss_before_kb": raw["rss_before_kb"],
        "rss_after_kb": raw["rss_after_kb"],
        "rss_per_session_kb": per_session(raw["rss_after_kb"], raw["rss_before_kb"]),
        "fds_before": raw["fds_before"],
        "fds_after": raw["fds_after"],
        "fds_per_session": per_session(raw["fds_after"], raw["fds_before"]),
        "daemon_fd_limit": raw["daemon_fd_limit"],
        "status_ms": common.rounded(raw["status_ms"], 3),
        "status_ms_empty": common.rounded(raw["status_ms_empty"], 3),
        "status_breakdown": raw["status_breakdown"],
        "status_repeats": args.status_repeats,
        "cycles": args.cycles,
        "samples": len(idle_all),
        "handoff_empty_p50_us": common.rounded(e50, 1),
        "handoff_empty_p99_us": common.rounded(e99, 1),
        "handoff_idle_p50_us": common.rounded(i50, 1),
        "handoff_idle_p99_us": common.rounded(i99, 1),
        "handoff_idle_over_empty_p50": common.rounded(ratio50, 3),
        "handoff_idle_over_empty_p50_per_cycle": [common.rounded(r, 3) for r in ratios],
        "handoff_idle_over_empty_p99": common.rounded(ratio99, 3),
        "handoff_status_p50_us": common.rounded(common.percentile(status_all, 50) * us, 1) if status_all else None,
        "handoff_status_p99_us": common.rounded(common.percentile(status_all, 99) * us, 1) if status_all else None,
        "handoff_status_over_idle_p99": (common.rounded(common.percentile(status_all, 99) * us / i99, 3)
                                         if status_all and i99 else None),
        "statuses_during_block": raw.get("statuses_during_block"),
        "status_hz": args.status_hz,
        "handoff_samples_empty": len(empty_all),
        "handoff_samples_idle": len(idle_all),
        "unpaired_releases": raw["unpaired"],
        "scheduler_step_us": {str(w): common.rounded(s["grant_next_us_p50"], 2) for w, s in scheduler.items()},
        "scheduler": {str(w): {k: (common.rounded(v, 4) if isinstance(v, float) else v) for k, v in s.items()}
                      for w, s in scheduler.items()},
    }
    grow = scheduler.get(SCHEDULER_WAITING[-1], {}).get("grant_next_us_p50")
    base = scheduler.get(SCHEDULER_WAITING[0], {}).get("grant_next_us_p50")
    result["scheduler_grant_10000_over_10"] = common.rounded(grow / base, 2) if grow and base else None
    goals = [
        {"goal": f"idle_cpu_percent < {GOAL_IDLE_CPU_PERCENT:g}", "value": idle_cpu,
         "met": idle_cpu is not None and idle_cpu < GOAL_IDLE_CPU_PERCENT},
        {"goal": f"handoff_idle_over_empty_p50 <= {GOAL_HANDOFF_RATIO:g}",
         "value": result["handoff_idle_over_empty_p50"], "met": bool(ratio50 <= GOAL_HANDOFF_RATIO)},
        {"goal": f"handoff_idle_over_empty_p99 <= {GOAL_HANDOFF_RATIO:g}",
         "value": result["handoff_idle_over_empty_p99"], "met": bool(ratio99 <= GOAL_HANDOFF_RATIO)},
        {"goal": f"sessions_attached == {n}", "value": result["sessions_attached"],
         "met": result["sessions_attached"] == n},
    ]
    result["goals"] = goals
    result["all_goals_met"] = all(g["met"] for g in goals)
    result["loadavg_after"] = list(os.getloadavg())
    return result


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("scale", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip())
    ap.add_argument("--sessions", type=common.positive_int, default=1000,
                    help="idle sessions to attach (default: 1000)")
    ap.add_argument("--procs", type=common.positive_int, default=5,
                    help="processes holding them, N/procs each (more if a descriptor limit needs it; default: 5)")
    ap.add_argument("--idle-s", type=common.positive_float, default=30.0,
                    help="window over which the daemon's idle CPU is measured (default: 30)")
    ap.add_argument("--handoffs", type=common.positive_int, default=2000,
                    help="handoffs per block between the two active sessions (default: 2000)")
    ap.add_argument("--cycles", type=common.positive_int, default=3,
                    help="blocks with the idle sessions attached, each between two without (default: 3)")
    ap.add_argument("--status-repeats", type=common.positive_int, default=7,
                    help="status requests timed at each size (default: 7)")
    ap.add_argument("--status-hz", type=common.positive_float, default=20.0,
                    help="status requests a second beside one handoff block, as a live view such as "
                         "`nodeagent top` would ask (default: %(default)s)")
    ap.add_argument("--scheduler-samples", type=common.positive_int, default=300,
                    help="scheduler steps timed at each queue length (default: 300)")
    args = ap.parse_args(argv)

    wall0 = time.monotonic()
    with common.daemon() as handle:
        backend = common.daemon_status(handle.endpoint).backend
        common.log(f"[scale] attaching {args.sessions} idle sessions ({args.cycles} times) beside two handing "
                   f"off the token")
        raw = run(handle, args)
    common.log(f"[scale] scheduler steps at {', '.join(map(str, SCHEDULER_WAITING))} waiting sessions")
    scheduler_step_us(SCHEDULER_WAITING[1], samples=args.scheduler_samples)  # warm-up, discarded
    scheduler = {w: scheduler_step_us(w, samples=args.scheduler_samples) for w in SCHEDULER_WAITING}
    result = summarize(raw, args, backend, handle.kind, scheduler)
    r = result
    common.log(f"[scale] {r['sessions_attached']} of {r['sessions']} sessions attached in {r['attach_s']} s; idle "
               f"CPU {r['idle_cpu_percent']}% of a core over {r['idle_s']} s ({r['idle_wakeups_per_s']} wake-ups/s; "
               f"{r['idle_cpu_percent_empty']}% with none; clients {r['clients_idle_cpu_percent']}%); RSS "
               f"{r['rss_per_session_kb']} KB and {r['fds_per_session']} fds per session; status {r['status_ms']} ms "
               f"({r['status_ms_empty']} ms with none)")
    common.log(f"[scale] handoff p50/p99 {r['handoff_idle_p50_us']}/{r['handoff_idle_p99_us']} us beside the idle "
               f"sessions, {r['handoff_empty_p50_us']}/{r['handoff_empty_p99_us']} us without: "
               f"x{r['handoff_idle_over_empty_p50']} / x{r['handoff_idle_over_empty_p99']}; scheduler step "
               f"{r['scheduler_step_us']} us; took {time.monotonic() - wall0:.1f} s")
    for g in r["goals"]:
        common.log(f"[scale] goal {g['goal']}: {g['value']} ({'met' if g['met'] else 'MISSED'})")
    common.emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
