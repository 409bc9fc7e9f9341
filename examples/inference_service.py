"""An inference service that shares its GPU through nodeagent: one slice per request.

Requests arrive at random (Poisson, ``--rate`` a second) for ``--seconds``; each
takes the device's token for the length of one forward pass, with its result in
host memory before the slice ends, and its latency is counted from its arrival,
so the time it waited for the token is in it. Every ``--every`` seconds, and at
the end, it prints p50 and p99 latency and how long requests waited for the
token. Beside ``examples/train_loop.py`` this is the README's walkthrough:

    nodeagent serve &
    python examples/train_loop.py --steps 3000 &
    python examples/inference_service.py --seconds 20

``NODEAGENT_ENDPOINT`` picks another daemon. With ``--device cpu`` (what
``auto`` picks without CUDA) the "device" is host memory and the same code
runs. The Client comes before anything touches CUDA (see train_loop.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from client_lib import Client


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def report(label: str, latency_ms: list[float], wait_ms: list[float]) -> str:
    if not latency_ms:
        return f"{label}: no requests yet"
    return (f"{label}: {len(latency_ms)} requests  latency p50 {statistics.median(latency_ms):.1f} ms  "
            f"p99 {percentile(latency_ms, 99):.1f} ms  token wait p50 {statistics.median(wait_ms):.2f} ms  "
            f"p99 {percentile(wait_ms, 99):.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--seconds", type=float, default=20.0, help="how long requests arrive (default: 20)")
    ap.add_argument("--rate", type=float, default=20.0, help="requests a second, Poisson arrivals (default: 20)")
    ap.add_argument("--batch", type=int, default=8, help="inputs per request (default: 8)")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between progress lines (default: 5)")
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto: cuda when there is one")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.seconds <= 0 or args.rate <= 0 or args.batch <= 0 or args.every <= 0:
        ap.error("--seconds, --rate, --batch and --every must be positive")
    # A first line at once: torch takes seconds to import, and a silent start looks hung.
    print("inference_service: loading torch ...", flush=True)
    import torch

    with Client("examples/inference_service", workload="inference") as client:
        if args.device == "auto":  # only now may CUDA start (see train_loop.py)
            args.device = client.cuda_device if torch.cuda.is_available() else "cpu"
        torch.manual_seed(args.seed)
        device = torch.device(args.device)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10)).to(device).eval()
        x = torch.randn(args.batch, 256, device=device)
        with torch.inference_mode(), client.slice():  # one warm-up pass, not counted
            model(x).cpu()
        print(f"session {client.session_id} on device {client.device}: {args.rate:g} requests a second "
              f"for {args.seconds:g} s", flush=True)

        rng = random.Random(args.seed)
        latency_ms: list[float] = []
        wait_ms: list[float] = []
        start = time.monotonic()
        arrival = start
        next_report = start + args.every
        while True:
            arrival += rng.expovariate(args.rate)  # open loop: arrivals do not wait for us
            if arrival - start >= args.seconds:
                break
            delay = arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            asked = time.monotonic()
            with torch.inference_mode(), client.slice():
                got = time.monotonic()
                model(x).cpu()  # the result on the host before the slice ends
            done = time.monotonic()
            latency_ms.append((done - arrival) * 1e3)
            wait_ms.append((got - asked) * 1e3)
            if done >= next_report:
                print(report(f"{done - start:5.1f} s", latency_ms, wait_ms), flush=True)
                next_report = done + args.every
        print(report("done", latency_ms, wait_ms), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
