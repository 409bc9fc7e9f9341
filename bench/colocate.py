"""An inference service beside a training job on one device: inference p99 and training kept, per sharing mode.

The question users ask first (issue 20): with a latency-bound inference
service and a training job on the same GPU, what happens to inference p99 and
how much training is kept? Measured against what a user would pick instead, in
the same run.

Per mode, one trainer process and one inference process (``bench.colocate_worker``)
run every load as a phase. Inference: ``--requests`` open-loop Poisson arrivals
(the same in every mode, from a seed per load), served one at a time; latency
from arrival to the result in host memory, so queueing counts; a backlog beyond
``--max-backlog`` is dropped and counted. Training: steps completed inside the
phase's window. Ratios are against ``alone`` in the same run: p99 / alone p99,
kept = steps/s / alone steps/s, and system throughput = served / offered + kept
(Tally's and Orion's sum of both normalised); every headline carries the
dropped and queued-at-end counts, and ``p99_with_dropped_ms`` counts a dropped
request as never answered. A load's rate is fixed in requests per second, or
(``0.3x``) a fraction of the capacity measured alone with the trainer paused
(1 / median service time of requests made one at a time, 10 ms apart).

Every MPS mode checks, once both processes have their contexts, that they are
clients of the MPS server with the priority and memory limit the mode set
(``bench.mps_evidence``: the control daemon's server and client lists, NVML's
lists, what each client's driver read) and fails by name otherwise; the
evidence is in the mode's ``mps``. ``--budget-s`` starts a mode only when the
time it is expected to take (the longest mode so far) fits what is left; one
that does not is ``skipped-budget``, never cut.

The record, for ``bench.replay`` (``record_format`` 1): every time is in µs
since the run's epoch (one ``time.monotonic_ns()`` of the driver, which the
workers share). Per mode, ``trainer_steps_us``: the completion time of each
training step from the trainer's run to its pause (alone: its window alone);
per mode and load, ``requests``: ``seed`` and ``rate_per_s`` (the arrivals are
``bench.colocate_worker.poisson_arrivals(rate_per_s, seed, start, count=n)``),
``window_us`` (first arrival's phase start, last arrival), and ``arrival_us``,
``start_us``, ``end_us`` per request in arrival order (start and end null for
a dropped one).

The driver imports no torch and never initialises CUDA: the environment of each
child (MPS pipe directory, client priority, daemon endpoint) is what sets a mode
up. Every daemon, MPS control daemon and child it starts is stopped by pid,
also on Ctrl-C or SIGTERM. NODEAGENT_ENDPOINT is ignored: each nodeagent mode
needs a daemon started with its own sharing settings.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import math
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from bench.common import (interrupts_held, log, percentile, positive_float, positive_int, rounded, stop_process,
                          wait_for_daemon)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/models.py's names (tests/bench/test_bench_colocate.py keeps them equal): the driver imports no torch.
MODEL_NAMES = ("resnet50", "resnet152", "bert-base", "tiny-cnn", "gpt-small", "tiny-gpt", "tiny-bert")
DEFAULT_MODE = "corun"  # what nodeagent does unless told otherwise: the headline's mode
_READY_TIMEOUT_S = {"cuda": 180.0, "cpu": 90.0}  # import torch, build, warm up (cudnn.benchmark)
_PHASE_SLACK_S = 60.0  # beyond the phase: the drain of a bounded backlog
_CHILD_STOP_S = 10.0
_MPS_START_S = 20.0
_DAEMON_START_S = 30.0


@dataclass(frozen=True)
class Mode:
    name: str
    what: str
    cuda_only: bool = False
    sharing: str | None = None  # a nodeagent daemon with --sharing this; None: no daemon
    duty: str | None = None  # --corun-duty
    bench_mps: bool = False  # an MPS control daemon started by the bench, both children its clients
    priority: bool = False  # the trainer at CUDA_MPS_CLIENT_PRIORITY=1 (bench MPS)
    # The daemon's MPS: "" its default (mps.devices = "auto": MPS on every GPU when it co-runs on cuda
    # as root and finds nvidia-cuda-mps-control); "always" / "cuda": [mps] devices = [0] (cuda only /
    # on cuda, off on cpu); "off": [mps] devices = [].
    daemon_mps: str = ""
    daemon_config: str = ""  # more of the daemon's config file
    pacer: bool = False  # the trainer attaches client_lib.torch.Pacer


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("alone", "the trainer alone, then inference alone at each load: every ratio's baseline"),
    Mode("no-daemon", "both at once, nothing between them"),
    Mode("mps", "both as clients of an MPS control daemon the bench starts", cuda_only=True, bench_mps=True),
    Mode("mps-priority", "as mps, the trainer at CUDA_MPS_CLIENT_PRIORITY=1", cuda_only=True, bench_mps=True,
         priority=True),
    Mode("exclusive", "nodeagent --sharing exclusive; trainer: a slice, yield_point() per step; inference: a "
         "slice per request", sharing="exclusive"),
    Mode("exclusive-fenced", "as exclusive, the trainer with Pacer (fences the device before a yield)",
         sharing="exclusive", pacer=True),
    Mode("corun", "nodeagent's default: --sharing corun, adaptive duty, its default MPS (auto: on for a root "
         "daemon on cuda); trainer with Pacer and yield_point()", sharing="corun", duty="adaptive", pacer=True),
    Mode("corun-nomps", "as corun with MPS off ([mps] devices = []): the two contexts time-sliced, the trainer "
         "paced", sharing="corun", duty="adaptive", daemon_mps="off", pacer=True),
    Mode("corun-mps", "as corun, MPS on device 0 named in the config (trainer at MPS client priority 1)",
         cuda_only=True, sharing="corun", duty="adaptive", daemon_mps="always", pacer=True),
    Mode("corun-pause", "as corun-mps on cuda (corun on cpu), --corun-duty pause: the trainer paused while "
         "inference holds", sharing="corun", duty="pause", daemon_mps="cuda", pacer=True),
    Mode("corun-free", "as corun-mps on cuda (corun on cpu), --corun-duty free: never paused",
         sharing="corun", duty="free", daemon_mps="cuda", pacer=True),
    Mode("corun-cap", "as corun-mps, the trainer capped to 60% of the SMs ([corun] lower_sm_percent = 60)",
         cuda_only=True, sharing="corun", duty="adaptive", daemon_mps="always", pacer=True,
         daemon_config="[corun]\nlower_sm_percent = 60\n"),
)}

RECORD_FORMAT = 1  # the per-request record's layout (the module docstring); bench.replay reads it
DEFAULTS = {  # per device: the issue's loads on an H100 (req/s), and tiny models that finish fast on 2 cores
    "cuda": {"loads": "light=resnet50:8:45,heavy=resnet50:64:30.4", "trainer": "resnet50:64", "phase_s": 6.0,
             "requests": 600,
             "settle_s": 1.0, "input_size": 224, "seq_len": 128, "threads": 0, "warmup_steps": 5,
             "warmup_requests": 5, "calibrate": 40, "calibrate_s": 3.0},
    "cpu": {"loads": "light=tiny-cnn:4:0.3x,heavy=tiny-cnn:16:0.35x", "trainer": "tiny-cnn:16", "phase_s": 2.0,
            "requests": 120,
            "settle_s": 0.3, "input_size": 32, "seq_len": 32, "threads": 1, "warmup_steps": 2,
            "warmup_requests": 3, "calibrate": 30, "calibrate_s": 1.0},
}


class ModeFailed(Exception):
    """A mode could not be measured; the message says which process and why, in one line.
    ``evidence``: the mode's MPS evidence when that is why (filed under the mode's ``mps``)."""

    def __init__(self, message: str, evidence: dict | None = None) -> None:
        super().__init__(message)
        self.evidence = evidence


class ModeSkipped(Exception):
    """A mode this machine cannot run; the message says why."""


QUICK = {"requests": 30, "phase_s": 0.6, "settle_s": 0.2}  # --quick: a cpu run for tests, in seconds


class Interrupted(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C: everything started is stopped, the partial result printed."""


@dataclass(frozen=True)
class Load:
    name: str
    model: str
    batch: int
    rate_per_s: float | None  # fixed, in requests per second
    fraction: float | None = None  # else: of the capacity measured alone

    def as_spec(self) -> dict:
        return {"name": self.name, "model": self.model, "batch": self.batch}


def parse_loads(text: str) -> list[Load]:
    """``NAME=MODEL:BATCH:RATE,...``: RATE in requests per second (``light=resnet50:8:45``), or
    with an ``x`` a fraction of the capacity measured alone (``light=resnet50:8:0.3x``)."""
    loads = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, rest = item.partition("=")
        fields = rest.split(":")
        if not eq or not name or len(fields) != 3:
            raise argparse.ArgumentTypeError(f"load {item!r} is not NAME=MODEL:BATCH:RATE")
        model, batch, rate = fields
        if model not in MODEL_NAMES:
            raise argparse.ArgumentTypeError(f"load {name}: unknown model {model!r}; known: {', '.join(MODEL_NAMES)}")
        relative = rate.endswith("x")
        try:
            value = float(rate.removesuffix("x"))
            load = Load(name, model, int(batch), None if relative else value, value if relative else None)
        except ValueError:
            raise argparse.ArgumentTypeError(f"load {name}: batch must be an integer and the rate a number "
                                             "(requests per second, or 0.3x of capacity)") from None
        if load.batch < 1 or not (0 < value <= 2 if relative else 0 < value <= 100_000):
            raise argparse.ArgumentTypeError(f"load {name}: batch must be >= 1 and the rate in (0, 100000] req/s "
                                             "or (0, 2]x of capacity")
        loads.append(load)
    if not loads or len({load.name for load in loads}) != len(loads):
        raise argparse.ArgumentTypeError("give at least one load, each name once")
    return loads


def parse_trainer(text: str) -> tuple[str, int]:
    model, _, batch = text.partition(":")
    if model not in MODEL_NAMES or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"--trainer {text!r} is not MODEL:BATCH with MODEL one of "
                                         f"{', '.join(MODEL_NAMES)}")
    return model, int(batch)


def parse_modes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown) or '(none given)'}; "
                                         f"valid: {', '.join(MODES)}")
    return list(dict.fromkeys(names))


# ------------------------------------------------------------------ children


class Child:
    """One worker process: commands in on stdin, JSON lines out on stdout, the last words of stderr kept.

    Every child is in :data:`LIVE` from the moment it exists until it is closed, so a Ctrl-C that
    lands between its start and the ``with`` (or ExitStack) that would close it still stops it
    (:func:`close_live`, after the modes' own cleanup)."""

    def __init__(self, mode: str, role: str, spec: dict, env: dict[str, str]) -> None:
        self.mode, self.role = mode, role
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self._messages: queue.Queue = queue.Queue(maxsize=64)
        argv = [sys.executable, "-m", "bench.colocate", "--worker", role, "--spec", json.dumps(spec)]
        # Its own session: a Ctrl-C reaches only the driver, which stops the children in order.
        self._threads: list[threading.Thread] = []
        with interrupts_held():  # a Ctrl-C inside Popen would leave a process LIVE does not hold
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, cwd=REPO, text=True, bufsize=1,
                                         start_new_session=True)
            LIVE.add(self)
        self._threads = [threading.Thread(target=fn, daemon=True, name=f"colocate-{role}-{what}")
                         for what, fn in (("out", self._read_out), ("err", self._read_err))]
        for t in self._threads:
            t.start()

    def _read_out(self) -> None:
        for line in self.proc.stdout:
            try:
                self._messages.put(json.loads(line))
            except ValueError:
                self.tail.append(f"(not JSON on stdout) {line.strip()[:200]}")
        self._messages.put(None)

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip()
            if line:
                self.tail.append(line)
                log(f"  [{self.mode}] {line}" if line.startswith("[") else f"  [{self.mode} {self.role}] {line}")

    def send(self, **command) -> None:
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise ModeFailed(self.exit_text()) from None

    def expect(self, key: str, timeout_s: float) -> dict:
        """The next message, which must carry ``key``; ModeFailed if the child dies or stays silent."""
        try:
            message = self._messages.get(timeout=timeout_s)
        except queue.Empty:
            raise ModeFailed(f"{self.role} sent no {key!r} within {timeout_s:.0f} s; last stderr: "
                             f"{self.last_words()}") from None
        if message is None:
            raise ModeFailed(self.exit_text())
        if key not in message:
            raise ModeFailed(f"{self.role} answered {sorted(message)} where {key!r} was expected")
        return message

    def last_words(self) -> str:
        return self.tail[-1] if self.tail else "(nothing)"

    def exit_text(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._join_readers()  # the rest of stderr
        state = f"exited {code}" if code is not None else "closed its stdout"
        return f"{self.role} {state}: {self.last_words()}"

    def close(self) -> str:
        """Ask it to stop, then SIGTERM, then SIGKILL, each given a while; the step that ended it."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.close()
        taken = "stop"
        for taken, action in (("stop", None), ("sigterm", self.proc.terminate), ("sigkill", self.proc.kill)):
            if action is not None:
                log(f"[colocate] {self.mode} {self.role} pid={self.proc.pid} still runs: {taken}")
                action()
            try:
                self.proc.wait(timeout=_CHILD_STOP_S)
                break
            except subprocess.TimeoutExpired:
                continue
        self._join_readers()  # its last words are logged before the next mode begins
        LIVE.discard(self)
        return taken

    def _join_readers(self) -> None:
        # A Ctrl-C can land inside __init__'s Thread.start(): a reader never started is not joined.
        for t in self._threads:
            if t.ident is not None:
                t.join(2)

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


LIVE: set[Child] = set()


def close_live() -> None:
    """Stop every child not closed yet (one a Ctrl-C caught between its start and its ``with``)."""
    for child in list(LIVE):
        try:
            child.close()
        except Exception as exc:  # one child's trouble must not leave the others running
            log(f"[colocate] closing {child.mode} {child.role} failed: {exc}")
            with contextlib.suppress(OSError):
                child.proc.kill()
            LIVE.discard(child)


# ------------------------------------------------------------------ what a mode runs with


@dataclass
class Setup:
    trainer_env: dict[str, str]
    inference_env: dict[str, str]
    client: bool = False
    endpoint: str | None = None
    note: str = ""
    daemon_log: str | None = None


@dataclass
class Run:
    """Everything the modes share: options, loads, and the alone baselines once measured."""

    device: str
    loads: list[Load]
    trainer: tuple[str, int]
    phase_s: float
    settle_s: float
    max_backlog: int
    seed: int
    worker: dict  # the common part of the workers' spec
    requests: int = 600  # per cell
    budget_s: float | None = None
    epoch_ns: int = field(default_factory=time.monotonic_ns)  # every recorded time is µs since it
    gpu_uuid: str | None = None
    device_name: str | None = None
    rate_per_s: dict[str, float] = field(default_factory=dict)
    alone_p99_ms: dict[str, float] = field(default_factory=dict)
    alone_p50_ms: dict[str, float] = field(default_factory=dict)
    alone_steps_per_s: float | None = None


def child_env() -> dict[str, str]:
    """Ours, less what would route a child elsewhere than this mode says."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CUDA_MPS_") and k not in ("NODEAGENT_ENDPOINT",)}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def bench_mps(run: Run) -> Iterator[dict[str, str]]:
    """An MPS control daemon on the GPU, private pipe and log directories; its clients' environment."""
    from nodeagent.mps import MpsControl, MpsError
    binary = shutil.which("nvidia-cuda-mps-control")
    if binary is None:
        raise ModeSkipped("nvidia-cuda-mps-control is not on PATH (the driver's MPS component)")
    if run.gpu_uuid is None:
        raise ModeFailed("NVML named no GPU UUID, which MPS needs in CUDA_VISIBLE_DEVICES")
    workdir = tempfile.mkdtemp(prefix="na-coloc-")  # short: the control socket path must fit sun_path
    control = MpsControl(0, run.gpu_uuid, workdir, binary)
    try:
        try:
            control.start(timeout_s=_MPS_START_S)
        except MpsError as exc:
            raise ModeFailed(f"MPS: {exc}") from None
        log(f"[colocate] MPS control daemon pid={control.pid} pipe={control.pipe_dir}")
        yield control.client_env()
    finally:
        step = control.quit()
        if step.value not in ("quit", "not-running"):
            log(f"[colocate] MPS control daemon needed {step.value}")
        shutil.rmtree(workdir, ignore_errors=True)


def daemon_mps(mode: Mode, device: str) -> bool:
    return mode.daemon_mps == "always" or (mode.daemon_mps == "cuda" and device == "cuda")


def daemon_note(mode: Mode, device: str) -> str:
    """How the mode's daemon was started, for a reader of the result."""
    return (f"nodeagent serve --backend {device} --sharing {mode.sharing}"
            + (f" --corun-duty {mode.duty}" if mode.duty else "")
            + ("; MPS on device 0 ([mps] devices = [0])" if daemon_mps(mode, device) else "")
            + ("; MPS off ([mps] devices = [])" if mode.daemon_mps == "off" else "")
            + (f"; {mode.daemon_config.strip()}" if mode.daemon_config else "")
            + ("; trainer with Pacer" if mode.pacer else ""))


def daemon_args(mode: Mode, run: Run, workdir: str, endpoint: str) -> list[str]:
    config = os.path.join(workdir, "nodeagent.toml")
    with open(config, "w") as f:  # hermetic: never the host's /etc/nodeagent/nodeagent.toml
        if daemon_mps(mode, run.device):
            f.write("[mps]\ndevices = [0]\n")
        elif mode.daemon_mps == "off":
            f.write("[mps]\ndevices = []\n")
        f.write(mode.daemon_config)
    return [sys.executable, "-m", "nodeagent", "serve", "--config", config, "--backend", run.device,
            "--endpoint", endpoint, "--state-dir", os.path.join(workdir, "state"), "--log-level", "info",
            "--ctxpool", "off", "--sharing", mode.sharing, *(("--corun-duty", mode.duty) if mode.duty else ())]


@contextlib.contextmanager
def nodeagent_daemon(mode: Mode, run: Run) -> Iterator[tuple[str, str]]:
    """A private ``nodeagent serve`` for this mode, on a socket in a private folder: (endpoint, log file)."""
    workdir = tempfile.mkdtemp(prefix="na-coloc-")
    endpoint = f"ipc://{workdir}/agent.sock"
    args = daemon_args(mode, run, workdir, endpoint)
    log_path = os.path.join(workdir, "daemon.log")
    proc = None
    try:
        with open(log_path, "ab") as out, interrupts_held():  # a Ctrl-C inside Popen would lose the daemon
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=child_env(), cwd=REPO, start_new_session=True)
        try:
            wait_for_daemon(endpoint, _DAEMON_START_S, proc)
        except RuntimeError as exc:
            raise ModeFailed(f"daemon: {exc}: {_last_line(log_path)}") from None
        yield endpoint, log_path
    finally:
        stop_process(proc)
        if proc is not None and proc.returncode not in (0, -signal.SIGTERM):
            log(f"[colocate] {mode.name}: the daemon exited {proc.returncode}: {_last_line(log_path)}")
        shutil.rmtree(workdir, ignore_errors=True)


_DAEMON_LINES_MAX = 40


def daemon_lines(path: str) -> list[str]:
    """What the daemon said about MPS and pacing (the controller's duty changes), the last few lines."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip()[:300] for line in f if "[pace]" in line or "[mps]" in line]
    except OSError:
        return []
    return lines[-_DAEMON_LINES_MAX:]


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


@contextlib.contextmanager
def mode_setup(mode: Mode, run: Run) -> Iterator[Setup]:
    base = child_env()
    if mode.bench_mps:
        with bench_mps(run) as mps_env:
            trainer_env = {**base, **mps_env, **({"CUDA_MPS_CLIENT_PRIORITY": "1"} if mode.priority else {})}
            yield Setup(trainer_env, {**base, **mps_env},
                        note="MPS" + (", trainer at client priority 1" if mode.priority else ""))
    elif mode.sharing is not None:
        with nodeagent_daemon(mode, run) as (endpoint, log_path):
            env = {**base, "NODEAGENT_ENDPOINT": endpoint}
            yield Setup(env, env, client=True, endpoint=endpoint, note=daemon_note(mode, run.device),
                        daemon_log=log_path)
    else:
        yield Setup(base, base)


# ------------------------------------------------------------------ one mode


def worker_spec(run: Run, mode: Mode, setup: Setup, role: str) -> dict:
    spec = {**run.worker, "mode": mode.name}
    if setup.client:
        spec["client"] = {"pacer": mode.pacer and role == "trainer"}
    if role == "inference":
        spec["loads"] = [load.as_spec() for load in run.loads]
        spec["calibrate"] = spec["calibrate"] if mode.name == "alone" else 0
    return spec


def daemon_view(endpoint: str | None) -> dict | None:
    """Device 0's token counters as the daemon keeps them (None without a daemon or an answer)."""
    if endpoint is None:
        return None
    from client_lib import NodeAgentError, query_status
    try:
        status = query_status(endpoint, timeout=2.0)
    except NodeAgentError:
        return None
    activity = status.devices[0].activity if status.devices else None
    if activity is None:
        return None
    return {"grants": activity.grants, "preemptions": activity.preemptions, "enforcements": activity.enforcements,
            "wait_p50_ms": activity.wait_p50_ms, "wait_p99_ms": activity.wait_p99_ms}


def _daemon_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {"grants": after["grants"] - before["grants"], "preemptions": after["preemptions"] - before["preemptions"],
            "enforcements": after["enforcements"] - before["enforcements"],
            "token_wait_p50_ms": rounded(after["wait_p50_ms"] if after["wait_p50_ms"] is not None else math.nan),
            "token_wait_p99_ms": rounded(after["wait_p99_ms"] if after["wait_p99_ms"] is not None else math.nan)}


def _sleep_until(t_ns: int) -> None:
    delay = (t_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


def _steps_in(steps_ns: list[int], start_ns: int, end_ns: int) -> int:
    return sum(1 for t in steps_ns if start_ns <= t < end_ns)


def _us(run: Run, t_ns: int | None) -> int | None:
    return None if t_ns is None else (t_ns - run.epoch_ns) // 1000


def run_phase(run: Run, inference: Child, load: Load, index: int, start_ns: int) -> dict:
    """One load's ``run.requests`` arrivals from ``start_ns``; the window is theirs (to the last arrival)."""
    rate = run.rate_per_s[load.name]
    seed = run.seed * 1000 + index
    inference.send(op="phase", load=load.name, rate_per_s=rate, seed=seed, start_ns=start_ns, requests=run.requests)
    expected_s = run.requests / rate * 1.5 + (start_ns - time.monotonic_ns()) / 1e9
    result = inference.expect("phase", expected_s + _PHASE_SLACK_S)
    result.update(start_ns=start_ns, end_ns=result.get("window_end_ns", start_ns), seed=seed, rate_per_s=rate)
    return result


def request_record(run: Run, phase: dict) -> dict:
    """The per-request record of a phase, for bench.replay (module docstring, ``record_format``)."""
    return {"seed": phase["seed"], "rate_per_s": phase["rate_per_s"], "count": phase["offered"],
            "window_us": [_us(run, phase["start_ns"]), _us(run, phase["end_ns"])],
            "arrival_us": [_us(run, t) for t in phase["arrival_ns"]],
            "start_us": [_us(run, t) for t in phase["begin_ns"]], "end_us": [_us(run, t) for t in phase["finish_ns"]]}


def p99_with_dropped(latency_ms: list[float], dropped: int) -> float | None:
    """The p99 over every offered request, a dropped one counted as never answered: None when the
    p99 lands on one (more than 1% dropped), so a mode that drops cannot show a good p99."""
    ranked = sorted(latency_ms) + [math.inf] * dropped
    if not ranked:
        return None
    value = percentile(ranked, 99)
    return None if math.isinf(value) or math.isnan(value) else value


def inference_stats(run: Run, load: Load, phase: dict) -> dict:
    lat, service = phase["latency_ms"], phase["service_ms"]
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    alone_p99, alone_p50 = run.alone_p99_ms.get(load.name), run.alone_p50_ms.get(load.name)
    with_dropped = p99_with_dropped(lat, phase["dropped"])
    return {"p50_ms": rounded(p50), "p99_ms": rounded(p99), "max_ms": rounded(max(lat, default=math.nan)),
            "mean_ms": rounded(sum(lat) / len(lat) if lat else math.nan),
            "p50_over_alone": rounded(p50 / alone_p50, 3) if alone_p50 else None,
            "p99_over_alone": rounded(p99 / alone_p99, 3) if alone_p99 else None,
            "p99_with_dropped_ms": rounded(with_dropped) if with_dropped is not None else None,
            "service_p50_ms": rounded(percentile(service, 50)), "service_p99_ms": rounded(percentile(service, 99)),
            "offered": phase["offered"], "completed": phase["completed"], "dropped": phase["dropped"],
            "queued_at_end": phase["queued_at_end"], "latency_ms": lat, "requests": request_record(run, phase)}


def expected_mps(mode: Mode, run: Run) -> bool:
    """Whether the mode's clients are meant to run under MPS: the bench's own server, MPS named in
    the daemon's config, or the daemon's default ("auto": on for a root co-run daemon on cuda that
    finds nvidia-cuda-mps-control)."""
    if run.device != "cuda":
        return False
    if mode.bench_mps or daemon_mps(mode, run.device):
        return True
    return (mode.sharing == "corun" and mode.daemon_mps == "" and os.geteuid() == 0
            and shutil.which("nvidia-cuda-mps-control") is not None)


def mps_expectation(mode: Mode, run: Run) -> dict[str, dict]:
    """Per role, what the mode sets: MPS or not, the trainer's client priority (1 where the bench
    or the daemon sets it: every MPS mode but plain ``mps``), no memory limit (no session declares one)."""
    on = expected_mps(mode, run)
    trainer_priority = "1" if on and (mode.priority or mode.sharing is not None) else None
    return {"trainer": {"mps": on, "priority": trainer_priority, "mem_limit": None},
            "inference": {"mps": on, "priority": None, "mem_limit": None}}


def check_mps(mode: Mode, run: Run, reports: dict[str, dict], collect=None) -> dict:
    """The mode's MPS evidence (``bench.mps_evidence``); ModeFailed naming what differs from what the
    mode set. On cpu only what the processes reported is kept: there is no MPS to ask."""
    expect = mps_expectation(mode, run)
    if run.device != "cuda":
        return {"expected": expect, "clients": reports, "checked": False, "why": "cpu: no MPS"}
    from bench import mps_evidence
    gpu = run.gpu_uuid or 0
    evidence = (collect or (lambda r: mps_evidence.collect(r, nvml=lambda: mps_evidence.nvml_lists(gpu))))(reports)
    problems = mps_evidence.verify(evidence, expect)
    evidence.update(expected=expect, checked=True, problems=problems)
    if problems:
        raise ModeFailed("MPS evidence: " + "; ".join(problems), evidence)
    return evidence


def run_mode(mode: Mode, run: Run) -> dict:
    out: dict = {"status": "ok", "what": mode.what}
    with contextlib.ExitStack() as stack:
        setup = stack.enter_context(mode_setup(mode, run))
        out["setup"] = setup.note or "plain processes"
        trainer = stack.enter_context(Child(mode.name, "trainer", worker_spec(run, mode, setup, "trainer"),
                                            setup.trainer_env))
        inference = stack.enter_context(Child(mode.name, "inference", worker_spec(run, mode, setup, "inference"),
                                              setup.inference_env))
        timeout = _READY_TIMEOUT_S[run.device]
        ready = trainer.expect("ready", timeout)
        run.device_name = run.device_name or ready.get("device_name")
        inference_ready = inference.expect("ready", timeout)
        out["mps"] = check_mps(mode, run, {"trainer": ready.get("mps") or {},
                                           "inference": inference_ready.get("mps") or {}})
        if mode.name == "alone":
            return _alone(run, trainer, inference, inference_ready, out)
        trainer.send(op="run")
        start_ns = time.monotonic_ns() + int(run.settle_s * 1e9)
        loads = {}
        for index, load in enumerate(run.loads):
            if setup.endpoint is not None:  # the daemon's counters from just before the phase
                _sleep_until(start_ns - int(0.05e9))
            before = daemon_view(setup.endpoint)
            phase = run_phase(run, inference, load, index, start_ns)
            loads[load.name] = {**inference_stats(run, load, phase), "_window": (phase["start_ns"], phase["end_ns"])}
            delta = _daemon_delta(before, daemon_view(setup.endpoint))
            if delta is not None:
                loads[load.name]["daemon"] = delta
            start_ns = time.monotonic_ns() + int(0.2e9)
        trainer.send(op="pause")
        paused = trainer.expect("paused", _PHASE_SLACK_S)
        steps_ns = paused["steps_ns"]
        out["trainer_steps_us"] = [_us(run, t) for t in steps_ns]
        if paused.get("pacer"):
            out["pacer"] = paused["pacer"]
        if setup.daemon_log is not None:
            out["daemon_log"] = daemon_lines(setup.daemon_log)
    for entry in loads.values():
        start, end = entry.pop("_window")
        steps = _steps_in(steps_ns, start, end)
        steps_per_s = steps / ((end - start) / 1e9) if end > start else math.nan
        kept = steps_per_s / run.alone_steps_per_s if run.alone_steps_per_s else None
        served = entry["completed"] / entry["offered"] if entry["offered"] else None
        entry.update(steps=steps, steps_per_s=rounded(steps_per_s), kept=rounded(kept, 3) if kept is not None else None,
                     system_throughput=rounded(served + kept, 3) if None not in (served, kept) else None)
    out["loads"] = loads
    return out


def _alone(run: Run, trainer: Child, inference: Child, inference_ready: dict, out: dict) -> dict:
    """The baselines: the trainer's rate with nothing beside it, then each load's latency with nothing beside it."""
    trainer.send(op="run")
    start_ns = time.monotonic_ns() + int(run.settle_s * 1e9)
    end_ns = start_ns + int(run.phase_s * 1e9)
    _sleep_until(end_ns)
    trainer.send(op="pause")
    steps_ns = trainer.expect("paused", _PHASE_SLACK_S)["steps_ns"]
    out["trainer_steps_us"] = [_us(run, t) for t in steps_ns]
    out["trainer_window_us"] = [_us(run, start_ns), _us(run, end_ns)]
    steps = _steps_in(steps_ns, start_ns, end_ns)
    if steps == 0:
        raise ModeFailed(f"the trainer completed no step in {run.phase_s:g} s alone; raise --phase-s")
    run.alone_steps_per_s = steps / run.phase_s
    out["training"] = {"steps": steps, "steps_per_s": rounded(run.alone_steps_per_s),
                       "step_ms": rounded(1e3 / run.alone_steps_per_s)}
    inference.send(op="calibrate")  # now: the trainer is paused, nothing else runs on the device
    service = inference.expect("calibrated", _PHASE_SLACK_S)["service_ms"]
    for load in run.loads:
        run.rate_per_s[load.name] = (load.rate_per_s if load.rate_per_s is not None
                                     else load.fraction * 1e3 / service[load.name])
    loads = {}
    for index, load in enumerate(run.loads):
        phase = run_phase(run, inference, load, index, time.monotonic_ns() + int(0.2e9))
        lat = phase["latency_ms"]
        if not lat:
            raise ModeFailed(f"no request of load {load.name} completed alone; raise --requests")
        run.alone_p99_ms[load.name], run.alone_p50_ms[load.name] = percentile(lat, 99), percentile(lat, 50)
        loads[load.name] = {**inference_stats(run, load, phase), "steps": None, "steps_per_s": None, "kept": None,
                            "system_throughput": None}
    out["loads"] = loads
    out["service_ms"] = {name: rounded(ms) for name, ms in service.items()}
    return out


# ------------------------------------------------------------------ the run


def first_gpu() -> tuple[str, str] | None:
    """(UUID, name) of the GPU the children see as cuda:0, from NVML (no CUDA here); None without one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None
    from nodeagent.nvml import NA, Nvml, NvmlError, NvmlUnavailable
    nvml = Nvml()
    try:
        count = nvml.query("nvmlDeviceGetCount")
        if count is NA or not count:
            return None
        wanted = (visible or "0").split(",")[0].strip()
        for index in range(count):
            handle = nvml.query("nvmlDeviceGetHandleByIndex", index)
            uuid, name = nvml.query("nvmlDeviceGetUUID", handle), nvml.query("nvmlDeviceGetName", handle)
            # An index in CUDA_VISIBLE_DEVICES is taken as NVML's: right on one-GPU hosts and PCI order.
            if wanted == str(index) or (wanted.startswith("GPU-") and uuid.startswith(wanted)):
                return (uuid, name if name is not NA else "GPU")
        return None
    except (NvmlUnavailable, NvmlError, ImportError):
        return None
    finally:
        nvml.shutdown()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the usage block
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    modes = "\n".join(f"  {m.name:<17} {m.what}" + (" (cuda only)" if m.cuda_only else "") for m in MODES.values())
    ap = _Parser(
        prog="python -m bench.colocate", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[2],
        epilog=f"modes (alone always runs: every rate and ratio comes from it):\n{modes}\n\n"
               "defaults on cuda: " + _defaults_text("cuda") + "\ndefaults on cpu: " + _defaults_text("cpu") +
               "\n\nexit status: 0 every mode asked for ran or was skipped with a reason; 1 a mode failed "
               "(the JSON says which and why); 2 bad arguments; 130 interrupted (what was measured is printed)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout (the table and "
                    "progress go to stderr)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="where both jobs run (default: cuda if NVML finds a "
                    "GPU, else cpu); the nodeagent daemon runs on the same backend")
    ap.add_argument("--modes", type=parse_modes, default=list(MODES), metavar="M1,M2",
                    help="the modes to run, comma-separated (default: all; cuda-only ones are skipped on cpu)")
    ap.add_argument("--loads", type=parse_loads, metavar="NAME=MODEL:BATCH:RATE,...",
                    help="inference loads, each a model, a batch and a rate in requests per second (or, as 0.3x, a "
                         f"fraction of the capacity measured alone); models: {', '.join(MODEL_NAMES)}")
    ap.add_argument("--trainer", type=parse_trainer, metavar="MODEL:BATCH",
                    help="the training job: SGD, bf16 autocast on cuda (e.g. gpt-small:16)")
    ap.add_argument("--phase-s", type=positive_float, help="seconds of the trainer's window alone")
    ap.add_argument("--requests", type=positive_int, help="requests per cell (mode and load): a phase lasts as long "
                    "as they take to arrive (default: 600 on cuda, 120 on cpu)")
    ap.add_argument("--budget-s", type=positive_float, help="start a mode only if the longest mode so far fits the "
                    "seconds left of this budget; the others are skipped-budget, never cut")
    ap.add_argument("--quick", action="store_true", help=f"a small run for tests: --requests {QUICK['requests']} "
                    f"--phase-s {QUICK['phase_s']:g} --settle-s {QUICK['settle_s']:g} (options given win)")
    ap.add_argument("--settle-s", type=positive_float, help="seconds the trainer runs before the first phase")
    ap.add_argument("--input-size", type=positive_int, help="image side in pixels for the CNNs")
    ap.add_argument("--seq-len", type=positive_int, help="tokens per sequence for the transformers")
    ap.add_argument("--max-backlog", type=positive_int, default=64,
                    help="requests that may wait; an arrival beyond is dropped and counted (default: 64)")
    ap.add_argument("--threads", type=int, help="torch threads per process (default: 1 on cpu, torch's on cuda)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the models, batches and arrivals (default: 0)")
    ap.add_argument("--worker", choices=["trainer", "inference"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    return ap


def _defaults_text(device: str) -> str:
    d = DEFAULTS[device]
    return (f"--loads {d['loads']} --trainer {d['trainer']} --requests {d['requests']} --phase-s {d['phase_s']:g} "
            f"--settle-s {d['settle_s']:g} --input-size {d['input_size']} --seq-len {d['seq_len']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        from bench.colocate_worker import main as worker_main
        return worker_main(args.worker, args.spec or "{}")
    signal.signal(signal.SIGTERM, _raise_interrupted)
    gpu = first_gpu() if args.device != "cpu" else None
    device = args.device or ("cuda" if gpu else "cpu")
    if device == "cuda" and gpu is None:
        log("[colocate] NVML names no GPU here: the workers will ask torch, and the MPS modes cannot run")
    d = {**DEFAULTS[device], **(QUICK if args.quick else {})}
    run = Run(device=device, loads=args.loads or parse_loads(d["loads"]),
              trainer=args.trainer or parse_trainer(d["trainer"]), phase_s=args.phase_s or d["phase_s"],
              settle_s=args.settle_s or d["settle_s"], max_backlog=args.max_backlog, seed=args.seed,
              requests=args.requests or d["requests"], budget_s=args.budget_s,
              worker={"device": device, "seed": args.seed, "input_size": args.input_size or d["input_size"],
                      "seq_len": args.seq_len or d["seq_len"],
                      "threads": d["threads"] if args.threads is None else args.threads,
                      "max_backlog": args.max_backlog, "warmup_requests": d["warmup_requests"],
                      "calibrate": d["calibrate"], "calibrate_s": d["calibrate_s"]},
              gpu_uuid=gpu[0] if gpu else None, device_name=gpu[1] if gpu else None)
    run.worker["trainer"] = {"model": run.trainer[0], "batch": run.trainer[1], "warmup_steps": d["warmup_steps"]}
    if os.environ.get("NODEAGENT_ENDPOINT"):
        log("[colocate] NODEAGENT_ENDPOINT is ignored: each nodeagent mode starts a daemon with its own settings")
    asked = ["alone"] + [m for m in args.modes if m != "alone"]
    if "alone" not in args.modes:
        log("[colocate] alone runs too: every rate and ratio comes from it")
    result = _skeleton(run, asked)
    started = time.monotonic()
    code = 0
    try:
        for name in asked:
            _one_mode(MODES[name], run, result, started)
    except KeyboardInterrupt:
        close_live()
        result["interrupted"] = True
        log("[colocate] interrupted: everything started was stopped; the modes measured so far follow")
        code = 130
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["device"] = run.device_name or result["device"]
    result["trainer"].update(alone_steps_per_s=rounded(run.alone_steps_per_s or math.nan))
    for load in run.loads:
        result["loads"][load.name].update(rate_per_s=rounded(run.rate_per_s.get(load.name, math.nan)))
    print_table(result)
    if args.json:
        print(json.dumps(result), flush=True)
    return code or (1 if result["failed"] else 0)


def _raise_interrupted(signum, frame):
    raise Interrupted()


def _skeleton(run: Run, asked: list[str]) -> dict:
    return {"benchmark": "colocate", "backend": run.device, "device": run.device_name or run.device,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "hostname": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "record_format": RECORD_FORMAT,
            "parameters": {"phase_s": run.phase_s, "settle_s": run.settle_s, "max_backlog": run.max_backlog,
                           "requests_per_cell": run.requests, "budget_s": run.budget_s,
                           "seed": run.seed, "input_size": run.worker["input_size"], "seq_len": run.worker["seq_len"],
                           "threads": run.worker["threads"],
                           "inference": "eval, torch.inference_mode(), fp32, input resident, result copied to host",
                           "training": "SGD momentum 0.9" + (", bf16 autocast" if run.device == "cuda" else "")},
            "trainer": {"model": run.trainer[0], "batch": run.trainer[1]},
            "loads": {load.name: {"model": load.model, "batch": load.batch, "rate_fraction": load.fraction,
                                  "rate_fixed_per_s": load.rate_per_s, "seed": run.seed * 1000 + index}
                      for index, load in enumerate(run.loads)},
            "default_mode": DEFAULT_MODE, "modes_asked": asked, "modes": {}, "skipped": {}, "failed": {},
            "interrupted": False}


def expected_seconds(result: dict) -> float | None:
    """What the next mode is expected to take: the longest mode measured so far but alone (which
    also calibrates), else alone's; None before any."""
    done = {m: e["seconds"] for m, e in result["modes"].items() if e.get("seconds")}
    others = [v for m, v in done.items() if m != "alone"]
    return max(others) if others else done.get("alone")


def _one_mode(mode: Mode, run: Run, result: dict, run_started: float | None = None) -> None:
    """Run one mode and file it under modes, and under skipped or failed with a reason in one line."""
    reason = error = entry = evidence = None
    status = "skipped"
    started = time.monotonic()
    expected = expected_seconds(result)
    left = None if run.budget_s is None else run.budget_s - (started - (run_started or started))
    if mode.cuda_only and run.device != "cuda":
        reason = f"needs cuda (MPS); this run is on {run.device}"
    elif mode.name != "alone" and run.alone_steps_per_s is None:
        error = "not run: alone failed, so there is no capacity to set the rates from"
    elif left is not None and expected is not None and expected * 1.1 > left:
        status = "skipped-budget"
        reason = f"{left:.0f} s of --budget-s left, a mode takes about {expected:.0f} s: not started"
    else:
        log(f"[colocate] {mode.name}: {mode.what}")
        try:
            entry = run_mode(mode, run)
        except ModeSkipped as exc:
            reason = str(exc)
        except ModeFailed as exc:
            error, evidence = str(exc), exc.evidence
        except OSError as exc:  # a folder or a process the bench could not make
            error = f"{type(exc).__name__}: {exc}"
    seconds = round(time.monotonic() - started, 1)
    if entry is not None:
        result["modes"][mode.name] = {**entry, "seconds": seconds}
        if mode.name == "alone":
            for load in run.loads:
                ms = entry["service_ms"][load.name]
                result["loads"][load.name].update(alone_service_ms=ms, capacity_per_s=rounded(1e3 / ms))
    elif reason is not None:
        log(f"[colocate] {mode.name} skipped: {reason}")
        result["skipped"][mode.name] = reason
        result["modes"][mode.name] = {"status": status, "reason": reason}
    else:
        log(f"[colocate] {mode.name} failed: {error}")
        result["failed"][mode.name] = error
        result["modes"][mode.name] = {"status": "failed", "error": error, "seconds": seconds,
                                      **({"mps": evidence} if evidence is not None else {})}


def _num(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_table(result: dict) -> None:
    """The readable table, on stderr."""
    log(f"[colocate] {result['device']} ({result['backend']}); trainer {result['trainer']['model']} batch "
        f"{result['trainer']['batch']}: {_num(result['trainer'].get('alone_steps_per_s'), '.2f')} steps/s alone")
    for name, load in result["loads"].items():
        share = (f"{load['rate_fraction']:g} of capacity" if load.get("rate_fraction") is not None else "fixed; capacity")
        log(f"\nload {name}: {load['model']} batch {load['batch']} at {_num(load.get('rate_per_s'), '.1f')} req/s "
            f"({share} {_num(load.get('capacity_per_s'), '.1f')}/s)")
        log(f"  {'mode':<17} {'p50 ms':>8} {'p99 ms':>9} {'max ms':>9} {'p99/alone':>9} {'dropped':>7} "
            f"{'queued':>6} {'kept':>6} {'system':>6}")
        for mode, entry in result["modes"].items():
            if entry["status"] != "ok":
                log(f"  {mode:<17} {entry['status']}: {entry.get('reason') or entry.get('error')}")
                continue
            e = entry["loads"][name]
            kept = "-" if e["kept"] is None else f"{e['kept'] * 100:.0f}%"
            log(f"  {mode:<17} {_num(e['p50_ms'], '.1f'):>8} {_num(e['p99_ms'], '.1f'):>9} "
                f"{_num(e['max_ms'], '.1f'):>9} {_num(e['p99_over_alone'], '.2f') + 'x':>9} {e['dropped']:>7} "
                f"{e['queued_at_end']:>6} {kept:>6} {_num(e['system_throughput'], '.2f'):>6}")
    log(f"\n[colocate] {result.get('elapsed_s')} s")


if __name__ == "__main__":
    sys.exit(main())
