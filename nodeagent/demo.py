"""``nodeagent demo``: an inference client and a training client share one device.

Starts ``nodeagent serve --backend cpu`` on a private socket (unless
NODEAGENT_ENDPOINT names a running daemon), then runs the two clients as
separate processes doing real work (torch on the CPU when installed), and
prints who holds the token and how long the inference requests waited.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from client_lib import Client, DaemonUnavailableError, query_status
from client_lib.endpoint import ENV_ENDPOINT


def _make_work():
    """A real unit of compute: a small torch MLP step if torch is there, else hashing."""
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch
    except ImportError:
        import hashlib
        blob = os.urandom(1 << 16)

        def work(_step: int) -> float:
            for _ in range(20):
                hashlib.sha256(blob).digest()
            return 0.0
        return work
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def work(_step: int) -> float:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return work


def _trainer(endpoint: str, seconds: float, ready, go) -> None:
    work = _make_work()
    with Client("demo-trainer", workload="training", endpoint=endpoint) as client:
        ready.wait()
        t0 = go.get()
        step, stop_at = 0, time.monotonic() + seconds
        with client.slice():
            print(f"{time.monotonic() - t0:7.3f}s  training   granted device {client.device} "
                  f"(slice {client.slice_ms:.0f} ms)", flush=True)
            while time.monotonic() < stop_at:
                loss = work(step)
                step += 1
                t_yield = time.monotonic()
                if client.yield_point():
                    print(f"{time.monotonic() - t0:7.3f}s  training   yielded at step {step} "
                          f"(loss {loss:.3f}), back after {1000 * (time.monotonic() - t_yield):.1f} ms",
                          flush=True)
        print(f"{time.monotonic() - t0:7.3f}s  training   done: {step} steps", flush=True)


def _inference(endpoint: str, seconds: float, ready, go, period_s: float = 0.5) -> None:
    work = _make_work()
    waits_ms = []
    with Client("demo-inference", workload="inference", endpoint=endpoint) as client:
        ready.wait()
        t0 = go.get()
        time.sleep(0.3)  # let the trainer get going first
        stop_at = time.monotonic() + seconds - 0.5
        while time.monotonic() < stop_at:
            asked = time.monotonic()
            with client.slice():
                wait_ms = 1000 * (time.monotonic() - asked)
                waits_ms.append(wait_ms)
                for i in range(3):
                    work(i)
                print(f"{time.monotonic() - t0:7.3f}s  inference  request served; waited {wait_ms:.2f} ms "
                      "for the token", flush=True)
            time.sleep(max(0.0, period_s - (time.monotonic() - asked)))
    if waits_ms:
        print(f"inference waits: n={len(waits_ms)} median {statistics.median(waits_ms):.2f} ms "
              f"max {max(waits_ms):.2f} ms", flush=True)


CONNECT_S = 300.0  # for both clients to import torch and open a session: minutes on a busy 2-core VM's first run


def _start_daemon(socket_dir: str) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{socket_dir}/agent.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "serve", "--backend", "cpu", "--endpoint", endpoint,
         "--state-dir", os.path.join(socket_dir, "state"), "--log-level", "warning", "--ctxpool", "off"])
    deadline = time.monotonic() + 15
    try:
        while True:
            try:
                query_status(endpoint, timeout=0.5)
                return proc, endpoint
            except DaemonUnavailableError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("nodeagent demo: the daemon did not start; see the messages above") from None
                time.sleep(0.01)  # a refused connect returns at once: without a pause this spun a core
    except BaseException:  # Ctrl-C while it starts too: no daemon left behind
        proc.kill()
        proc.wait()
        raise


def run_demo(seconds: float) -> int:
    endpoint = os.environ.get(ENV_ENDPOINT)
    daemon = socket_dir = None
    # A first line before anything slow (a daemon to start, two clients that import torch).
    print(f"nodeagent demo: an inference and a training client sharing device 0 for {seconds:g} s; "
          "starting them takes a few seconds", flush=True)
    try:
        if endpoint is None:
            socket_dir = tempfile.mkdtemp(prefix="nodeagent-demo-")
            daemon, endpoint = _start_daemon(socket_dir)
            print(f"started nodeagent (pid {daemon.pid}) on {endpoint}, backend cpu", flush=True)
        else:
            print(f"using the daemon at {endpoint}", flush=True)
        ctx = mp.get_context("spawn")
        ready, go = ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=_trainer, args=(endpoint, seconds, ready, go)),
                 ctx.Process(target=_inference, args=(endpoint, seconds, ready, go))]
        for proc in procs:
            proc.start()
        try:
            ready.wait(timeout=CONNECT_S)  # both clients have a session: start the clock
        except threading.BrokenBarrierError:
            for proc in procs:
                proc.terminate()
                proc.join(timeout=10)
            print(f"nodeagent demo: the two clients did not connect within {CONNECT_S:g} s (a first run "
                  "after set-up compiles torch's modules as it imports them; run it again)", file=sys.stderr,
                  flush=True)
            return 1
        t0 = time.monotonic()
        for _ in procs:
            go.put(t0)
        print("both clients connected; trainer runs slices back to back, inference asks every 0.5 s",
              flush=True)
        time.sleep(min(1.5, seconds / 2))
        from nodeagent.cli import format_status
        print("\n--- nodeagent status (mid-run) ---\n" + format_status(query_status(endpoint)) + "\n",
              flush=True)
        for proc in procs:
            proc.join()
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        return 1 if failed else 0
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=10)
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
