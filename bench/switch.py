"""Switch latency: model A is active, a request for model B arrives; how long until B's output is ready?

For each model B in --models (with A the model before it in the list, or a
small filler model when only one is given), six ways, in one run, on one
ctxpool.engine.Engine:

  ready_ms       B is already resident; A ran just before
  pipelined_ms   B is not resident: the engine's pipelined swap-in (its layer
                 groups copy on the copy stream/thread while compute runs the
                 groups already there)
  sequential_ms  B is not resident: the engine copies all of B, the CPU waits
                 until the copy has finished, then launches compute
  warm_pageable_ms   a warm process without the engine: a second copy of B in
                 ordinary (pageable) host memory, model.to(device), then run
  pinned_sync_ms     the same from page-locked host memory: every tensor copied
                 with non_blocking=True, the CPU synchronised, then run
  cold_ms        stop-and-start: a new process starts python, imports torch,
                 builds B (meta device), loads its weights from a state-dict
                 file saved once, moves it to the device and runs one batch;
                 from before the spawn (our clock) to the child's report that
                 its output is ready (its CLOCK_MONOTONIC)

Each warm way is the median of --repeats samples (the ways interleaved, A run
before every sample); cold the median of --cold-repeats. overhead_ratio =
(pipelined - ready) / (cold - ready) is PipeSwitch's framing (0.11% on a
V100): the part of a stop-and-start that the switch still costs. Every
sample's output is checked against the ready output: bitwise where the same
kernels run (outputs_equal; always on cpu), within TF32 error on cuda
(outputs_close); the cold child's output checksum must match. On cuda,
h2d_gbps is the pinned host-to-device bandwidth the engine measured in this
run and swap_efficiency = model_bytes / h2d bandwidth / the pipelined swap's
copy-stream busy time. B's weights are placed in one host buffer at 512-byte
aligned offsets first, as the daemon's model store places them.

On cpu the "device" is host memory: the copy is a memmove on a copy thread
into a pool reserved at warm-up. A GPU copies with a DMA engine beside its
SMs; the cpu stand-in for that is a core left to the copy thread, so by
default torch computes on all cores but one there (--threads; with every
core computing, the memmove takes its core from the OpenMP team and the
overlap buys nothing). Images are 112x112 and sequences 64 tokens on cpu by
default (224 and 128 on cuda) so that a full run takes minutes, not tens of
minutes, on 2 cores; the sizes and thread count used are in the result.
*_paired keys are medians of per-repeat ratios (the modes of one repeat
run back to back), steadier than ratios of medians on a busy machine.
The 50x goal (cold over pipelined) is a GPU goal and is not judged on cpu:
there the forward pass itself is most of every warm time and two cores
cannot overlap a copy with compute (goal_note says so in the result).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common, models
from ctxpool.engine import Engine

REPO = Path(__file__).resolve().parent.parent
_CHILD_TIMEOUT_S = 300.0
_FILLER = "tiny-cnn"
GOAL_COLD_OVER_PIPELINED = 50.0
ENGINE_MODES = ("ready", "pipelined", "sequential")
BASELINES = ("warm_pageable", "pinned_sync")
MODES = ENGINE_MODES + BASELINES
CPU_GOAL_NOTE = ("the 50x goal (cold over pipelined) is a GPU goal and is not judged on cpu: here the forward "
                 "pass on a CPU core is most of every warm time, and two cores cannot overlap a copy with "
                 "compute the way a GPU's copy engine does beside its SMs, while cold is mostly starting Python "
                 "and importing torch; overhead_ratio and the *_over_* ratios say what the switch costs")
_ALIGN_BYTES = 512


def unique_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer object of ``module`` once (tied weights are one), in registration order."""
    seen, out = set(), []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _outputs_equal(a, b) -> bool:
    a, b = _as_tuple(a), _as_tuple(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _outputs_close(a, b) -> bool:
    """Equal within what TF32 (on by default for cuDNN convolutions) and other kernels may change."""
    a, b = _as_tuple(a), _as_tuple(b)
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-2 * max(1.0, float(y.abs().max())))
        for x, y in zip(a, b))


def pack_host(module: torch.nn.Module) -> int:
    """Move every parameter and buffer of ``module`` into one host buffer, each at a 512-byte aligned
    offset, as the daemon's model store lays out a model (so the engine copies neighbours as one
    span and places each 512-aligned on the device). Returns the buffer's size."""
    tensors = [t for t in unique_tensors(module) if t.numel() and t.data.is_contiguous()]
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN_BYTES) * _ALIGN_BYTES
    buf = torch.empty(max(total, 1), dtype=torch.uint8)
    for t, off, n in zip(tensors, offsets, sizes):
        view = buf[off:off + n].view(t.dtype).view(t.shape)
        view.copy_(t.data)
        t.data = view
    return total


class WarmProcess:
    """The warm-process baselines: a copy of B outside the engine, moved with torch's own copies.

    ``warm_pageable``: ``.to(device)`` from ordinary host memory (on cpu, where ``.to("cpu")`` is a
    no-op, a clone: the same bytes written to fresh memory). ``pinned_sync``: from page-locked
    copies, ``non_blocking=True``, then the CPU synchronises before compute (on cpu: as pageable)."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module = module.eval()
        self.device = device
        self.tensors = unique_tensors(module)
        self.host = [t.data for t in self.tensors]
        self.pinned = [h.pin_memory() for h in self.host] if device.type == "cuda" else self.host

    def run(self, way: str, x: torch.Tensor):
        """(output, ms from the request to the output ready); B goes back to host memory after."""
        _synchronize(self.device)
        t0 = time.perf_counter()
        try:
            if self.device.type == "cpu":
                for t, h in zip(self.tensors, self.host):
                    t.data = h.clone()
            elif way == "warm_pageable":
                for t, h in zip(self.tensors, self.host):
                    t.data = h.to(self.device)
            else:
                for t, h in zip(self.tensors, self.pinned):
                    t.data = h.to(self.device, non_blocking=True)
                torch.cuda.synchronize(self.device)  # the CPU waits for the copies
            with torch.no_grad():
                out = self.module(x.to(self.device))
            _synchronize(self.device)
            ms = (time.perf_counter() - t0) * 1000.0
        finally:
            for t, h in zip(self.tensors, self.host):
                t.data = h
        return out, ms


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cold_start(name: str, weights: str, args, device: str) -> tuple[float, float]:
    """One stop-and-start of ``name``: (ms from before the spawn to the child's output ready, checksum)."""
    cmd = [sys.executable, "-m", "bench.models", "cold", "--model", name, "--weights", weights,
           "--device", device, "--batch", str(args.batch), "--input-size", str(args.input_size),
           "--seq-len", str(args.seq_len), "--threads", str(torch.get_num_threads())]
    t0_ns = time.monotonic_ns()
    out = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"the cold-start child for {name} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    ready = [line.split() for line in out.stdout.splitlines() if line.startswith("ready ")]
    if not ready:
        raise RuntimeError(f"the cold-start child for {name} reported nothing:\n{out.stdout[-2000:]}")
    _, ready_ns, checksum = ready[-1]
    return (int(ready_ns) - t0_ns) / 1e6, float(checksum)


def _timed(engine: Engine, name: str, x: torch.Tensor, mode: str):
    t0 = time.perf_counter()
    out, stats = engine.infer(name, (x,), mode="pipelined" if mode == "ready" else mode)
    elapsed_ms = (time.perf_counter() - t0) * 1000.0
    if stats.swap != mode:
        raise RuntimeError(f"expected a {mode!r} run of {name}, the engine did {stats.swap!r}")
    return out, stats, elapsed_ms


def _measure(engine: Engine, b: str, a: str, inputs: dict, repeats: int, warm: WarmProcess) -> dict:
    """Samples of every way of B after A ran; the ways rotate from repeat to repeat."""
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    transfer: dict[str, list[float]] = {m: [] for m in ENGINE_MODES}
    reference, _ = engine.infer(b, (inputs[b],))  # resident after this: the ready output
    equal = {m: True for m in MODES}
    close = True
    for r in range(repeats):
        k = r % len(MODES)
        for mode in MODES[k:] + MODES[:k]:
            if mode == "ready":
                engine.infer(b, (inputs[b],))  # make sure B is resident
            else:
                engine.evict(b)  # a baseline too: B's engine copy is not on the device
            engine.infer(a, (inputs[a],))  # A is active: resident and just ran
            if mode in BASELINES:
                out, ms = warm.run(mode, inputs[b])
            else:
                out, stats, ms = _timed(engine, b, inputs[b], mode)
                transfer[mode].append(stats.transfer_s)
            equal[mode] = equal[mode] and _outputs_equal(out, reference)
            close = close and _outputs_close(out, reference)
            samples[mode].append(ms)
            del out
        common.log(f"[switch] {b} after {a}: repeat {r + 1}/{repeats}: " +
                   ", ".join(f"{m} {samples[m][-1]:.1f} ms" for m in MODES))
    return {"samples": samples, "transfer_s": transfer, "equal": equal, "outputs_close": close,
            "reference": reference}


def _overhead(pipelined_ms: float, ready_ms: float, cold_ms: float) -> float:
    """PipeSwitch's overhead: what the switch adds to a ready run, as a part of what a restart adds."""
    return (pipelined_ms - ready_ms) / max(cold_ms - ready_ms, 1e-9)


def _paired(samples: dict[str, list[float]], top: str, bottom: str) -> float | None:
    return common.rounded(statistics.median(a / b for a, b in zip(samples[top], samples[bottom])), 3)


def _plot(results: dict, path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'nodeagent[plot]' (or matplotlib)") from None
    names = list(results)
    keys = [("ready_ms", "ready"), ("pipelined_ms", "pipelined"), ("sequential_ms", "sequential"),
            ("pinned_sync_ms", "pinned, synchronised"), ("warm_pageable_ms", "warm, pageable .to()"),
            ("cold_ms", "cold (stop-and-start)")]
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(2.6 * len(names) + 3, 4.5))
    for i, (key, label) in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(names))]
        values = [results[n][key] for n in names]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in values], fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms from request to output ready (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _model_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one model")
    for n in names:
        try:
            models.spec(n)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"each model once, got {text}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("switch", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip(),
                       endpoint_help="not used: the engine runs in this process")
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda when available, else cpu")
    ap.add_argument("--device-index", type=int, default=0)
    ap.add_argument("--models", type=_model_list, default=["resnet50", "bert-base", "resnet152"],
                    help=f"comma-separated, from {', '.join(models.MODELS)} (default: resnet50,bert-base,resnet152)")
    ap.add_argument("--batch", type=common.positive_int, default=8)
    ap.add_argument("--input-size", type=common.positive_int, default=None,
                    help="image side in pixels (default: 224 on cuda, 112 on cpu)")
    ap.add_argument("--seq-len", type=common.positive_int, default=None,
                    help="tokens per sequence for bert-base (default: 128 on cuda, 64 on cpu)")
    ap.add_argument("--repeats", type=common.positive_int, default=5, help="samples per mode (default: 5)")
    ap.add_argument("--cold-repeats", type=common.positive_int, default=3, help="cold starts (default: 3)")
    ap.add_argument("--threads", type=common.positive_int, default=None,
                    help="torch intra-op threads here and in the cold child (default: cpu: all cores but one, "
                         "cuda: torch's own)")
    ap.add_argument("--out", default=None, help="also write the JSON result to this file")
    ap.add_argument("--plot", default=None, help="write a bar chart PNG here (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install 'nodeagent[plot]' (or matplotlib)")
    cpu = args.backend == "cpu"
    args.input_size = args.input_size or (112 if cpu else 224)
    args.seq_len = args.seq_len or (64 if cpu else 128)
    if args.threads or cpu:
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))

    wall0 = time.monotonic()
    load_before = os.getloadavg()
    engine = Engine(args.backend, args.device_index)
    device = "cpu" if cpu else f"cuda:{args.device_index}"
    warm_device = torch.device(device)
    names = list(args.models)
    filler = [f"filler:{_FILLER}"] if len(names) == 1 else []  # another model to be "A"
    workdir = tempfile.mkdtemp(prefix="nodeagent-bench-switch-")
    try:
        built, inputs, weights, warm = {}, {}, {}, {}
        for n in names + filler:
            common.log(f"[switch] building {n} (random weights) and saving its state dict")
            kind = n.rpartition(":")[2]
            built[n] = models.build(kind, seed=1 if n in filler else 0)
            inputs[n] = models.example_input(kind, args.batch, args.input_size, args.seq_len)
            weights[n] = os.path.join(workdir, f"{n}.pt")
            torch.save(built[n].state_dict(), weights[n])
            if n not in filler:
                warm[n] = WarmProcess(copy.deepcopy(built[n]), warm_device)  # before packing: torch's own layout
            pack_host(built[n])
        host_bytes = sum(t.numel() * t.element_size() for m in built.values() for t in m.state_dict().values())
        pool_bytes = int(host_bytes * 1.1) + (64 << 20)
        warm_s = engine.warm_up(pool_bytes)
        common.log(f"[switch] engine warm on {device} in {warm_s * 1e3:.0f} ms, pool {pool_bytes >> 20} MiB, "
                   f"copy {engine.bytes_per_s / 1e9:.2f} GB/s")
        plans = {}
        for n in names + filler:
            t0 = time.perf_counter()
            plans[n] = engine.add_model(n, built[n], (inputs[n],))
            common.log(f"[switch] registered {n}: {plans[n].model_bytes / 1e6:.1f} MB, {len(plans[n].layers)} layers "
                       f"in {len(plans[n].groups)} groups ({time.perf_counter() - t0:.1f} s to profile)")
        results = {}
        for i, b in enumerate(names):
            a = filler[0] if filler else names[i - 1]
            m = _measure(engine, b, a, inputs, args.repeats, warm.pop(b))
            common.log(f"[switch] {b}: cold starts next ({args.cold_repeats})")
            cold = [_cold_start(b, weights[b], args, device) for _ in range(args.cold_repeats)]
            cold_checksum = models.checksum(m["reference"])
            tolerance = 1e-4 if cpu else 1e-2  # on cuda other kernels, TF32
            cold_match = all(abs(c - cold_checksum) <= tolerance * max(1.0, abs(cold_checksum)) for _, c in cold)
            med = {mode: statistics.median(v) for mode, v in m["samples"].items()}
            cold_ms = statistics.median(ms for ms, _ in cold)
            plan = plans[b]
            r = {
                "after": a,
                "ready_ms": common.rounded(med["ready"]),
                "pipelined_ms": common.rounded(med["pipelined"]),
                "sequential_ms": common.rounded(med["sequential"]),
                "warm_pageable_ms": common.rounded(med["warm_pageable"]),
                "pinned_sync_ms": common.rounded(med["pinned_sync"]),
                "cold_ms": common.rounded(cold_ms),
                "overhead_ratio": common.rounded(_overhead(med["pipelined"], med["ready"], cold_ms), 5),
                "model_bytes": plan.model_bytes,
                "params": models.param_count(built[b]),
                "groups": len(plan.groups),
                "layers": len(plan.layers),
                "first_group_bytes": sum(plan.layers[j].bytes for j in plan.groups[0]),
                "cold_over_pipelined": common.rounded(cold_ms / med["pipelined"], 2),
                "pipelined_over_sequential": common.rounded(med["pipelined"] / med["sequential"], 3),
                "pipelined_over_ready": common.rounded(med["pipelined"] / med["ready"], 3),
                "pipelined_over_sequential_paired": _paired(m["samples"], "pipelined", "sequential"),
                "pipelined_over_ready_paired": _paired(m["samples"], "pipelined", "ready"),
                "pipelined_transfer_ms": common.rounded(statistics.median(m["transfer_s"]["pipelined"]) * 1e3),
                "sequential_transfer_ms": common.rounded(statistics.median(m["transfer_s"]["sequential"]) * 1e3),
                "ready_samples_ms": [common.rounded(v) for v in m["samples"]["ready"]],
                "pipelined_samples_ms": [common.rounded(v) for v in m["samples"]["pipelined"]],
                "sequential_samples_ms": [common.rounded(v) for v in m["samples"]["sequential"]],
                "warm_pageable_samples_ms": [common.rounded(v) for v in m["samples"]["warm_pageable"]],
                "pinned_sync_samples_ms": [common.rounded(v) for v in m["samples"]["pinned_sync"]],
                "cold_samples_ms": [common.rounded(ms) for ms, _ in cold],
                "outputs_equal": all(m["equal"][mode] for mode in ENGINE_MODES),
                "outputs_equal_by_way": m["equal"],
                "outputs_close": m["outputs_close"],
                "cold_output_matches": cold_match,
            }
            if not cpu:
                transfer_s = statistics.median(m["transfer_s"]["pipelined"])
                r["h2d_gbps"] = common.rounded(engine.bytes_per_s / 1e9, 2)
                r["swap_efficiency"] = common.rounded(plan.model_bytes / engine.bytes_per_s / transfer_s, 3)
            results[b] = r
            common.log(f"[switch] {b}: ready {r['ready_ms']:.1f} ms, pipelined {r['pipelined_ms']:.1f} ms, "
                       f"sequential {r['sequential_ms']:.1f} ms, pinned+sync {r['pinned_sync_ms']:.1f} ms, "
                       f"warm pageable {r['warm_pageable_ms']:.1f} ms, cold {r['cold_ms']:.0f} ms: cold/pipelined "
                       f"{r['cold_over_pipelined']}x, pipelined/sequential {r['pipelined_over_sequential']}, "
                       f"pipelined/ready {r['pipelined_over_ready']}, overhead ratio {r['overhead_ratio']}")
    finally:
        engine.close()
        shutil.rmtree(workdir, ignore_errors=True)

    min_cold_ratio = min(r["cold_over_pipelined"] for r in results.values())
    never_slower = all(r["pipelined_ms"] <= r["sequential_ms"] for r in results.values())
    goal_met = None if cpu else min_cold_ratio >= GOAL_COLD_OVER_PIPELINED
    result = {
        "benchmark": "switch",
        "backend": args.backend,
        "device": (f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})" if cpu
                   else torch.cuda.get_device_name(args.device_index)),
        "endpoint_kind": None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "batch": args.batch,
        "input_size": args.input_size,
        "seq_len": args.seq_len,
        "cpu_note": (f"the device is host memory; compute on {torch.get_num_threads()} of {os.cpu_count()} cores, "
                     "the copy thread's memmove beside it; inputs reduced from 224 px / 128 tokens "
                     "to keep a cpu run short" if cpu else None),
        "repeats": args.repeats,
        "cold_repeats": args.cold_repeats,
        "samples": args.repeats,
        "copy_gbps": common.rounded(engine.bytes_per_s / 1e9, 2),
        "pool_bytes": pool_bytes,
        "models": results,
        "min_cold_over_pipelined": min_cold_ratio,
        "max_overhead_ratio": max(r["overhead_ratio"] for r in results.values()),
        "goal_cold_over_pipelined": None if cpu else GOAL_COLD_OVER_PIPELINED,
        "goal_cold_met": goal_met,
        "goal_note": CPU_GOAL_NOTE if cpu else None,
        "pipelined_never_slower": never_slower,
        "all_outputs_equal": all(r["outputs_equal"] and r["cold_output_matches"] for r in results.values()),
        "all_outputs_close": all(r["outputs_close"] and r["cold_output_matches"] for r in results.values()),
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "took_s": round(time.monotonic() - wall0, 1),
    }
    verdict = ("not judged on cpu" if goal_met is None else "met" if goal_met else "MISSED")
    common.log(f"[switch] cold/pipelined min {min_cold_ratio}x (goal >= {GOAL_COLD_OVER_PIPELINED:.0f}x: {verdict}); "
               f"overhead ratio max {result['max_overhead_ratio']}; pipelined never slower than sequential: "
               f"{never_slower}; took {result['took_s']} s")
    if cpu:
        common.log(f"[switch] note: {CPU_GOAL_NOTE}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result) + "\n")  # what --json prints
    if args.plot:
        _plot(results, args.plot, f"switch latency, {result['device']}, batch {args.batch}, "
                                  f"{args.input_size}px / {args.seq_len} tokens (median of {args.repeats})")
    common.emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
