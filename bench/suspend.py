"""Suspend/resume: parking a training job's state in host memory and back, against a restart.

For each `--state-mb` size N, real training state of N MiB is built: fp32
parameters in tensors of 4 MiB, a gradient for each, and an Adam optimizer
after one step (exp_avg and exp_avg_sq for each parameter, plus its step
counters), so parameters are a quarter of N. `client_lib.torch.Yielder` parks
all of it and brings it back in place:

  suspend_ms   park(): copy into the host buffer and free the device memory
               (median of --repeats cycles, the host buffer already allocated)
  resume_ms    unpark(): regrow the memory and copy back (median)
  first_suspend_ms   the first park, which also allocates (and on CUDA pins)
               the host buffer (Yielder.reserve() moves that out of the way)

The baseline, in the same run, is the restart path that elastic schedulers
take: torch.save() of the same tensors (parameters, gradients, the optimizer's
state_dict) to a file in a temp dir on local disk plus fsync, then a fresh
`python -c` that imports torch, torch.load()s the file, rebuilds the
parameters, gradients and Adam optimizer from it and exits, timed end to end
from here:

  restart_ms   save_ms + process_ms (spawn, import torch, load, rebuild, exit);
               the median of --restart-repeats (default 1: each takes seconds)
  import_ms    a fresh `python -c "import torch"` alone: the part of
               process_ms that is only starting a process
  speedup      restart_ms / (suspend_ms + resume_ms)

The restart path here is a lower bound: the file is read back from the page
cache, and a real restart also re-creates the CUDA context, NCCL groups and
data loaders (DeepBoot measured 18-103 s per restart). Without CUDA (backend
"cpu") the "device" is host memory itself: park copies into a host buffer and
frees the original, unpark allocates it again and copies back; on a GPU the
same code copies over PCIe into pinned memory. Each size is checked after its
last cycle: the state is bit for bit what it was before, and the bytes copied
to the host (`bytes_copied`) are those of every storage on the device (on cuda
Adam keeps its step counters on the CPU; they are neither parked nor counted).
`bytes_parked` is the device memory the park released: on cpu the same
number, on cuda the drop of torch's reserved memory, which also counts the
cuBLAS workspaces and whole cached blocks, so it may differ. The GB/s figures
are bytes copied per second.

With the smallest size, one suspend and resume also go through a daemon (its
own, or NODEAGENT_ENDPOINT's): a client thread doing real work units with
`yield_point()` between them is suspended with `suspend_session` and resumed
with `resume_session` (`daemon_roundtrip`; `elapsed_ms` is the daemon's time
from the request to the device being free). `--no-daemon` skips it.

The rows above park in place (Yielder(keep_addresses=False): storages freed and
grown back at new addresses). `--keep-addresses` adds, per size, the same
cycles with the device addresses kept (`keep_addresses`: the state moved once
into regions of CUDA virtual memory, unmapped at a park and mapped again at the
same addresses at an unpark, each restore verified against checksums):

  adopt_ms     making the Yielder: moving the state into its regions (and
               pinning the host buffer)
  suspend_ms, resume_ms, *_gb_per_s   as above
  checksum_ms  of them, the park's checksums of the state (median)
  verify_ms    of them, the unpark's check of the restored state (median)
  addresses_kept   every tensor's data_ptr() after the last cycle is what it
               was after the Yielder was made

On cpu there is no device address to keep: the row says why instead.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

from bench import common
from client_lib import Client, resume_session, suspend_session
from client_lib.torch import ParkError, Yielder

_TENSOR_BYTES = 4 << 20  # one parameter tensor: 4 MiB of fp32
_BYTES_PER_PARAM_BYTE = 4  # parameter + gradient + exp_avg + exp_avg_sq
_CHILD_TIMEOUT_S = 120.0

# What the fresh process of the restart path runs: load the checkpoint and rebuild the training state.
_RESTORE_CODE = """
import sys, torch
ckpt = torch.load(sys.argv[1])
params = [torch.nn.Parameter(t) for t in ckpt["params"]]
for p, g in zip(params, ckpt["grads"]):
    p.grad = g
opt = torch.optim.Adam(params, lr=1e-3)
opt.load_state_dict(ckpt["optimizer"])
assert sum(p.numel() for p in params) == int(sys.argv[2])
"""


class TrainingState:
    """Parameters, gradients and Adam state adding up to ``state_mb`` MiB on ``device``."""

    def __init__(self, state_mb: int, device: torch.device) -> None:
        param_bytes = state_mb * (1 << 20) // _BYTES_PER_PARAM_BYTE
        count = max(1, param_bytes // _TENSOR_BYTES)
        numel = param_bytes // count // 4
        g = torch.Generator(device=device).manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(numel, generator=g, device=device)) for _ in range(count)]
        for p in self.params:
            p.grad = torch.randn(numel, generator=g, device=device)
        self.opt = torch.optim.Adam(self.params, lr=1e-3)
        self.opt.step()  # creates exp_avg and exp_avg_sq
        self.numel = numel * count

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.params) + [p.grad for p in self.params]
        for s in self.opt.state.values():
            out += [v for v in s.values() if isinstance(v, torch.Tensor)]
        return out

    def checkpoint(self) -> dict:
        return {"params": [p.detach() for p in self.params], "grads": [p.grad for p in self.params],
                "optimizer": self.opt.state_dict()}


def device_storage_bytes(tensors: list[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages among ``tensors`` that live on ``device`` ("cuda": any GPU),
    which is what Yielder parks: host tensors such as Adam's ``step`` stay where they are on a GPU."""
    storages: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.device.type != device.type or device.index is not None and t.device.index != device.index:
            continue
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr() or id(t))] = storage.nbytes()
    return sum(storages.values())


def state_verified(yielder: Yielder, bytes_expected: int, reference: list[torch.Tensor],
                   after: list[torch.Tensor]) -> bool:
    """The state came back bit for bit, and the last park moved all of it: ``bytes_copied``
    (the state moved to the host) is the device storages' bytes. Not ``bytes_parked``: that
    is the device memory released, which on cuda is the drop of torch's reserved memory
    (cuBLAS workspaces and whole cached blocks included) and so need not equal it."""
    return yielder.bytes_copied == bytes_expected and all(torch.equal(a, b) for a, b in zip(after, reference))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_ms(fn, device: torch.device) -> float:
    _synchronize(device)
    t0 = time.perf_counter()
    fn()
    _synchronize(device)
    return (time.perf_counter() - t0) * 1000.0


def _restart_path(state: TrainingState, workdir: str) -> dict:
    """torch.save + fsync, then a fresh process that loads and rebuilds; times in ms."""
    path = os.path.join(workdir, "checkpoint.pt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state.checkpoint(), f)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _RESTORE_CODE, path, str(state.numel)], check=True,
                   timeout=_CHILD_TIMEOUT_S)
    t2 = time.perf_counter()
    file_bytes = os.path.getsize(path)
    os.unlink(path)
    return {"save_ms": (t1 - t0) * 1000.0, "process_ms": (t2 - t1) * 1000.0, "file_bytes": file_bytes}


def _import_ms() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=_CHILD_TIMEOUT_S)
    return (time.perf_counter() - t0) * 1000.0


def _measure_size(state_mb: int, repeats: int, restart_repeats: int, device: torch.device, workdir: str,
                  roundtrip: bool, keep_addresses: bool = False) -> tuple[dict, dict | None]:
    common.log(f"[suspend] {state_mb} MiB: building parameters, gradients and Adam state")
    state = TrainingState(state_mb, device)
    # The optimizer's params and grads, and its state; parked in place (addresses not kept).
    yielder = Yielder(modules=(), optimizers=[state.opt], keep_addresses=False)
    reference = [t.detach().clone() for t in (state.params[0], state.params[-1].grad,
                                               *state.opt.state[state.params[-1]].values())]
    bytes_expected = device_storage_bytes(state.tensors(), device)

    first_suspend_ms = _timed_ms(yielder.park, device)
    bytes_parked, bytes_copied = yielder.bytes_parked, yielder.bytes_copied
    first_resume_ms = _timed_ms(yielder.unpark, device)
    suspends, resumes = [], []
    for _ in range(repeats):
        suspends.append(_timed_ms(yielder.park, device))
        resumes.append(_timed_ms(yielder.unpark, device))
    after = [state.params[0], state.params[-1].grad, *state.opt.state[state.params[-1]].values()]
    verified = state_verified(yielder, bytes_expected, reference, after)
    suspend_ms, resume_ms = statistics.median(suspends), statistics.median(resumes)
    common.log(f"[suspend] {state_mb} MiB: park {suspend_ms:.1f} ms, unpark {resume_ms:.1f} ms "
               f"(first park {first_suspend_ms:.1f} ms); restart path next")

    restarts = [_restart_path(state, workdir) for _ in range(restart_repeats)]
    restart_ms = statistics.median(r["save_ms"] + r["process_ms"] for r in restarts)
    restart = min(restarts, key=lambda r: abs(r["save_ms"] + r["process_ms"] - restart_ms))
    daemon_result = _daemon_roundtrip(state, yielder, state_mb) if roundtrip else None
    result = {
        "state_mb": state_mb,
        "bytes_parked": bytes_parked,
        "bytes_copied": bytes_copied,
        "tensors": len(state.tensors()),
        "suspend_ms": common.rounded(suspend_ms),
        "resume_ms": common.rounded(resume_ms),
        "suspend_samples_ms": [common.rounded(v) for v in suspends],
        "resume_samples_ms": [common.rounded(v) for v in resumes],
        "first_suspend_ms": common.rounded(first_suspend_ms),
        "first_resume_ms": common.rounded(first_resume_ms),
        "suspend_gb_per_s": common.rounded(bytes_copied / 1e6 / suspend_ms, 2),
        "resume_gb_per_s": common.rounded(bytes_copied / 1e6 / resume_ms, 2),
        "restart_ms": common.rounded(restart_ms),
        "restart_samples_ms": [common.rounded(r["save_ms"] + r["process_ms"]) for r in restarts],
        "save_ms": common.rounded(restart["save_ms"]),
        "process_ms": common.rounded(restart["process_ms"]),
        "checkpoint_bytes": restart["file_bytes"],
        "speedup": common.rounded(restart_ms / (suspend_ms + resume_ms), 2),
        "bytes_expected": bytes_expected,
        "verified": verified,
    }
    common.log(f"[suspend] {state_mb} MiB: restart {restart_ms:.0f} ms (save {restart['save_ms']:.0f} + "
               f"process {restart['process_ms']:.0f}); speedup {result['speedup']}x")
    yielder.client = None
    del yielder  # its pinned host buffer goes before the next one is pinned
    gc.collect()
    if keep_addresses:
        result["keep_addresses"] = _measure_keeping_addresses(state, state_mb, repeats, device, bytes_expected)
    del state
    return result, daemon_result


def pinned_memcpy_ms(nbytes: int, repeats: int, device: torch.device) -> tuple[float, float] | None:
    """Medians of one pinned cudaMemcpy of ``nbytes`` device to host and host to device (None off cuda)."""
    if device.type != "cuda" or nbytes <= 0:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(repeats + 1):  # the first left out, as for the park
        d2h.append(_timed_ms(lambda: host.copy_(src, non_blocking=True), device))
        h2d.append(_timed_ms(lambda: src.copy_(host, non_blocking=True), device))
    del src, host
    return statistics.median(d2h[1:]), statistics.median(h2d[1:])


def _measure_keeping_addresses(state: TrainingState, state_mb: int, repeats: int, device: torch.device,
                               bytes_expected: int) -> dict:
    """Park and unpark ``state`` with its device addresses kept; timings as for the in-place rows."""
    t0 = time.perf_counter()
    try:
        yielder = Yielder(modules=(), optimizers=[state.opt], keep_addresses=True)
    except ParkError as exc:
        common.log(f"[suspend] {state_mb} MiB keeping addresses: not here ({exc})")
        return {"skipped": str(exc)}
    adopt_ms = (time.perf_counter() - t0) * 1000.0
    tensors = state.tensors()
    addresses = [t.data_ptr() for t in tensors]
    reference = [t.detach().clone() for t in (state.params[0], state.params[-1].grad,
                                               *state.opt.state[state.params[-1]].values())]
    suspends, resumes, checksums, verifies = [], [], [], []
    for _ in range(repeats + 1):  # the first cycle is left out of the medians, as above
        suspends.append(_timed_ms(yielder.park, device))
        checksums.append(yielder.checksum_ms)
        resumes.append(_timed_ms(yielder.unpark, device))
        verifies.append(yielder.verify_ms)
    after = [state.params[0], state.params[-1].grad, *state.opt.state[state.params[-1]].values()]
    suspend_ms, resume_ms = statistics.median(suspends[1:]), statistics.median(resumes[1:])
    memcpy = pinned_memcpy_ms(yielder.bytes_copied, repeats, device)
    out = {
        "adopt_ms": common.rounded(adopt_ms),
        "bytes_copied": yielder.bytes_copied,  # the regions' spans: the state, each region rounded up to 64 KiB
        "bytes_parked": yielder.bytes_parked,
        "suspend_ms": common.rounded(suspend_ms),
        "resume_ms": common.rounded(resume_ms),
        "suspend_samples_ms": [common.rounded(v) for v in suspends[1:]],
        "resume_samples_ms": [common.rounded(v) for v in resumes[1:]],
        "suspend_gb_per_s": common.rounded(yielder.bytes_copied / 1e6 / suspend_ms, 2),
        "resume_gb_per_s": common.rounded(yielder.bytes_copied / 1e6 / resume_ms, 2),
        "checksum_ms": common.rounded(statistics.median(checksums[1:])),
        "verify_ms": common.rounded(statistics.median(verifies[1:])),
        "addresses_kept": [t.data_ptr() for t in tensors] == addresses,
        # The baseline, same run and bytes: one pinned cudaMemcpy each way; goal: the park and the
        # unpark at >= 90% of its rate (issue 33).
        "memcpy_d2h_ms": memcpy and common.rounded(memcpy[0]), "memcpy_h2d_ms": memcpy and common.rounded(memcpy[1]),
        "park_of_memcpy": memcpy and common.rounded(memcpy[0] / suspend_ms, 3),
        "unpark_of_memcpy": memcpy and common.rounded(memcpy[1] / resume_ms, 3),
        "verified": yielder.bytes_copied >= bytes_expected and all(torch.equal(a, b) for a, b in
                                                                    zip(after, reference)),
    }
    common.log(f"[suspend] {state_mb} MiB keeping addresses: park {suspend_ms:.1f} ms "
               f"({out['suspend_gb_per_s']} GB/s), unpark {resume_ms:.1f} ms ({out['resume_gb_per_s']} GB/s), "
               f"of which checksums {out['checksum_ms']} ms + verify {out['verify_ms']} ms; "
               f"moving the state in {adopt_ms:.0f} ms; addresses kept: {out['addresses_kept']}")
    return out


def _daemon_roundtrip(state: TrainingState, yielder: Yielder, state_mb: int) -> dict:
    """One suspend and resume of a client thread holding ``state``, through a daemon."""
    with common.daemon(backend=common.daemon_backend(state.params[0].device.type)) as handle:
        work = common.Work.calibrated(1.0)
        ready, stop = threading.Event(), threading.Event()
        box: dict = {}

        def trainer() -> None:
            try:
                client = Client("bench-suspend", workload="training", endpoint=handle.endpoint)
                client.set_suspend_handlers(yielder.park, yielder.unpark)
                box["client"] = client
                with client.slice():
                    ready.set()
                    while not stop.is_set():
                        work()
                        client.yield_point()
                box["last_suspend"] = client.last_suspend
                client.close()
            except BaseException as exc:  # reported below
                box["error"] = exc
                ready.set()

        thread = threading.Thread(target=trainer, name="bench-suspend-trainer", daemon=True)
        thread.start()
        if not ready.wait(30) or "error" in box:
            raise RuntimeError(f"the trainer thread did not start: {box.get('error')}")
        session = box["client"].session_id
        t0 = time.perf_counter()
        result = suspend_session(session, deadline_ms=10_000, endpoint=handle.endpoint)
        suspend_wall_ms = (time.perf_counter() - t0) * 1000.0
        parked_while_suspended = yielder.parked
        resume_session(session, endpoint=handle.endpoint)
        stop.set()
        thread.join(30)
        if thread.is_alive() or "error" in box:
            raise RuntimeError(f"the trainer thread failed: {box.get('error', 'still running')}")
        bytes_parked, client_suspend_ms, client_resume_ms = box["last_suspend"]
    out = {
        "state_mb": state_mb,
        "endpoint_kind": handle.kind,
        "outcome": result.outcome,
        "bytes_parked": result.bytes_parked,
        "parked_while_suspended": parked_while_suspended,
        "elapsed_ms": common.rounded(result.elapsed_ms),
        "suspend_call_ms": common.rounded(suspend_wall_ms),
        "client_suspend_ms": common.rounded(client_suspend_ms),
        "client_resume_ms": common.rounded(client_resume_ms),
    }
    common.log(f"[suspend] through the daemon ({handle.kind}), {state_mb} MiB: {result.outcome}, device free "
               f"{result.elapsed_ms:.1f} ms after the request (client's park {client_suspend_ms:.1f} ms), "
               f"resume {client_resume_ms:.1f} ms")
    return out


def _sizes(text: str) -> list[int]:
    sizes = [common.positive_int(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError("give at least one size")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("suspend", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip(),
                       endpoint_help="the daemon_roundtrip goes through the daemon there instead of a\n"
                       "                      private one (the timings themselves need no daemon)")
    ap.add_argument("--state-mb", type=_sizes, default=[256, 1024],
                    help="training state sizes in MiB, comma-separated (default: 256,1024)")
    ap.add_argument("--repeats", type=common.positive_int, default=5,
                    help="park/unpark cycles per size after the first (default: 5)")
    ap.add_argument("--restart-repeats", type=common.positive_int, default=1,
                    help="restarts per size; restart_ms is their median (default: 1)")
    ap.add_argument("--device", default=None,
                    help="where the state lives: cuda when available, else cpu (default)")
    ap.add_argument("--no-daemon", action="store_true",
                    help="skip the one suspend and resume through a daemon")
    ap.add_argument("--keep-addresses", action="store_true",
                    help="also park and unpark each size with its device addresses kept (cuda)")
    args = ap.parse_args(argv)

    wall0 = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    workdir = tempfile.mkdtemp(prefix="nodeagent-bench-suspend-")
    smallest = min(args.state_mb)
    sizes, roundtrip = {}, None
    try:
        import_ms = _import_ms()
        for state_mb in args.state_mb:
            want_roundtrip = not args.no_daemon and state_mb == smallest and roundtrip is None
            sizes[str(state_mb)], got = _measure_size(state_mb, args.repeats, args.restart_repeats, device,
                                                      workdir, roundtrip=want_roundtrip,
                                                      keep_addresses=args.keep_addresses)
            roundtrip = roundtrip or got
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    speedups = [s["speedup"] for s in sizes.values()]
    result = {
        "benchmark": "suspend",
        "backend": device.type,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "endpoint_kind": roundtrip["endpoint_kind"] if roundtrip else None,
        "state_counts": "fp32 params in 4 MiB tensors + grads + Adam exp_avg/exp_avg_sq (+ step counters)",
        "state_mb": args.state_mb,
        "repeats": args.repeats,
        "restart_repeats": args.restart_repeats,
        "samples": args.repeats,
        "torch": torch.__version__,
        "import_ms": common.rounded(import_ms),
        "sizes": sizes,
        "min_speedup": min(speedups),
        "goal_speedup": 100,
        "goal_met": min(speedups) >= 100,
        "all_verified": all(s["verified"] and s.get("keep_addresses", {}).get("verified", True)
                            for s in sizes.values()),
        "keep_addresses": args.keep_addresses,
        "daemon_roundtrip": roundtrip,
    }
    common.log(f"[suspend] speedup over a restart {', '.join(f'{k} MiB {v}x' for k, v in zip(sizes, speedups))} "
               f"(goal >= 100x: {'met' if result['goal_met'] else 'MISSED'}; backend {device.type}); "
               f"took {time.monotonic() - wall0:.1f} s")
    common.emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
