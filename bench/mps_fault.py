"""A fault under MPS, on a GPU: what a healthy service sharing the MPS server sees, and how long from the fault until it answers again.

    python -m bench.mps_fault --json          (cuda, as root, nvidia-cuda-mps-control on PATH)

One nodeagent daemon co-running device 0 with MPS on it ([mps] devices = [0]), on the cuda backend:
its NVML watcher reads the Xid and the process lists (every 100 ms) and sends the ``E_DEVICE``
notices measured here. Two scenarios, each with fresh processes; every process is a nodeagent
session, so each is a client of the same MPS server (NVIDIA's MPS: one fault domain). Each
scenario records under ``mps`` the MPS server and client lists and each client's priority and
memory limit (``bench.mps_evidence``); a process that did not run under MPS as meant is named in
``problems`` and the run exits 1 (``mps_verified`` false):

* ``fault``: a healthy inference service (a 1024x1024 matmul per request, a request every 10 ms)
  and a faulting client whose kernel writes to an illegal address (CuPy's RawKernel where CuPy is
  installed, else an out-of-range index, a device-side assert). Recorded: what the service's next
  request raised and when, whether that was the daemon's notice (``E_DEVICE``) or CUDA's error, and
  ``fault_to_next_good_ms``: from the fault until a new service process, started as a supervisor
  would when the old one failed, answers its first request (the daemon gives it a plain context
  while the faulted server still has clients, or MPS once they have left).
* ``kill``: a client SIGKILLed while its kernel runs (a 1 s spin) beside the service: whether the
  service saw an error, and its request latency before and after the kill.

On a machine without CUDA (or not root, or without MPS) it says why in one line and, with
``--json``, prints a result with ``skipped`` set: ``scripts/gpu-check.sh`` runs it on the GPU.
Times are CLOCK_MONOTONIC, which every process on the host shares.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench import common

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REQUEST_PERIOD_S = 0.01
_READY_TIMEOUT_S = 60.0
_WAIT_S = 20.0


# ------------------------------------------------------------------ workers (child processes)


def _say(**fields) -> None:
    print(json.dumps({"t": time.monotonic(), **fields}), flush=True)


def _worker(role: str, endpoint: str) -> int:
    from bench.mps_evidence import client_report
    from client_lib import Client

    client = Client(f"mps-fault-{role}", workload="inference" if role == "service" else "training",
                    endpoint=endpoint)  # its welcome's MPS variables are set before CUDA starts
    import torch

    _say(event="session", mps=bool(client.welcome.env))
    if role == "service":
        x = torch.randn(1024, 1024, device="cuda")
        torch.mm(x, x)
        torch.cuda.synchronize()
        _say(event="ready", mps=client_report())
        while True:
            t0 = time.monotonic()
            try:
                with client.slice(timeout=10):
                    torch.mm(x, x)
                    torch.cuda.synchronize()
            except Exception as exc:  # the CUDA error, or the daemon's notice raised by the client
                _say(event="error", error=f"{type(exc).__name__}: {exc}"[:400])
                return 1
            _say(event="ok", ms=(time.monotonic() - t0) * 1e3)
            time.sleep(_REQUEST_PERIOD_S)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    _say(event="ready", mps=client_report())
    sys.stdin.readline()  # go
    if role == "spinner":
        _say(event="spinning")
        torch.cuda._sleep(int(4e9))  # several seconds of one kernel: the parent kills us inside it
        torch.cuda.synchronize()
        return 0
    try:
        import cupy

        kernel = cupy.RawKernel(r'extern "C" __global__ void bad() { *((volatile int *) 0x10) = 1; }', "bad")
        how = "illegal address (CuPy RawKernel)"
        _say(event="fault", how=how)
        kernel((1,), (1,), ())
        cupy.cuda.runtime.deviceSynchronize()
    except ImportError:
        how = "device-side assert (index out of range)"
        _say(event="fault", how=how)
        try:
            torch.zeros(4, device="cuda")[torch.tensor([1 << 40], device="cuda")].sum().item()
        except Exception as exc:
            _say(event="fault_error", error=f"{type(exc).__name__}: {exc}"[:400])
    except Exception as exc:
        _say(event="fault_error", error=f"{type(exc).__name__}: {exc}"[:400])
    time.sleep(30)  # stay a client of the server (as a real process might) until the parent ends us
    return 0


# ------------------------------------------------------------------ the parent


class Child:
    """A worker process and the JSON lines it prints (read on a thread, kept in a queue)."""

    def __init__(self, role: str, endpoint: str, env: dict[str, str]) -> None:
        self.role = role
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.mps_fault", "--worker", role, "--endpoint",
                                      endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass
        self.lines.put(None)

    def until(self, event: str, timeout_s: float) -> dict | None:
        """The first line with ``event`` (those before it kept in ``seen``), None if none came."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                return None
            self.seen.append(line)
            if line.get("event") == event:
                return line
        return None

    def collect(self, seconds: float) -> None:
        """Keep what it prints for ``seconds`` (in ``seen``)."""
        self.until("", seconds)  # no line has an empty event: every line is kept until the time is up

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        common.stop_process(self.proc, 5.0)


def summarize_fault(fault_at: float, service: list[dict], notified: bool, fresh: list[dict]) -> dict:
    """The ``fault`` scenario's figures from what the processes printed (a pure function); ``notified``:
    the service's first error was the daemon's notice (not CUDA's own error)."""
    error = next((line for line in service if line.get("event") == "error" and line["t"] >= fault_at), None)
    first_ok = next((line for line in fresh if line.get("event") == "ok"), None)
    session = next((line for line in fresh if line.get("event") == "session"), None)
    before = [line["ms"] for line in service if line.get("event") == "ok" and line["t"] < fault_at]
    return {
        "service_p50_ms_before": common.rounded(common.percentile(before, 50)) if before else None,
        "service_error": None if error is None else error["error"],
        "service_error_after_ms": None if error is None else common.rounded((error["t"] - fault_at) * 1e3),
        "service_first_error_from_daemon": notified,
        "fresh_service_on_mps": None if session is None else session["mps"],
        "fault_to_next_good_ms": None if first_ok is None else common.rounded((first_ok["t"] - fault_at) * 1e3),
    }


def summarize_kill(killed_at: float, service: list[dict]) -> dict:
    before = [line["ms"] for line in service if line.get("event") == "ok" and line["t"] < killed_at]
    after = [line["ms"] for line in service if line.get("event") == "ok" and line["t"] >= killed_at]
    error = next((line for line in service if line.get("event") == "error"), None)
    return {
        "service_error": None if error is None else error["error"],
        "service_p99_ms_before": common.rounded(common.percentile(before, 99)) if before else None,
        "service_p99_ms_after": common.rounded(common.percentile(after, 99)) if after else None,
        "service_requests_after": len(after),
    }


def why_not_here() -> str | None:
    """Why this machine cannot run the benchmark (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if os.geteuid() != 0:
        return "not root (the daemon puts sessions on MPS when it runs as root)"
    if shutil.which("nvidia-cuda-mps-control") is None:
        return "nvidia-cuda-mps-control is not on PATH"
    return None


# Every process is a session of a co-run daemon with MPS on device 0: the service (inference) at the
# default priority, the others (training) at CUDA_MPS_CLIENT_PRIORITY=1; nobody declares memory, so no limit.
EXPECT = {"service": {"mps": True, "priority": None, "mem_limit": None},
          "faulty": {"mps": True, "priority": "1", "mem_limit": None},
          "spinner": {"mps": True, "priority": "1", "mem_limit": None}}


def mps_check(ready: dict[str, dict]) -> dict:
    """The MPS evidence for the scenario's processes (role -> their ready line), with ``problems``."""
    from bench import mps_evidence
    evidence = mps_evidence.collect({role: line.get("mps") or {} for role, line in ready.items()})
    evidence["problems"] = mps_evidence.verify(evidence, {role: EXPECT[role] for role in ready})
    if evidence["problems"]:
        common.log("[mps_fault] MPS evidence: " + "; ".join(evidence["problems"]))
    return evidence


def _fault(endpoint: str, env: dict[str, str]) -> dict:
    service = Child("service", endpoint, env)
    faulty = Child("faulty", endpoint, env)
    fresh = None
    try:
        ready = {"service": service.until("ready", _READY_TIMEOUT_S), "faulty": faulty.until("ready", _READY_TIMEOUT_S)}
        if None in ready.values():
            raise RuntimeError("a worker did not start (see its stderr above)")
        evidence = mps_check(ready)
        time.sleep(1.0)  # requests before the fault
        faulty.go()
        fault = faulty.until("fault", 10.0)
        if fault is None:
            raise RuntimeError("the faulting worker never faulted")
        fault_at = fault["t"]
        error = service.until("error", _WAIT_S)
        notified = error is not None and ("MPS server had a fatal fault" in error["error"])
        fresh = Child("service", endpoint, env)  # as a supervisor would: at once
        fresh.until("ok", _WAIT_S + _READY_TIMEOUT_S)
        faulty.until("fault_error", 0.5)
        result = summarize_fault(fault_at, service.seen, notified, fresh.seen)
        result["how"] = fault.get("how")
        result["mps"] = evidence
        result["faulting_client_error"] = next((line["error"] for line in faulty.seen
                                                if line.get("event") == "fault_error"), None)
        return result
    finally:
        for child in (service, faulty, fresh):
            if child is not None:
                child.end()


def _kill(endpoint: str, env: dict[str, str]) -> dict:
    service = Child("service", endpoint, env)
    spinner = Child("spinner", endpoint, env)
    try:
        ready = {"service": service.until("ready", _READY_TIMEOUT_S),
                 "spinner": spinner.until("ready", _READY_TIMEOUT_S)}
        if None in ready.values():
            raise RuntimeError("a worker did not start (see its stderr above)")
        evidence = mps_check(ready)
        time.sleep(1.0)
        spinner.go()
        spinner.until("spinning", 10.0)
        time.sleep(0.3)  # inside its kernel
        killed_at = time.monotonic()
        spinner.proc.send_signal(signal.SIGKILL)
        spinner.proc.wait()
        service.collect(2.0)  # two seconds of the service's requests after the kill
        return {"killed_mid_kernel": True, **summarize_kill(killed_at, service.seen), "mps": evidence}
    finally:
        service.end()
        spinner.end()


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("mps_fault", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1].strip())
    ap.add_argument("--worker", choices=("service", "faulty", "spinner"), help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)  # a worker's daemon
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.endpoint)
    result = {"benchmark": "mps_fault", "device": "cuda"}
    why = why_not_here()
    if why is not None:
        common.log(f"[mps_fault] not run here: {why} (this benchmark needs a GPU with MPS; scripts/gpu-check.sh "
                   "runs it)")
        common.emit({**result, "skipped": why}, args.json)
        return 0
    workdir = tempfile.mkdtemp(prefix="nodeagent-bench-mps-fault-")
    config = os.path.join(workdir, "nodeagent.toml")
    with open(config, "w") as f:
        f.write("[mps]\ndevices = [0]\n[memory]\nwatch_interval_ms = 100\n")  # an Xid read within 0.1 s
    try:
        # A cuda daemon: its NVML watcher reads the Xid and the MPS client lists, and sends the E_DEVICE notices.
        with common.daemon(["--config", config, "--sharing", "corun"], backend="cuda",
                           log_keep=lambda line: "[device]" in line or "[mps]" in line) as d:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}
            result["fault"] = _fault(d.endpoint, env)
            common.log(f"[mps_fault] fault: {result['fault']}")
            result["kill"] = _kill(d.endpoint, env)
            common.log(f"[mps_fault] kill: {result['kill']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    problems = [f"{scenario}: {p}" for scenario in ("fault", "kill") for p in result[scenario]["mps"]["problems"]]
    result["mps_verified"] = not problems
    common.emit(result, args.json)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
