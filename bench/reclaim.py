"""Reclaim: how soon a device lent to a training job is free for inference again.

A daemon with its cluster endpoint on (CURVE keys made for the run, protect_s 0
so a reclaimed device can be lent again at once) lends device 0 to a training
job, a training process of that job (`borrower`) holds the device back to back,
and a `client_lib.placement.PlacementClient` reclaims it over tcp, as a
placement layer would. The daemon measures `free_ms`: from the reclaim request
to the moment the job's session is off the device.

  cooperative  the trainer works in units of --unit-ms with yield_point()
               between them; on the suspend it parks --state-mb MiB of real
               training state (fp32 parameters, gradients, Adam state) with
               client_lib.torch.Yielder, frees it and releases the device. One
               trainer goes through --repeats cycles: lend, resume, reclaim.
  enforced     the trainer acquires the device and computes without ever
               calling into the library, so it never hears the request: at
               --deadline-ms the daemon SIGSTOPs it (its pid is verified) and
               takes the token. A fresh trainer per repeat (it is killed after).

Baselines, same run: `park_ms`, the cooperative trainer's own park of its
state (what no reclaim can beat), `rtt_ms`, a no-op `lend` through the same
CURVE endpoint (the transport), and the deadline itself for `enforced`. Keys:
`reclaim_cooperative_ms` and `reclaim_enforced_ms` (medians of `free_ms`),
their samples, `cooperative_minus_park_ms`, `enforced_minus_deadline_ms`,
`*_call_ms` (the placement client's whole call, transport included).

With --device cuda the trainers are GPU processes: the cooperative one keeps
its state on the GPU (Yielder parks it into pinned host memory and frees the
device memory) and runs a matmul on the GPU in every work unit; the enforced
one queues matmuls back to back, so it is stopped with GPU work in flight.
The daemon itself stays on its cpu backend (the token does not depend on it).

Always starts its own daemon: it needs the cluster endpoint and its keys.
"""

from __future__ import annotations

import json
import os
import queue as queue_mod
import shutil
import signal
import socket
import statistics
import tempfile
import time

from bench import common
from client_lib import Client
from client_lib.endpoint import ENV_ENDPOINT
from client_lib.placement import ClientKeys, PlacementClient
from nodeagent import keys

BORROWER = "bench-job"
NODE = "bench-node"
_WORKER_START_S = 60.0  # torch import and building the state, on a busy 2-core machine
_RTT_SAMPLES = 50


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ workers (forked)


def _gpu_unit(device: str):
    """One unit of GPU work (a matmul, then wait for it), or None on cpu. Called in a forked child:
    the parent never touches torch, let alone CUDA."""
    if device != "cuda":
        return None
    import torch

    x = torch.randn(2048, 2048, device="cuda")

    def unit() -> None:
        torch.mm(x, x)
        torch.cuda.synchronize()

    unit()
    return unit


def _cooperative_trainer(queue, stop, endpoint: str, state_mb: int, unit_rounds: int, device: str = "cpu") -> None:
    """Holds the device back to back; parks its state when suspended; reports each park."""
    import torch  # here, after the fork: the parent never touches torch

    from bench.suspend import TrainingState
    from client_lib.torch import Yielder
    try:
        state = TrainingState(state_mb, torch.device(device))
        gpu_unit = _gpu_unit(device)
        yielder = Yielder(optimizers=[state.opt])
        yielder.reserve()  # the host buffer exists before the first reclaim, as in a real job
        client = Client("bench-reclaim-cooperative", workload="training", endpoint=endpoint, borrower=BORROWER)

        def park() -> int:
            t0 = time.perf_counter()
            parked = yielder.park()
            queue.put(("park", (time.perf_counter() - t0) * 1000.0, parked))
            return parked
        client.set_suspend_handlers(park, yielder.unpark)
        work = common.Work(unit_rounds)
        with client.slice():
            queue.put(("holding", client.session_id))
            while not stop.is_set():
                work()
                if gpu_unit is not None:
                    gpu_unit()
                client.yield_point()
        client.close()
    except BaseException as exc:
        queue.put(("error", repr(exc)))
        raise


def _stubborn_trainer(queue, endpoint: str, unit_rounds: int, device: str = "cpu") -> None:
    """Takes the device and computes forever without calling into the library."""
    try:
        if device == "cuda":
            import torch  # here, after the fork

            x = torch.randn(2048, 2048, device="cuda")
            torch.cuda.synchronize()  # the context exists before the device is taken
        client = Client("bench-reclaim-enforced", workload="training", endpoint=endpoint, borrower=BORROWER)
        client.acquire()
        queue.put(("holding", client.session_id))
    except BaseException as exc:
        queue.put(("error", repr(exc)))
        raise
    if device == "cuda":
        while True:  # matmuls queued back to back: stopped with GPU work in flight
            for _ in range(4):
                x = torch.tanh(torch.mm(x, x) * 1e-3)
            torch.cuda.synchronize()
    work = common.Work(unit_rounds)
    while True:
        work()


def _expect(queue, kind: str, timeout_s: float):
    kind_got, value = None, None
    deadline = time.monotonic() + timeout_s
    while kind_got != kind:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"no {kind!r} from the trainer within {timeout_s:.0f} s")
        try:
            kind_got, *value = queue.get(timeout=left)
        except queue_mod.Empty:
            continue
        if kind_got == "error":
            raise RuntimeError(f"the trainer failed: {value[0]}")
    return value


# ------------------------------------------------------------------ the run


class _Node:
    """A private daemon with the cluster endpoint on, and a PlacementClient for it."""

    def __init__(self, workdir: str, backend: str = "cpu", config_extra: str = "") -> None:
        keys_dir = os.path.join(workdir, "keys")
        made = keys.generate(keys_dir, clients=("bench",))
        cluster = f"tcp://127.0.0.1:{_free_port()}"
        config = os.path.join(workdir, "nodeagent.toml")
        with open(config, "w") as f:
            f.write(f'[cluster]\nendpoint = "{cluster}"\nevents_endpoint = ""\nkeys_dir = "{keys_dir}"\n'
                    f'node = "{NODE}"\nprotect_s = 0.0\n{config_extra}')
        self.endpoint = f"ipc://{workdir}/agent.sock"
        self.log_path = os.path.join(workdir, "daemon.log")
        args = common.serve_args(self.endpoint, os.path.join(workdir, "state"),
                                 ["--config", config, "--ctxpool", "off"], log_level="info", backend=backend)
        self.proc = common.spawn_daemon(args, self.log_path)
        common.wait_for_daemon(self.endpoint, 15.0, self.proc)
        self.placement = PlacementClient({NODE: cluster}, keys=ClientKeys.load(made.clients["bench"]),
                                         server_keys={NODE: keys.server_public(keys_dir)}, timeout_ms=10_000)

    def session_state(self, session: str) -> tuple[str, str | None] | None:
        reply = self.placement.inventory()[NODE].reply
        for s in reply.devices[0].sessions:
            if s.id == session:
                return s.state, s.suspended
        return None

    def close(self) -> None:
        self.placement.close()
        common.stop_process(self.proc)


def _cooperative(node: _Node, repeats: int, state_mb: int, unit_rounds: int, device: str = "cpu") -> dict:
    node.placement.lend(NODE, 0, BORROWER)
    queue, stop = common.mp_context.Queue(), common.mp_context.Event()
    proc = common.mp_context.Process(target=_cooperative_trainer, daemon=True,
                                     args=(queue, stop, node.endpoint, state_mb, unit_rounds, device))
    proc.start()
    try:
        (session,) = _expect(queue, "holding", _WORKER_START_S)
        rtts = []
        for _ in range(_RTT_SAMPLES):  # the transport: a no-op lend (already lent) through CURVE
            t0 = time.perf_counter()
            if node.placement.lend(NODE, 0, BORROWER).changed:
                raise RuntimeError("a repeated lend changed the device")
            rtts.append((time.perf_counter() - t0) * 1000.0)
        free, calls, parks, outcomes, parked_bytes = [], [], [], {}, 0
        for i in range(repeats):
            if i:  # lent again and resumed: wait until it holds the device again
                node.placement.lend(NODE, 0, BORROWER)
                node.placement.resume(NODE, session)
                deadline = time.monotonic() + 30
                while node.session_state(session) != ("holding", None):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the resumed trainer did not get the device back within 30 s")
                    time.sleep(0.005)
            t0 = time.perf_counter()
            reply = node.placement.reclaim(NODE, 0, deadline_ms=30_000)
            calls.append((time.perf_counter() - t0) * 1000.0)
            free.append(reply.free_ms)
            for outcome in reply.outcomes.values():
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            park_ms, parked_bytes = _expect(queue, "park", 10.0)
            parks.append(park_ms)
            common.log(f"[reclaim] cooperative {i + 1}/{repeats}: device free {reply.free_ms:.1f} ms after the "
                       f"request ({reply.outcomes[session]}; the trainer's park took {park_ms:.1f} ms)")
        node.placement.resume(NODE, session)
        stop.set()
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {"free": free, "calls": calls, "parks": parks, "rtts": rtts, "outcomes": outcomes,
            "bytes_parked": parked_bytes}


def _enforced(node: _Node, repeats: int, deadline_ms: float, unit_rounds: int, device: str = "cpu") -> dict:
    free, calls, outcomes = [], [], {}
    for i in range(repeats):
        node.placement.lend(NODE, 0, BORROWER)
        queue = common.mp_context.Queue()
        proc = common.mp_context.Process(target=_stubborn_trainer, daemon=True,
                                         args=(queue, node.endpoint, unit_rounds, device))
        proc.start()
        try:
            (session,) = _expect(queue, "holding", _WORKER_START_S)
            t0 = time.perf_counter()
            reply = node.placement.reclaim(NODE, 0, deadline_ms=deadline_ms)
            calls.append((time.perf_counter() - t0) * 1000.0)
            free.append(reply.free_ms)
            for outcome in reply.outcomes.values():
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            common.log(f"[reclaim] enforced {i + 1}/{repeats}: device free {reply.free_ms:.1f} ms after the "
                       f"request ({reply.outcomes.get(session)}; deadline {deadline_ms:g} ms)")
        finally:
            os.kill(proc.pid, signal.SIGKILL)  # stopped by the daemon or not, it goes now
            proc.join()
        deadline = time.monotonic() + 10
        while node.session_state(session) is not None:  # its session ends with its process
            if time.monotonic() > deadline:
                raise RuntimeError(f"session {session} outlived its killed process")
            time.sleep(0.005)
    return {"free": free, "calls": calls, "outcomes": outcomes}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("reclaim", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip(),
                       endpoint_help="ignored: this benchmark always starts its own daemon (it needs the\n"
                       "                      cluster endpoint and keys made for the run)")
    ap.add_argument("--repeats", type=common.positive_int, default=5, help="reclaims per case (default: 5)")
    ap.add_argument("--state-mb", type=common.positive_int, default=256,
                    help="training state the cooperative trainer parks, in MiB (default: 256)")
    ap.add_argument("--deadline-ms", type=common.positive_float, default=200.0,
                    help="reclaim deadline of the enforced case (default: 200)")
    ap.add_argument("--unit-ms", type=common.positive_float, default=2.0,
                    help="the trainers' work unit between yield points (default: 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the trainers keep their state and compute (default: cpu)")
    ap.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE")
    args = ap.parse_args(argv)
    if os.environ.get(ENV_ENDPOINT):
        common.log(f"[reclaim] ignoring {ENV_ENDPOINT}: this benchmark starts its own daemon")

    wall0 = time.monotonic()
    unit_rounds = common.Work.calibrated(args.unit_ms).rounds
    workdir = tempfile.mkdtemp(prefix="nodeagent-bench-reclaim-")
    node, failed = None, True
    try:
        node = _Node(workdir, backend=common.daemon_backend(args.device))
        common.log(f"[reclaim] daemon pid={node.proc.pid}; cooperative trainer with {args.state_mb} MiB of state "
                   f"on {args.device}")
        coop = _cooperative(node, args.repeats, args.state_mb, unit_rounds, args.device)
        enforced = _enforced(node, args.repeats, args.deadline_ms, unit_rounds, args.device)
        failed = False
    finally:
        if node is not None:
            node.close()
            common.relay_log(node.log_path, everything=failed,
                             keep=lambda line: "[cluster] reclaimed" in line, last=12)
        shutil.rmtree(workdir, ignore_errors=True)

    med = statistics.median
    coop_ms, enforced_ms, park_ms = med(coop["free"]), med(enforced["free"]), med(coop["parks"])
    r = common.rounded
    result = {
        "benchmark": "reclaim",
        "backend": args.device,
        "daemon_backend": common.daemon_backend(args.device),
        "endpoint_kind": common.OWN,
        "transport": "tcp loopback, CURVE",
        "repeats": args.repeats,
        "samples": args.repeats,
        "state_mb": args.state_mb,
        "unit_ms": args.unit_ms,
        "deadline_ms": args.deadline_ms,
        "reclaim_cooperative_ms": r(coop_ms),
        "reclaim_cooperative_samples_ms": [r(v) for v in coop["free"]],
        "reclaim_enforced_ms": r(enforced_ms),
        "reclaim_enforced_samples_ms": [r(v) for v in enforced["free"]],
        "cooperative_call_ms": r(med(coop["calls"])),
        "enforced_call_ms": r(med(enforced["calls"])),
        "park_ms": r(park_ms),
        "park_samples_ms": [r(v) for v in coop["parks"]],
        "bytes_parked": coop["bytes_parked"],
        "rtt_ms": r(med(coop["rtts"])),
        "rtt_samples": len(coop["rtts"]),
        "cooperative_minus_park_ms": r(coop_ms - park_ms),
        "cooperative_over_park": r(coop_ms / park_ms, 2),
        "enforced_minus_deadline_ms": r(enforced_ms - args.deadline_ms),
        "enforced_over_deadline": r(enforced_ms / args.deadline_ms, 3),
        "outcomes": {"cooperative": coop["outcomes"], "enforced": enforced["outcomes"]},
    }
    common.log(f"[reclaim] cooperative: free {coop_ms:.1f} ms (park alone {park_ms:.1f} ms, no-op round trip "
               f"{result['rtt_ms']} ms); enforced: free {enforced_ms:.1f} ms with a {args.deadline_ms:g} ms "
               f"deadline; took {time.monotonic() - wall0:.1f} s")
    common.emit(result, args.json)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
