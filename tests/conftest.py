"""Fixtures that run the real daemon on a private ipc socket: as a subprocess (``daemon``,
``start_daemon``), or in a thread of the test process (``inproc_daemon``, ``start_inproc_daemon``)."""

from __future__ import annotations

import os
import shutil
import socket
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from client_lib import DaemonUnavailableError, query_status

REPO = Path(__file__).resolve().parent.parent


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.005):
    """Poll ``predicate`` until it returns something true (returned), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


# Runs argv[3:] with RLIMIT_NOFILE set to (argv[1], argv[2]): a daemon started at a given descriptor limit.
_WITH_NOFILE = ("import os, resource, sys; "
                "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
                "os.execv(sys.argv[3], sys.argv[3:])")


class Daemon:
    """A ``nodeagent serve`` process started for one test (``nofile``: its RLIMIT_NOFILE, soft and hard)."""

    def __init__(self, workdir: str, extra_args: list[str], endpoint: str | None = None,
                 nofile: tuple[int, int] | None = None) -> None:
        self.workdir = workdir
        self.nofile = nofile
        self.socket_path = os.path.join(workdir, "agent.sock")
        self.endpoint = endpoint or f"ipc://{self.socket_path}"
        self.extra_args = extra_args
        self.log_path = os.path.join(workdir, "daemon.log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 15.0) -> "Daemon":
        log = open(self.log_path, "ab")
        config = os.path.join(self.workdir, "nodeagent.toml")
        if not os.path.exists(config):
            open(config, "w").close()  # hermetic: never the host's /etc/nodeagent/nodeagent.toml
        limit = () if self.nofile is None else (sys.executable, "-c", _WITH_NOFILE, *map(str, self.nofile))
        self.proc = subprocess.Popen(
            [*limit, sys.executable, "-m", "nodeagent", "serve", "--config", config, "--backend", "cpu",
             "--endpoint", self.endpoint,
             "--state-dir", os.path.join(self.workdir, "state"), "--log-level", "debug",
             # Warm workers cost seconds of CPU per start; only the tests that use them ask.
             *(() if "--ctxpool" in self.extra_args else ("--ctxpool", "off")), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                query_status(self.endpoint, timeout=0.2)
                return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()  # never leave a half-started daemon behind
                    raise RuntimeError(f"daemon did not start:\n{self.log()}") from None

    def status(self):
        return query_status(self.endpoint, timeout=5)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nodeagent(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``python -m nodeagent ARGS`` from the repository to the end; its output as text."""
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.fixture
def workdir():
    # ipc socket paths must stay under 107 bytes: pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="na-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(workdir):
    """Factory: ``start_daemon("--quantum-ms", "training=20")`` -> running :class:`Daemon`.
    Started again in the same test, it reuses the endpoint and state dir (a restart)."""
    started: list[Daemon] = []

    def start(*extra_args: str, endpoint: str | None = None, nofile: tuple[int, int] | None = None) -> Daemon:
        d = Daemon(workdir, list(extra_args), endpoint, nofile).start()
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            code = d.stop()
            assert code == 0, f"daemon exited {code} on SIGTERM:\n{d.log()}"


@pytest.fixture
def daemon(start_daemon) -> Daemon:
    return start_daemon()


@pytest.fixture
def start_inproc_daemon(workdir):
    """Factory like :func:`start_daemon`, for tests of policy: the real daemon in a thread of
    this process (:class:`tests.inproc.InprocDaemon`), no ``nodeagent serve`` process."""
    from tests.inproc import InprocDaemon
    started: list[InprocDaemon] = []

    def start(*extra_args: str, endpoint: str | None = None) -> InprocDaemon:
        d = InprocDaemon(workdir, list(extra_args), endpoint).start()
        started.append(d)
        return d

    yield start
    for d in started:
        code = d.stop()
        assert code == 0, f"in-process daemon failed: {d.failure!r}\n{d.log()}"


@pytest.fixture
def inproc_daemon(start_inproc_daemon):
    return start_inproc_daemon()


class Child:
    """A ``tests/child_client.py`` process; read its event lines with :meth:`expect`."""

    def __init__(self, endpoint: str, *args: str) -> None:
        env = dict(os.environ, NODEAGENT_ENDPOINT=endpoint, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.child_client", *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[tuple[str, float, str]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            event, _, rest = line.rstrip("\n").partition(" ")
            t, _, detail = rest.partition(" ")
            with self._cond:
                self.lines.append((event, float(t), detail))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def expect(self, event: str, count: int = 1, timeout: float = 10.0) -> tuple[str, float, str]:
        """Wait for the ``count``-th line of ``event``; returns it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                hits = [line for line in self.lines if line[0] == event]
                if len(hits) >= count:
                    return hits[count - 1]
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    err = self.proc.stderr.read() if self.proc.poll() is not None else ""
                    raise AssertionError(f"no {event} #{count} from child; lines={self.lines} stderr={err}")
                self._cond.wait(left)

    def events(self, event: str) -> list[tuple[str, float, str]]:
        with self._cond:
            return [line for line in self.lines if line[0] == event]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def spawn():
    children: list[Child] = []

    def make(endpoint: str, *args: str) -> Child:
        child = Child(endpoint, *args)
        children.append(child)
        return child

    yield make
    for child in children:
        child.kill()


# ------------------------------------------------------------------ the Ray scenario, beside the rest

# The scenario's two runs (tests/ray_background.py) take minutes of waiting on Ray: they start
# when collection ends, in the background, while the suite goes on. First run the modules that
# time nothing (pure logic, documents, renders: a busy core only makes them slower), then the
# rest, then the benchmarks' tests (they compare timings: Ray is done by then); the scenario's
# module runs last and reads the runs' outcomes.
SCENARIO_MODULE = "test_ray_scenario.py"
SCENARIO_RUNS = {"test_ray_colocate_lends_reclaims_resizes_and_loses_no_work": "full",
                 "test_a_run_stopped_while_the_job_trains_stops_everything_it_started": "stopped"}
TIME_NOTHING = {
    "test_authz.py", "test_cluster_endpoint.py", "test_cluster_sim.py", "test_config.py", "test_daemon_shape.py",
    "test_grouping.py", "test_job_signals.py", "test_journal.py", "test_k8s_manifests.py", "test_k8s_proto.py",
    "test_k8s_shares.py", "test_lifecycle.py", "test_memory_policy.py", "test_no_abbrev.py", "test_partition.py",
    "test_protocol.py", "test_protocol_doc.py", "test_ray_addresses.py", "test_ray_policies.py",
    "test_ray_policy.py", "test_scheduler.py", "test_scheduler_model.py", "test_sessions.py", "test_store.py",
    "test_tensors.py", "test_bench_report.py", "test_gpu_check.py", "test_hostile.py", "test_one_holder.py",
    "test_bootstrap.py",
}
# The benchmarks' own tests compare timings against baselines: once Ray is done, at the end.
MEASURE_MOST = {
    "test_bench.py", "test_bench_colocate.py", "test_bench_reclaim.py", "test_bench_scale.py",
    "test_bench_scrapers.py", "test_bench_switch.py", "test_metrics_storm.py", "test_corun.py", "test_llm_server.py",
}


def pytest_collection_modifyitems(config, items):
    if not any(item.path.name == SCENARIO_MODULE for item in items):
        return
    def rank(item) -> int:
        name = item.path.name
        if name in TIME_NOTHING:
            return 0
        if name == SCENARIO_MODULE:
            return 3
        return 2 if name in MEASURE_MOST else 1
    items.sort(key=rank)  # stable: the order inside each group is pytest's


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    runs = [SCENARIO_RUNS[item.name] for item in session.items
            if item.path.name == SCENARIO_MODULE and item.name in SCENARIO_RUNS]
    if not runs:
        return
    try:
        import ray  # noqa: F401  (the scenario's tests skip without it)
    except ImportError:
        return
    from tests.ray_background import BACKGROUND
    BACKGROUND.start(runs)
