"""Recovery: how long after a daemon restart until every session has re-attached.

`--sessions` client processes (forked, each its own session on device 0, a
training loop of real work units with `yield_point()` after each) run against
a daemon started here with `--heartbeat-ms 200` and a private `--state-dir`.
Once every session has been granted the token at least once, the daemon is
killed with SIGKILL and a new `nodeagent serve` is started at once on the same
endpoint and state dir. From the moment it is spawned, `query_status` is asked
every few ms (a fresh connection each time) until it shows every session
`attached`.

  ready_s                 spawn -> first status answer: the cost of merely
                          starting a daemon (the baseline)
  reattach_s              spawn -> every session attached
  reattach_after_ready_s  the difference: what recovery itself adds
  all_granted_s           spawn -> every session granted again (work resumed);
                          compare with first_round_s, the time from the start
                          to every session's first grant on the first daemon

Then the clients are told to finish; each reports the session id it had at
start and at the end (`sessions_kept`: unchanged), whether it raised
(`client_errors`) and whether it did work after the restart
(`clients_ran_after_restart`). `restored` (and `dropped`, `boot`) come from
the new daemon's log line `[restore] boot=N restored=M dropped=K`.

This benchmark kills and restarts a daemon, so it always starts its own; with
NODEAGENT_ENDPOINT set it says so and ignores it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
import traceback

from bench import common
from client_lib import Client, DaemonUnavailableError, query_status
from client_lib.endpoint import ENV_ENDPOINT

_HEARTBEAT_MS = 200
_CONNECT_TIMEOUT_S = 60.0  # forking and connecting many clients on 2 cores
_STATUS_POLL_S = 0.005  # how often status is asked while waiting for the new daemon and the sessions
_GRANTED_POLL_S = 0.02  # how often status is asked while waiting for every session's first grant
_RESTORE_LINE = re.compile(r"\[restore\] boot=(\d+) restored=(\d+) dropped=(\d+)")


def _client(ctl: common.WorkerControl, endpoint: str, index: int, rounds: int, stop, restart_ns) -> None:
    """A training loop that runs until ``stop``; what happened to its session."""
    client = Client(f"bench-recovery-{index}", workload="training", device=0, endpoint=endpoint)
    work = common.Work(rounds)
    first = client.session_id
    units = after = 0
    error = None
    try:
        ctl.ready(first)
        with client.slice():
            while not stop.is_set():
                work()
                units += 1
                if 0 < restart_ns.value < time.monotonic_ns():
                    after += 1
                client.yield_point()
    except Exception:  # counted, not fatal: the benchmark reports how many clients raised
        error = traceback.format_exc(limit=4)
    try:
        ctl.result({"session_start": first, "session_end": client.session_id, "units": units,
                    "units_after_restart": after, "error": error, "resumed": client.welcome.resumed})
    finally:
        client.close()


def _status(endpoint: str, timeout_s: float):
    try:
        return query_status(endpoint, timeout=timeout_s)
    except DaemonUnavailableError:
        return None


def _sessions(status) -> dict:
    return {s.id: s for d in status.devices for s in d.sessions}


def _wait_all(endpoint: str, ids: set[str], proc, timeout_s: float, done, poll_s: float = 0.05) -> bool:
    """Poll status until ``done(sessions by id)`` holds for the sessions ``ids``; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {proc.returncode}")
        status = _status(endpoint, 1.0)
        if status is not None:
            sessions = _sessions(status)
            if ids <= sessions.keys() and all(done(sessions[i]) for i in ids):
                return True
        time.sleep(poll_s)
    return False


def _watch_restart(endpoint: str, ids: set[str], t_spawn: int, proc, timeout_s: float) -> dict:
    """From the new daemon's spawn: first answer, all attached, all granted (monotonic ns, or None)."""
    ready = attached = granted = None
    last_attached = 0
    deadline = t_spawn + int(timeout_s * 1e9)
    while granted is None and time.monotonic_ns() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the new daemon exited with status {proc.returncode}")
        t_ask = time.monotonic()
        status = _status(endpoint, _STATUS_POLL_S)
        now = time.monotonic_ns()
        if status is None:
            # Not listening yet: connecting fails at once, so wait out the poll period
            # rather than spin on the cores the new daemon is starting on.
            time.sleep(max(0.0, _STATUS_POLL_S - (time.monotonic() - t_ask)))
            continue
        if ready is None:
            ready = now
        sessions = _sessions(status)
        ours = [sessions[i] for i in ids if i in sessions]
        last_attached = sum(1 for s in ours if s.attached)
        if attached is None and last_attached == len(ids):
            attached = now
        if attached is not None and sum(1 for s in ours if s.grants > 0) == len(ids):
            granted = now
        if attached is not None:
            time.sleep(_GRANTED_POLL_S)  # all back: the grants take a round of slices, look less often
        else:
            time.sleep(_STATUS_POLL_S)
    return {"ready": ready, "attached": attached, "granted": granted, "attached_count": last_attached}


def _restore_line(log_path: str) -> dict:
    try:
        with open(log_path, errors="replace") as f:
            m = _RESTORE_LINE.search(f.read())
    except OSError:
        m = None
    if not m:
        return {}
    boot, restored, dropped = (int(x) for x in m.groups())
    return {"restored": restored, "dropped": dropped, "boot": boot}


def _worth_relaying(line: str) -> bool:
    return " WARNING " in line or " ERROR " in line or "[restore] boot=" in line or "Traceback" in line


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("recovery", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip(),
                       endpoint_help="ignored (with a note on stderr): this benchmark kills its daemon, so "
                                     "it always\n                      starts its own on a private socket")
    ap.add_argument("--sessions", type=common.positive_int, default=50,
                    help="client processes, each with its own session (default: 50)")
    ap.add_argument("--quantum-ms", type=common.positive_float, default=20.0,
                    help="the daemon's training slice, so that every client gets a turn within about "
                         "sessions x quantum (default: 20)")
    ap.add_argument("--unit-ms", type=common.positive_float, default=1.0,
                    help="a client's work between yield points (default: 1)")
    ap.add_argument("--timeout-s", type=common.positive_float, default=30.0,
                    help="give up waiting for the sessions to come back after this long (default: 30)")
    args = ap.parse_args(argv)
    if os.environ.get(ENV_ENDPOINT):
        common.log(f"[recovery] {ENV_ENDPOINT} is set, but this benchmark has to SIGKILL and restart a "
                   "daemon: it starts its own on a private socket and leaves that one alone")

    wall0 = time.monotonic()
    work = common.Work.calibrated(args.unit_ms)
    workdir = tempfile.mkdtemp(prefix="nodeagent-bench-recovery-")
    endpoint = f"ipc://{workdir}/agent.sock"
    serve = common.serve_args(endpoint, os.path.join(workdir, "state"),
                              ["--heartbeat-ms", str(_HEARTBEAT_MS), "--quantum-ms", f"training={args.quantum_ms:g}"],
                              log_level="info")
    logs = [os.path.join(workdir, "daemon-1.log"), os.path.join(workdir, "daemon-2.log")]
    first = second = None
    failed = True
    stop = common.mp_context.Event()
    restart_ns = common.mp_context.Value("q", 0, lock=False)
    try:
        first = common.spawn_daemon(serve, logs[0])
        common.wait_for_daemon(endpoint, 15.0, first)
        common.log(f"[recovery] started nodeagent pid={first.pid} on {endpoint} (heartbeat {_HEARTBEAT_MS} ms); "
                   f"starting {args.sessions} clients")
        with common.Workers() as workers:
            for i in range(args.sessions):
                workers.start(_client, endpoint, i, work.rounds, stop, restart_ns)
            ids_at_start = workers.wait_ready(_CONNECT_TIMEOUT_S)
            ids = set(ids_at_start)
            if len(ids) != args.sessions:
                raise RuntimeError(f"{args.sessions} clients but {len(ids)} distinct sessions")
            if not _wait_all(endpoint, ids, first, 10.0, lambda s: True):
                raise RuntimeError("the daemon does not list every client's session")
            t_go = workers.go()
            round_s = args.sessions * args.quantum_ms / 1000.0
            if not _wait_all(endpoint, ids, first, 10.0 + 5 * round_s, lambda s: s.grants > 0,
                             poll_s=_GRANTED_POLL_S):
                raise RuntimeError("not every session was granted the token before the restart")
            first_round_s = (time.monotonic_ns() - t_go) / 1e9
            common.log(f"[recovery] all {args.sessions} sessions registered and granted; SIGKILL pid={first.pid} "
                       "and start a new daemon")

            first.send_signal(signal.SIGKILL)
            first.wait()
            restart_ns.value = t_spawn = time.monotonic_ns()
            second = common.spawn_daemon(serve, logs[1])
            seen = _watch_restart(endpoint, ids, t_spawn, second, args.timeout_s)
            if seen["attached"] is None:
                common.log(f"[recovery] only {seen['attached_count']} of {args.sessions} sessions attached "
                           f"within {args.timeout_s:g} s")

            stop.set()
            results = workers.results(_CONNECT_TIMEOUT_S + 5 * round_s)
        failed = False
    finally:
        try:
            common.stop_process(second)
            common.stop_process(first)
            restore = _restore_line(logs[1])
            for i, path in enumerate(logs, 1):
                common.relay_log(path, everything=failed, keep=_worth_relaying, prefix=f"[daemon {i}]", last=20)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def since_spawn(t):
        return None if t is None else common.rounded((t - t_spawn) / 1e9, 4)

    reattach_s, ready_s = since_spawn(seen["attached"]), since_spawn(seen["ready"])
    errors = [r["error"] for r in results if r["error"]]
    for text in errors[:3]:
        common.log(f"[recovery] a client raised:\n{text}")
    result = {
        "benchmark": "recovery",
        "backend": "cpu",
        "endpoint_kind": common.OWN,
        "sessions": args.sessions,
        "heartbeat_ms": _HEARTBEAT_MS,
        "quantum_ms": args.quantum_ms,
        "unit_ms": args.unit_ms,
        "samples": 1,
        "reattach_s": reattach_s,
        "ready_s": ready_s,
        "reattach_after_ready_s": None if reattach_s is None or ready_s is None
        else common.rounded(reattach_s - ready_s, 4),
        "all_granted_s": since_spawn(seen["granted"]),
        "first_round_s": common.rounded(first_round_s, 4),
        "sessions_attached": seen["attached_count"],
        "sessions_kept": sum(1 for sid, r in zip(ids_at_start, results)
                             if r["session_start"] == sid and r["session_end"] == sid),
        "client_errors": len(errors),
        "clients_resumed": sum(1 for r in results if r["resumed"]),
        "clients_ran_after_restart": sum(1 for r in results if r["units_after_restart"] > 0),
        **restore,
    }
    common.log(f"[recovery] new daemon answered after {ready_s} s, all {args.sessions} sessions attached after "
               f"{reattach_s} s ({result['reattach_after_ready_s']} s after it answered), all granted again after "
               f"{result['all_granted_s']} s; {result['sessions_kept']} kept their session, "
               f"{result['client_errors']} clients raised, {result['clients_ran_after_restart']} worked after the "
               f"restart; daemon restored {restore.get('restored', '?')} dropped {restore.get('dropped', '?')}; "
               f"took {time.monotonic() - wall0:.1f} s")
    common.emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
