"""What every benchmark shares: the daemon it runs against, real work, stats, output.

A benchmark uses the daemon at ``NODEAGENT_ENDPOINT`` when that is set
("external") and otherwise starts its own ``nodeagent serve`` on a private
socket ("own daemon"), stopped with SIGTERM when the run ends: on the backend
its work runs on (``--backend cuda`` for GPU work, so that the daemon's NVML
watcher, MPS and device faults are in what is measured; cpu otherwise). Clients
are forked processes that each open their own :class:`client_lib.Client`.
Times taken in different processes come from ``time.monotonic_ns()``
(CLOCK_MONOTONIC on Linux), so they compare across processes.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from client_lib import Client, DaemonUnavailableError, query_status
from client_lib.endpoint import ENV_ENDPOINT

OWN = "own daemon"
EXTERNAL = "external"
_START_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 10.0

# fork: client_lib needs no torch, so a forked child starts in milliseconds.
# Every Client is created inside the child: a Client owns one unix socket and
# the library starts its liveness thread in the process of the first Client.
# The parent opens no Client, only one-shot queries (query_status) that close
# their socket before returning, so a child inherits no daemon connection and
# no thread (tests/bench/test_bench.py checks a forked child still gets its session).
mp_context = mp.get_context("fork")
_RETRY_S = 0.005  # between attempts to reach a daemon that is not listening yet


def log(message: str) -> None:
    """Progress for people: always stderr, so stdout stays one JSON object."""
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------- daemon


@dataclass
class DaemonHandle:
    """The daemon a benchmark talks to."""

    endpoint: str
    kind: str  # OWN or EXTERNAL
    proc: subprocess.Popen | None = None
    workdir: str | None = None
    args: list[str] = field(default_factory=list)
    metrics_port: int | None = None

    @property
    def log_path(self) -> str | None:
        return os.path.join(self.workdir, "daemon.log") if self.workdir else None


def free_tcp_port() -> int:
    """A port that was free a moment ago (for the own daemon's metrics server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_daemon(endpoint: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Return once ``query_status`` answers; raise if the daemon exits or never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            query_status(endpoint, timeout=0.5)
            return
        except DaemonUnavailableError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with status {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no daemon answered at {endpoint} within {timeout_s:.0f} s") from None
            time.sleep(_RETRY_S)  # nothing listens yet: connecting fails at once, do not spin


@contextmanager
def daemon(extra_args: Sequence[str] = (), *, metrics: bool = False, log_keep=None,
           backend: str = "cpu") -> Iterator[DaemonHandle]:
    """The external daemon if ``NODEAGENT_ENDPOINT`` is set, else a private one.

    ``extra_args`` (e.g. ``--quantum-ms training=50``) and ``metrics`` only
    apply to a daemon started here; an external one is used as it is.
    ``log_keep(line)`` picks the lines of its log relayed at the end (see :func:`relay_log`).
    ``backend``: the own daemon's (see :func:`daemon_backend`).
    """
    endpoint = os.environ.get(ENV_ENDPOINT)
    if endpoint:
        wait_for_daemon(endpoint, 5.0)
        log(f"[bench] using the external daemon at {endpoint}")
        yield DaemonHandle(endpoint, EXTERNAL)
        return
    workdir = tempfile.mkdtemp(prefix="nodeagent-bench-")
    handle = DaemonHandle(f"ipc://{workdir}/agent.sock", OWN, workdir=workdir)
    handle.args = serve_args(handle.endpoint, os.path.join(workdir, "state"), extra_args, backend=backend)
    if metrics:
        handle.metrics_port = free_tcp_port()
        handle.args += ["--metrics-port", str(handle.metrics_port)]
    failed = True
    try:
        handle.proc = spawn_daemon(handle.args, handle.log_path)
        wait_for_daemon(handle.endpoint, _START_TIMEOUT_S, handle.proc)
        log(f"[bench] started nodeagent pid={handle.proc.pid} on {handle.endpoint} (backend {backend})")
        yield handle
        failed = False
    finally:
        _stop_daemon(handle)
        relay_log(handle.log_path, everything=failed, keep=log_keep)
        shutil.rmtree(workdir, ignore_errors=True)


def daemon_backend(device: str | None) -> str:
    """The backend of the daemon for work on ``device``: "cuda" for GPU work (``cuda``, ``cuda:N``),
    so that what the daemon does on a GPU (NVML's process lists and Xids, MPS) is in the measurement;
    "cpu" otherwise."""
    return "cuda" if str(device or "").startswith("cuda") else "cpu"


def serve_args(endpoint: str, state_dir: str, extra_args: Sequence[str] = (),
               log_level: str = "warning", backend: str = "cpu") -> list[str]:
    """The command line of a private ``nodeagent serve --backend BACKEND``."""
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be cpu or cuda, not {backend!r}")
    # No warm workers unless a benchmark asks: their start-up would share the cores with what is measured.
    ctxpool = () if "--ctxpool" in extra_args else ("--ctxpool", "off")
    return [sys.executable, "-m", "nodeagent", "serve", "--backend", backend, "--endpoint", endpoint,
            "--state-dir", state_dir, "--log-level", log_level, *ctxpool, *extra_args]


def spawn_daemon(args: Sequence[str], log_path: str) -> subprocess.Popen:
    """Start ``args`` (see :func:`serve_args`) with stdout and stderr appended to ``log_path``."""
    with open(log_path, "ab") as daemon_log:
        return subprocess.Popen(list(args), stdout=daemon_log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def daemon_status(endpoint: str, timeout_s: float = 5.0):
    """The daemon's status snapshot, over a connection of its own that is closed
    before this returns (safe to fork after)."""
    return query_status(endpoint, timeout=timeout_s)


def _stop_daemon(handle: DaemonHandle) -> None:
    stop_process(handle.proc)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a child process starts and is recorded; they land after.

    A signal caught inside ``subprocess.Popen``, after the fork and before it returns, leaves a
    process no one holds: one started in its own session never sees the Ctrl-C and outlives the
    driver. Only the main thread handles signals, so elsewhere this holds nothing."""
    held = (signal.SIGINT, signal.SIGTERM)
    # None: a handler set outside Python, which signal.signal could not put back.
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, held):
        yield
        return
    caught: list[int] = []
    before = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)  # to the handler it would have reached


def stop_process(proc: subprocess.Popen | None, timeout_s: float = _STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log(f"[bench] pid={proc.pid} ({os.path.basename(str(proc.args[0]))}) ignored SIGTERM for "
            f"{timeout_s:.0f} s; killing it")
        proc.kill()
        proc.wait()


def relay_log(path: str | None, everything: bool = False, keep=None, prefix: str = "[daemon]",
              last: int = 40) -> None:
    """Pass on what a daemon logged (the own one runs at --log-level warning):
    the last ``last`` lines, all of them on failure
    (``everything``), else those ``keep(line)`` accepts (default: all but the ready line)."""
    if not path or not os.path.exists(path):
        return
    if keep is None:
        keep = lambda line: "nodeagent: ready" not in line  # noqa: E731
    with open(path, errors="replace") as f:
        lines = [line.rstrip() for line in f if everything or keep(line)]
    for line in lines[-last:]:
        log(f"{prefix} {line}")


def scrape_metrics(port: int, timeout_s: float = 2.0) -> dict[str, float]:
    """The own daemon's Prometheus samples as {"name{labels}": value}."""
    from urllib.request import urlopen
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                pass
    return samples


# ----------------------------------------------------------------------- work


class Work:
    """A real unit of CPU work: ``rounds`` SHA-256 digests of a 64 KiB buffer."""

    def __init__(self, rounds: int) -> None:
        self.rounds = max(1, int(rounds))
        self._blob = os.urandom(1 << 16)

    def __call__(self) -> bytes:
        digest = b""
        for _ in range(self.rounds):
            digest = hashlib.sha256(self._blob).digest()
        return digest

    @classmethod
    def calibrated(cls, target_ms: float) -> "Work":
        """Rounds that take about ``target_ms`` on this machine now (median of a few tries)."""
        probe = cls(20)
        probe()  # warm caches
        tries = []
        for _ in range(7):
            t0 = time.perf_counter_ns()
            probe()
            tries.append((time.perf_counter_ns() - t0) / 20)
        ns_per_round = sorted(tries)[len(tries) // 2]
        return cls(round(target_ms * 1e6 / ns_per_round))


def clipped_ns(begin_ns: int, end_ns: int, window: tuple[int, int]) -> int:
    """Length of [begin, end] inside ``window``."""
    return max(0, min(end_ns, window[1]) - max(begin_ns, window[0]))


def train_until(client: Client, work: Work, window: tuple[int, int]) -> dict:
    """Hold the token back to back until ``window`` ends, one work unit then a
    ``yield_point()`` at a time, like a training loop.

    Held time is measured by the client: from a grant observed to the
    yield_point() that gave the token back (it releases first thing), clipped
    to ``window`` (monotonic ns). Waits inside yield_point() are not held time.
    """
    now = time.monotonic_ns
    held_ns = units = 0
    with client.slice():
        grants, t_grant = 1, now()
        while t_grant < window[1]:
            work()
            units += 1
            t_yield = now()
            if t_yield >= window[1]:
                break
            if client.yield_point():
                held_ns += clipped_ns(t_grant, t_yield, window)
                grants += 1
                t_grant = now()
        held_ns += clipped_ns(t_grant, now(), window)
    return {"held_ns": held_ns, "grants": grants, "units": units}


def sleep_until_ns(t_ns: int) -> None:
    """Idle until a monotonic time (a start line, never a stand-in for work)."""
    delay = (t_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


@dataclass
class Requests:
    """Requests made by :func:`timed_requests`, one entry per request (monotonic ns)."""

    asked_ns: list[int] = field(default_factory=list)  # acquire called
    granted_ns: list[int] = field(default_factory=list)  # grant observed
    done_ns: list[int] = field(default_factory=list)  # work done, just before the release

    @property
    def waits_ns(self) -> list[int]:
        return [g - a for a, g in zip(self.asked_ns, self.granted_ns)]

    def as_dict(self) -> dict:
        return {"asked_ns": self.asked_ns, "granted_ns": self.granted_ns, "done_ns": self.done_ns}

    @classmethod
    def from_dict(cls, d: dict) -> "Requests":
        return cls(list(d["asked_ns"]), list(d["granted_ns"]), list(d["done_ns"]))


def timed_requests(client: Client, work: Work, first_ns: int, period_ns: int, until_ns: int) -> Requests:
    """``with client.slice(): work()`` once per period from ``first_ns`` until
    ``until_ns``, like an inference server; when each was asked, granted, done.

    A request that comes due late is made at once and the schedule moves on
    from there (no burst to catch up)."""
    now = time.monotonic_ns
    out = Requests()
    due = first_ns
    while due < until_ns:
        sleep_until_ns(due)
        asked = now()
        with client.slice():
            out.granted_ns.append(now())
            work()
            out.done_ns.append(now())
        out.asked_ns.append(asked)
        due = max(due + period_ns, now())
    return out


class ProgressLog(threading.Thread):
    """Reads a worker's progress lines, ``<units> <monotonic_ns>``, from a pipe
    until it closes (or :meth:`close`), and keeps them as (ns, units) in order.

    The worker stamps each line itself, so a reader that lags changes nothing."""

    def __init__(self, stream, name: str = "progress") -> None:
        super().__init__(name=f"bench-{name}", daemon=True)
        self._stream = stream
        self.points: list[tuple[int, int]] = []
        self.first = threading.Event()
        self.bad_lines = 0

    def run(self) -> None:
        try:
            for raw in self._stream:
                try:
                    units, t_ns = raw.split()
                    self.points.append((int(t_ns), int(units)))
                except ValueError:
                    self.bad_lines += 1
                    continue
                self.first.set()
        except (OSError, ValueError):  # closed under us
            pass

    def close(self) -> None:
        try:
            self._stream.close()
        except OSError:
            pass
        self.join(2.0)

    def units_between(self, begin_ns: int, end_ns: int) -> int:
        """Units completed in [begin_ns, end_ns)."""
        return sum(1 for t, _ in self.points if begin_ns <= t < end_ns)

    def units_in(self, windows: Sequence[tuple[int, int]]) -> int:
        """Units completed inside any of the (sorted, disjoint) ``windows``."""
        times = [t for t, _ in self.points]
        return sum(bisect.bisect_left(times, e) - bisect.bisect_left(times, b) for b, e in windows)


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """One sample of :func:`scrape_metrics`' output (0 if the series does not exist yet)."""
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return samples.get(key, 0.0)


# ---------------------------------------------------------------------- stats


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def rounded(value: float, digits: int = 3) -> float | None:
    """JSON-safe rounding (NaN becomes null)."""
    return None if value is None or math.isnan(value) else round(value, digits)


# --------------------------------------------------------------- arguments/IO


_ENDPOINT_HELP = ("use the daemon listening there instead of starting a private\n"
                  "                      `nodeagent serve` (cuda for GPU work, else cpu; its own settings apply)")


def parser(prog: str, description: str, epilog: str = "", endpoint_help: str = _ENDPOINT_HELP
           ) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has (``endpoint_help``:
    what NODEAGENT_ENDPOINT does to this one)."""
    ap = argparse.ArgumentParser(
        prog=f"python -m bench.{prog}", description=description, allow_abbrev=False,
        epilog=(epilog + "\n\n" if epilog else "") + "environment:\n  NODEAGENT_ENDPOINT  " + endpoint_help,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true",
                    help="print exactly one JSON object on stdout (progress still goes to stderr)")
    return ap


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def emit(result: dict, as_json: bool) -> None:
    """The result: one JSON line on stdout with ``--json``, else ``key: value`` lines."""
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        width = max(len(k) for k in result)
        for key, value in result.items():
            print(f"{key:<{width}}  {value}")


# -------------------------------------------------------------------- workers


class WorkerControl:
    """A worker's side of the start and end barriers (see :class:`Workers`)."""

    def __init__(self, index: int, queue, go, close, start_ns) -> None:
        self.index = index
        self._queue, self._go, self._close, self._start_ns = queue, go, close, start_ns

    def ready(self, info=None) -> int:
        """Report ``info`` (e.g. a session id), wait for the start; returns its monotonic ns."""
        self._queue.put(("ready", self.index, info))
        self._go.wait()
        return self._start_ns.value

    def result(self, value) -> None:
        """Hand the results over, then wait until the parent says to close sessions."""
        self._queue.put(("result", self.index, value))
        self._close.wait()


def _worker_main(index, queue, go, close, start_ns, fn, args) -> None:
    try:
        fn(WorkerControl(index, queue, go, close, start_ns), *args)
    except BaseException:
        queue.put(("error", index, traceback.format_exc()))
        raise SystemExit(1)


class Workers:
    """Forked client processes with a start barrier and an end barrier.

    Each worker runs ``fn(control, *args)``: it opens its Client, calls
    ``control.ready(...)`` (everyone starts together once all are connected, so
    start-up skew is not measured), works, then ``control.result(...)``, which
    returns once the parent has read the results (and, say, the daemon's
    status while the sessions still exist).
    """

    def __init__(self) -> None:
        self._queue = mp_context.Queue()
        self._go = mp_context.Event()
        self._close = mp_context.Event()
        self._start_ns = mp_context.Value("q", 0, lock=False)
        self.procs: list[mp.process.BaseProcess] = []

    def start(self, fn, *args) -> None:
        proc = mp_context.Process(target=_worker_main, daemon=True, args=(
            len(self.procs), self._queue, self._go, self._close, self._start_ns, fn, args))
        proc.start()
        self.procs.append(proc)

    def wait_ready(self, timeout_s: float) -> list:
        """What each worker passed to ``ready()``, in start order, once all have."""
        return self._gather("ready", timeout_s)

    def go(self, delay_s: float = 0.0) -> int:
        """Start every worker at ``now + delay_s``; returns that time in monotonic ns."""
        self._start_ns.value = time.monotonic_ns() + int(delay_s * 1e9)
        self._go.set()
        return self._start_ns.value

    def results(self, timeout_s: float) -> list:
        """What each worker passed to ``result()``, in start order."""
        return self._gather("result", timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the workers close their sessions and exit; kill any that hang."""
        self._close.set()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                log(f"[bench] worker pid={proc.pid} did not exit; killing it")
                proc.kill()
                proc.join()

    def _gather(self, kind: str, timeout_s: float) -> list:
        items: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(items) < len(self.procs):
            try:
                got, index, value = self._queue.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"worker(s) died with exit codes {dead}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {len(items)} of {len(self.procs)} workers reported "
                                       f"{kind!r} within {timeout_s:.0f} s") from None
                continue
            if got == "error":
                raise RuntimeError(f"worker {index} failed:\n{value}")
            if got != kind:
                raise RuntimeError(f"expected {kind!r} from worker {index}, got {got!r}")
            items[index] = value
        return [items[i] for i in range(len(self.procs))]

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close(timeout_s=10.0 if exc[0] is None else 2.0)


class RoundGate:
    """Lets a group of workers run in rounds that the parent starts and waits for,
    so that measurements of different things can be interleaved round by round
    (while one group runs, every other one sleeps in the barrier, using no CPU).

    A worker calls :meth:`enter` before each round and :meth:`leave` after it; the
    parent calls :meth:`run_round`, which returns once every worker has left. A
    worker that dies breaks the barrier, and the parent's wait raises."""

    def __init__(self, workers: int, timeout_s: float = 120.0) -> None:
        self._barrier = mp_context.Barrier(workers + 1)
        self.timeout_s = timeout_s

    def enter(self) -> None:
        self._barrier.wait(self.timeout_s)

    def leave(self) -> None:
        self._barrier.wait(self.timeout_s)

    def run_round(self) -> tuple[int, int]:
        """Start a round and wait for its end; (start, end) in monotonic ns."""
        self._barrier.wait(self.timeout_s)
        t0 = time.monotonic_ns()
        self._barrier.wait(self.timeout_s)
        return t0, time.monotonic_ns()

    def abort(self) -> None:
        """Break the barrier: every worker waiting in it raises (used on failure)."""
        self._barrier.abort()
