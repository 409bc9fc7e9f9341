"""The two processes of ``bench.colocate``: a trainer and an inference service (the torch side).

Run by the driver as ``python -m bench.colocate --worker trainer|inference --spec JSON``,
one of each per mode. Each reads commands as JSON lines on stdin and answers in
JSON lines on stdout (anything else printed lands on stderr, so stdout carries
only answers); progress and errors go to stderr. A worker that is given a
``client`` opens its :class:`client_lib.Client` before anything touches CUDA, so
that the daemon's environment (MPS pipe directory, client priority) is in place
when the driver initialises. Times are ``time.monotonic_ns()``, comparable with
the driver's and the other worker's. A ``stop`` (or stdin closed) that comes before the
worker said ``ready`` ends it at once: its mode failed or was interrupted while it started.

Trainer: ``run`` (hold a slice, step back to back, ``yield_point()`` after each
step when a client is given) until ``pause``, which answers with the completion
time of every step since ``run``; ``stop`` ends it. On cuda a step's completion
is when its CUDA event is seen done, not when the CPU queued it.

Inference: at start it warms up every load's model (and with ``calibrate`` times
back-to-back requests alone); ``phase`` serves ``requests`` open-loop Poisson
arrivals from a seeded generator (the same arrivals in every mode) one at a
time, first come first served, and answers with each request's arrival, start
and end and its latency from its arrival to the result in host memory. Both
workers' ``ready`` carry what the CUDA driver read for MPS (``bench.mps_evidence``). Arrivals that find ``max_backlog`` requests waiting are
dropped and counted, so an overloaded mode never queues without bound.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import random
import sys
import threading
import time
from contextlib import nullcontext

_COMMANDS_MAX = 16


class WorkerError(Exception):
    """An expected failure: reported on stderr in one line, exit status 1."""


class Channel:
    """JSON lines: commands from stdin (read on a thread), answers to the real stdout."""

    def __init__(self, role: str = "worker") -> None:
        self.role = role
        self.ready = False  # set as "ready" is sent: before it, a stop ends the process at once
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # stray prints (libraries, warnings) must not corrupt the answers
        self.commands: queue.Queue = queue.Queue(maxsize=_COMMANDS_MAX)
        threading.Thread(target=self._read, name="colocate-commands", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if line:
                command = json.loads(line)
                if command.get("op") == "stop":
                    self._stop_if_not_ready("asked to stop")
                self.commands.put(command)
        self._stop_if_not_ready("stdin closed")
        self.commands.put({"op": "stop", "why": "stdin closed"})  # the driver went away

    def _stop_if_not_ready(self, why: str) -> None:
        """A stop before "ready" (the mode failed or was interrupted while this worker started):
        exit now rather than finish importing torch, building and warming up for nothing."""
        if not self.ready:
            log(self.role, f"{why} before it was ready: exiting")
            os._exit(0)

    def send(self, **message) -> None:
        if message.get("ready"):
            self.ready = True
        self._out.write(json.dumps(message) + "\n")

    def next_command(self, block: bool = True) -> dict | None:
        try:
            return self.commands.get(block=block)
        except queue.Empty:
            return None


def log(role: str, message: str) -> None:
    print(f"[{role}] {message}", file=sys.stderr, flush=True)


def open_client(spec: dict, workload: str):
    """The session for this worker, or None when the mode runs without a daemon."""
    wanted = spec.get("client")
    if not wanted:
        return None
    from client_lib import Client, NodeAgentError
    try:
        return Client(f"colocate-{spec['role']}", workload=workload, device=0)
    except NodeAgentError as exc:
        raise WorkerError(f"cannot open a {workload} session: {exc}") from None


def torch_device(spec: dict, client):
    import torch
    if spec["device"] == "cpu":
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise WorkerError("--device cuda but torch sees no CUDA device here; use --device cpu")
    torch.backends.cudnn.benchmark = True
    return torch.device(client.cuda_device if client is not None else "cuda:0")


def device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads per process)"


def mps_report(device) -> dict:
    """What the CUDA driver read when this process made its context (bench.mps_evidence)."""
    from bench.mps_evidence import client_report
    return client_report(device if device.type == "cuda" else None) if device.type == "cuda" else {
        "pid": os.getpid(), "mps_env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}}


def synchronize(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def held(client, queue=None):
    """The token for a block of work: a slice with a daemon, nothing without. ``queue``: the
    service's queue as ``Client.slice`` asks for it (requests waiting, the oldest's arrival)."""
    return client.slice(queue=queue) if client is not None else nullcontext()


# ------------------------------------------------------------------- trainer


def build_trainer(spec: dict, device):
    """(step, model, optimizer): one training step of the spec's model on a fixed random batch."""
    import torch
    import torch.nn.functional as F

    from bench import models
    t = spec["trainer"]
    torch.manual_seed(spec["seed"])
    model = models.build(t["model"], seed=spec["seed"]).train().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = models.example_input(t["model"], t["batch"], spec["input_size"], spec["seq_len"], seed=spec["seed"] + 1)
    x = x.to(device)
    tokens = models.spec(t["model"]).kind == "tokens"
    if tokens:  # next-token prediction on the batch itself
        x, target = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    else:
        g = torch.Generator().manual_seed(spec["seed"] + 2)
        target = torch.randint(0, 10 if t["model"] == "tiny-cnn" else 1000, (t["batch"],), generator=g).to(device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            out = model(x)
            loss = F.cross_entropy(out.flatten(0, 1) if tokens else out, target.flatten() if tokens else target)
        loss.backward()
        optimizer.step()

    return step, model, optimizer


class StepClock:
    """Completion times of steps: on cuda from an event per step, seen done without waiting."""

    def __init__(self, device) -> None:
        import torch
        self._cuda = device.type == "cuda"
        self._event = torch.cuda.Event if self._cuda else None
        self._inflight: collections.deque = collections.deque()
        self.done_ns: list[int] = []

    def stepped(self) -> None:
        if not self._cuda:
            self.done_ns.append(time.monotonic_ns())
            return
        event = self._event()
        event.record()
        self._inflight.append(event)
        while self._inflight and self._inflight[0].query():
            self._inflight.popleft()
            self.done_ns.append(time.monotonic_ns())

    def drain(self) -> list[int]:
        """Wait for the steps in flight; every completion time since the last drain."""
        while self._inflight:
            self._inflight.popleft().synchronize()
            self.done_ns.append(time.monotonic_ns())
        out, self.done_ns = self.done_ns, []
        return out


def pacer_view(pacer) -> dict | None:
    """What the Pacer counted (since it was attached): time held at pause points, of it bounding run-ahead."""
    if pacer is None:
        return None
    view = {key: getattr(pacer, key, None) for key in ("points", "waited_s", "bounded_s")}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in view.items() if isinstance(v, (int, float))}


def trainer(spec: dict, chan: Channel) -> None:
    client = open_client(spec, "training")
    device = torch_device(spec, client)
    step, model, optimizer = build_trainer(spec, device)
    pacer = None
    if client is not None and spec["client"].get("pacer"):
        try:
            from client_lib.torch import Pacer
        except ImportError:
            raise WorkerError("this client_lib has no client_lib.torch.Pacer; run a nodeagent with co-run") from None
        pacer = Pacer(client, model, optimizer)
    warmup_ms = []
    with held(client):
        for _ in range(spec["trainer"]["warmup_steps"]):
            t0 = time.perf_counter()
            step()
            synchronize(device)
            warmup_ms.append((time.perf_counter() - t0) * 1e3)
            if client is not None:
                client.yield_point()  # exclusive: the inference process warms up too
    log("trainer", f"{spec['trainer']['model']} batch {spec['trainer']['batch']} on {device}: warm-up steps "
                   + ", ".join(f"{ms:.1f}" for ms in warmup_ms) + " ms")
    chan.send(ready=True, role="trainer", device_name=device_name(device), warmup_ms=warmup_ms,
              pacer=pacer is not None, mps=mps_report(device))
    clock = StepClock(device)
    while True:
        command = chan.next_command()
        op = command.get("op")
        if op == "stop":
            break
        if op != "run":
            raise WorkerError(f"trainer: unexpected command {op!r} while paused")
        with held(client):
            while True:
                command = chan.next_command(block=False)
                if command is not None:
                    break
                step()
                clock.stepped()
                if client is not None:
                    client.yield_point()
            steps_ns = clock.drain()
        chan.send(paused=True, steps_ns=steps_ns, pacer=pacer_view(pacer))
        if command.get("op") == "stop":
            break
    if pacer is not None:
        pacer.close()
    if client is not None:
        client.close()


# ----------------------------------------------------------------- inference


class Service:
    """One load's model and batch, resident on the device; a request runs it and copies the result home."""

    def __init__(self, load: dict, spec: dict, device, built: dict) -> None:
        from bench import models
        self.name = load["name"]
        if load["model"] not in built:  # loads of one model share it, as one service would
            built[load["model"]] = models.build(load["model"], seed=spec["seed"]).to(device)
        self.model = built[load["model"]]
        self.x = models.example_input(load["model"], load["batch"], spec["input_size"], spec["seq_len"],
                                      seed=spec["seed"] + 3).to(device)

    def __call__(self):
        import torch
        with torch.inference_mode():
            out = self.model(self.x)
            if isinstance(out, tuple):  # BERT: (sequence, pooled); the service answers with the pooled
                out = out[-1]
            return out.cpu()


def poisson_arrivals(rate_per_s: float, seed: int, start_ns: int, end_ns: int | None = None,
                     count: int | None = None) -> list[int]:
    """Open-loop arrivals from ``start_ns``: exponential gaps from a seeded generator, those before
    ``end_ns``, or exactly ``count`` of them (``bench.replay`` draws the same from the seed)."""
    if (end_ns is None) == (count is None):
        raise ValueError("give end_ns or count")
    rng = random.Random(seed)
    out, t = [], float(start_ns)
    while count is None or len(out) < count:
        t += rng.expovariate(rate_per_s) * 1e9
        if end_ns is not None and t >= end_ns:
            break
        out.append(int(t))
    return out


def sleep_until_ns(t_ns: int) -> None:
    delay = (t_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


def serve_phase(request, arrivals: list[int], end_ns: int, max_backlog: int) -> dict:
    """Serve ``arrivals`` first come first served, one at a time; a full backlog drops an arrival.
    ``request(queue)`` serves one, told the queue (a :class:`ServiceQueue`) to report with its slice.

    Per request (in arrival order, dropped ones included): its arrival, start and end in ns of
    ``time.monotonic_ns()``; a dropped request has start and end None. ``queued_at_end``: the
    requests waiting at ``end_ns`` (served after it: their latency counts)."""
    now = time.monotonic_ns
    backlog: collections.deque[int] = collections.deque()  # indices into arrivals
    start: list[int | None] = [None] * len(arrivals)
    end: list[int | None] = [None] * len(arrivals)
    latency_ns, service_ns = [], []
    dropped = queued_at_end = 0
    ended = False
    i = 0
    while i < len(arrivals) or backlog:
        t = now()
        while i < len(arrivals) and arrivals[i] <= t:
            if len(backlog) >= max_backlog:
                dropped += 1
            else:
                backlog.append(i)
            i += 1
        if not ended and t >= end_ns:
            ended, queued_at_end = True, len(backlog)
        if not backlog:
            sleep_until_ns(arrivals[i])
            continue
        k = backlog.popleft()
        t0 = now()
        request(ServiceQueue(arrivals, backlog, i, k, max_backlog))
        t1 = now()
        start[k], end[k] = t0, t1
        latency_ns.append(t1 - arrivals[k])
        service_ns.append(t1 - t0)
    return {"offered": len(arrivals), "completed": len(latency_ns), "dropped": dropped,
            "queued_at_end": queued_at_end, "latency_ms": [round(v / 1e6, 3) for v in latency_ns],
            "service_ms": [round(v / 1e6, 3) for v in service_ns],
            "arrival_ns": list(arrivals), "begin_ns": start, "finish_ns": end}


class ServiceQueue:
    """The service's queue as ``Client.slice(queue=...)`` asks for it while request ``k`` is
    served: (requests waiting, the oldest's arrival in s of ``time.monotonic()``). Request ``k``
    counts until the service marks it ``served`` (inside its slice, so that the release's answer
    leaves it out); then the backlog and arrivals since the loop last looked (at most what the
    backlog could take)."""

    def __init__(self, arrivals: list[int], backlog, i: int, k: int, max_backlog: int) -> None:
        self._arrivals, self._backlog, self._i, self._k, self._max = arrivals, backlog, i, k, max_backlog
        self.served = False

    def __call__(self) -> tuple[int, float | None]:
        arrivals, i = self._arrivals, self._i
        t = time.monotonic_ns()
        j = i
        while j < len(arrivals) and arrivals[j] <= t and j - i < self._max:
            j += 1
        waiting = int(not self.served) + min(len(self._backlog) + (j - i), self._max)
        if not self.served:
            oldest = arrivals[self._k]
        elif self._backlog:
            oldest = arrivals[self._backlog[0]]
        else:
            oldest = arrivals[i] if j > i else None
        return waiting, (oldest / 1e9 if oldest is not None else None)


def calibrate(services: dict, request, spec: dict) -> dict[str, float]:
    """Each load's service time alone: the median of requests made one at a time, each after an
    idle gap as an open-loop arrival finds the device (back to back, a GPU at full clocks with the
    CPU's launches overlapped serves a small batch 2x faster than a request arriving alone does, and
    a rate set from that is not the fraction of capacity it says). The driver asks only once the
    trainer is paused: the first H100 run calibrated while the trainer warmed up beside it."""
    gap_s = spec.get("calibrate_gap_ms", 10.0) / 1e3
    service_ms = {}
    for name, service in services.items():
        samples = []
        deadline = time.monotonic() + spec["calibrate_s"]
        while len(samples) < spec["calibrate"] and (len(samples) < 5 or time.monotonic() < deadline):
            time.sleep(gap_s)
            t0 = time.monotonic_ns()
            request(service)
            samples.append((time.monotonic_ns() - t0) / 1e6)
        service_ms[name] = sorted(samples)[len(samples) // 2]
    log("inference", f"alone, one at a time ({gap_s * 1e3:g} ms apart): "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in service_ms.items()))
    return service_ms


def inference(spec: dict, chan: Channel) -> None:
    client = open_client(spec, "inference")
    device = torch_device(spec, client)
    built: dict = {}
    services = {load["name"]: Service(load, spec, device, built) for load in spec["loads"]}

    def request(service, queue=None):
        with held(client, queue):
            service()
            if queue is not None:
                queue.served = True  # the release says it no longer waits

    for service in services.values():
        for _ in range(spec["warmup_requests"]):
            request(service)
    chan.send(ready=True, role="inference", device_name=device_name(device), mps=mps_report(device))
    while True:
        command = chan.next_command()
        op = command.get("op")
        if op == "stop":
            break
        if op == "calibrate":
            chan.send(calibrated=True, service_ms=calibrate(services, request, spec))
            continue
        if op != "phase":
            raise WorkerError(f"inference: unexpected command {op!r}")
        service = services[command["load"]]
        arrivals = poisson_arrivals(command["rate_per_s"], command["seed"], command["start_ns"],
                                    count=command["requests"])
        end_ns = arrivals[-1] + 1 if arrivals else command["start_ns"]  # the offered load's window
        sleep_until_ns(command["start_ns"])
        result = serve_phase(lambda queue: request(service, queue), arrivals, end_ns, spec["max_backlog"])
        chan.send(phase=command["load"], window_end_ns=end_ns, **result)
    if client is not None:
        client.close()


def main(role: str, spec_text: str) -> int:
    try:
        spec = json.loads(spec_text)
        spec["role"] = role
        chan = Channel(role)
        (trainer if role == "trainer" else inference)(spec, chan)
    except WorkerError as exc:
        log(role, f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
