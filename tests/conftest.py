"""Fixtures that run the real daemon on a private ipc socket: as a subprocess (``daemon``,
``start_daemon``), or in a thread of the test process (``inproc_daemon``, ``start_inproc_daemon``)."""

from __future__ import annotations

import os
import select
import shutil
import socket
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
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
        self._ready: socket.socket | None = None  # where start() hears READY=1

    def start(self, timeout: float = 60.0) -> "Daemon":  # a start is 1 s; a 2-core box under load took 15+
        log = open(self.log_path, "ab")
        config = os.path.join(self.workdir, "nodeagent.toml")
        if not os.path.exists(config):
            open(config, "w").close()  # hermetic: never the host's /etc/nodeagent/nodeagent.toml
        limit = () if self.nofile is None else (sys.executable, "-c", _WITH_NOFILE, *map(str, self.nofile))
        # The cue to wait on: READY=1 on a datagram socket named by $NOTIFY_SOCKET, as systemd
        # hears it (sent once the endpoint is bound). Kept open while the daemon runs, so that
        # its STOPPING=1 finds it; polling the endpoint instead spun a core for the whole start.
        self._close_ready()
        self._ready = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        name = f"nodeagent-test-ready-{uuid.uuid4().hex}"
        self._ready.bind("\0" + name)
        env = dict(os.environ, NOTIFY_SOCKET="@" + name)
        self.proc = subprocess.Popen(
            [*limit, sys.executable, "-m", "nodeagent", "serve", "--config", config, "--backend", "cpu",
             "--endpoint", self.endpoint,
             "--state-dir", os.path.join(self.workdir, "state"), "--log-level", "debug",
             # Warm workers cost seconds of CPU per start; only the tests that use them ask.
             *(() if "--ctxpool" in self.extra_args else ("--ctxpool", "off")), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        try:
            while not self._heard_ready(min(0.1, max(0.0, deadline - time.monotonic()))):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("no READY=1")
            query_status(self.endpoint, timeout=max(1.0, deadline - time.monotonic()))  # its loop answers too
        except Exception:
            self.kill()  # never leave a half-started daemon behind
            raise RuntimeError(f"daemon did not start:\n{self.log()}") from None
        return self

    def _heard_ready(self, wait_s: float) -> bool:
        """Whether READY=1 came within ``wait_s`` (the daemon's other messages are skipped)."""
        if not select.select([self._ready], [], [], wait_s)[0]:
            return False
        return b"READY=1" in self._ready.recv(4096).split(b"\n")

    def _close_ready(self) -> None:
        if self._ready is not None:
            self._ready.close()
            self._ready = None

    def status(self):
        return query_status(self.endpoint, timeout=5)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            self._close_ready()
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._close_ready()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_ready()


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nodeagent(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``python -m nodeagent ARGS`` from the repository to the end; its output as text."""
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


#: Run a daemon test once per sharing mode: ``@BOTH_MODES`` on a test that takes ``start_daemon``,
#: ``daemon``, ``start_inproc_daemon`` or ``inproc_daemon`` (and ``sharing``, to state what each mode
#: expects). Co-run is what a GPU gets by default (``scheduler.sharing = "auto"`` on cuda); the cpu
#: backend the tests run on defaults to the exclusive token.
SHARING_MODES = ("exclusive", "corun")
BOTH_MODES = pytest.mark.parametrize("sharing", SHARING_MODES)


def pytest_addoption(parser):
    parser.addoption("--sharing", choices=("auto", *SHARING_MODES), default=None,
                     help="nodeagent: the --sharing every test daemon gets unless its test names one "
                          "(default: the backend's, exclusive on cpu); a sweep for bugs, not the suite's mode")


@pytest.fixture
def sharing(request) -> str | None:
    """The sharing mode the test's daemons run in: a test's own parametrization
    (:data:`BOTH_MODES`), else ``pytest --sharing``, else None (the backend's default)."""
    return request.config.getoption("--sharing")


def with_sharing(sharing: str | None, extra_args) -> list[str]:
    """``extra_args`` with ``--sharing`` first, unless the test names its own (it wins)."""
    args = list(extra_args)
    if sharing is None or "--sharing" in args:
        return args
    return ["--sharing", sharing, *args]


@pytest.fixture
def workdir():
    # ipc socket paths must stay under 107 bytes: pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="na-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(workdir, sharing):
    """Factory: ``start_daemon("--quantum-ms", "training=20")`` -> running :class:`Daemon`, in the
    test's ``sharing`` mode. Started again in the same test, it reuses the endpoint and state dir (a restart)."""
    started: list[Daemon] = []

    def start(*extra_args: str, endpoint: str | None = None, nofile: tuple[int, int] | None = None) -> Daemon:
        d = Daemon(workdir, with_sharing(sharing, extra_args), endpoint, nofile).start()
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
def start_inproc_daemon(workdir, sharing):
    """Factory like :func:`start_daemon`, for tests of policy: the real daemon in a thread of
    this process (:class:`tests.inproc.InprocDaemon`), no ``nodeagent serve`` process."""
    from tests.inproc import InprocDaemon
    started: list[InprocDaemon] = []

    def start(*extra_args: str, endpoint: str | None = None) -> InprocDaemon:
        d = InprocDaemon(workdir, with_sharing(sharing, extra_args), endpoint).start()
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


@pytest.fixture
def cluster_node(start_daemon, workdir):
    """Factory: a daemon with its cluster endpoint on (config keywords as for
    :func:`tests.cluster_nodes.write_cluster_config`) -> its :class:`tests.cluster_nodes.ClusterNode`."""
    from tests.cluster_nodes import write_cluster_config

    def start(*args: str, endpoint: str | None = None, **config):
        node = write_cluster_config(workdir, **config)
        node.daemon = start_daemon(*args, endpoint=endpoint)
        return node

    return start


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


# ------------------------------------------------------------------ parallel runs (pytest-xdist)

# scripts/test.sh runs the suite on every core (pytest -n auto --dist loadgroup). Two things keep
# that as reliable as a serial run:
# - A module whose module-scoped fixture is expensive (a benchmark run, a dry run, a daemon) runs on
#   one worker, so that the fixture is made once, not once per worker (the controller's scheduler,
#   pytest_xdist_make_scheduler below).
# - A test that asserts how long something took (a grace, a deadline, a latency bound) is marked
#   ``serial``: it runs while no other test runs on any worker (a readers-writer lock on a file of
#   the test run: ``_Exclusive`` below), so another worker's daemons cannot slow it into a flake.
#   Mark one with @pytest.mark.serial or name it here.
ONE_WORKER_MODULES = {
    "test_bench_colocate.py", "test_bench_report.py", "test_cluster_real.py", "test_gpu_check.py",
    "test_k8s_device_plugin.py", "test_k8s_manifests.py", "test_one_holder.py", "test_peer_rights.py",
    "test_protocol_behaviour.py", "test_protocol_doc.py", "test_replay.py", "test_replay_log.py",
    "test_serving.py", "test_systemd.py",
    "test_worker_pool.py",  # its tests that leave the pool as found share one (a worker is a torch import)
}
# The serial tests: each asserts how long something took (under a bound a busy core can break),
# or leaves a killed process's segment in /dev/shm and asserts it is there until its own sweep
# (a daemon starting on another worker sweeps the dead's segments at its start).
SERIAL = {
    "test_bench.py": {"test_enforce_bench_reports_both_hogs",
                      "test_fairness_bench_reports_shares"},
    "test_bench_reclaim.py": {"test_reclaim_bench_reports_cooperative_and_enforced_reclaims"},
    "test_bench_scale.py": {"test_scale_bench_reports_idle_cost_status_handoffs_and_scheduler_steps"},
    "test_cli.py": {"test_status_wait_tries_again_until_its_time_is_up_then_says_why"},
    "test_client.py": {"test_daemon_killed_while_waiting_raises_unavailable",
                       "test_no_daemon_is_said_at_once_naming_the_endpoint"},
    "test_cluster.py": {"test_a_second_reclaim_joins_the_one_under_way_and_a_session_that_dies_counts_as_gone",
                        "test_reclaim_stops_a_borrower_that_ignores_it_at_the_deadline",
                        "test_reclaim_suspends_a_cooperative_borrower_and_reports_when_the_device_was_free"},
    "test_connect_backlog.py": {"test_a_backlog_that_stays_full_is_one_line_after_the_timeout"},
    "test_corun.py": {"test_a_pause_point_holds_while_paused_and_lets_go_when_the_daemon_is_gone",
                      "test_a_service_with_the_measured_spread_runs_beside_the_trainer_when_that_costs_nothing",
                      "test_beside_a_trainer_with_50_ms_steps_inference_waits_under_5_ms_only_under_corun"},
    "test_daemon.py": {"test_a_watched_session_needs_no_heartbeat_and_ends_when_its_connection_closes",
                       "test_an_unverified_holder_whose_connection_closes_is_dropped_at_once",
                       "test_holder_killed_with_sigkill_hands_token_on_at_once",
                       "test_holder_that_ignores_yield_is_revoked_after_grace",
                       "test_silent_unverified_session_is_dropped_after_missed_heartbeats"},
    "test_enforce.py": {"test_library_client_that_ignores_yields_is_stopped_then_continued"},
    "test_gpu_check.py": {"test_the_dry_run_installs_the_wheels_probes_the_machine_and_lists_each_step_with_its_cap"},
    "test_metrics_storm.py": {"test_a_few_hundred_slow_scrapers_cost_no_thread_little_memory_and_no_grant_time"},
    "test_mps.py": {"test_command_to_a_stuck_daemon_times_out",
                    "test_quit_and_sigterm_ignored_needs_sigkill"},
    "test_operator_errors.py": {"test_status_with_no_socket_file_says_so_at_once"},
    "test_placement.py": {"test_a_node_that_is_down_times_out_without_holding_up_the_others",
                          "test_a_slow_node_costs_only_the_timeout"},
    "test_ray_core.py": {"test_once_a_stop_is_asked_a_loan_node_coming_up_pauses_the_job_no_more",
                         "test_lends_only_free_devices_and_reclaims_the_moment_inference_joins"},
    "test_ray_train.py": {"test_a_group_waiting_for_a_resize_that_does_not_come_trains_on_after_resize_wait_s",
                          "test_a_group_waiting_for_a_resize_that_does_not_come_trains_on_when_asked_to_stop"},
    "test_readme_walkthrough.py": {"test_a_demo_whose_clients_never_connect_says_so_in_one_line"},
    "test_restart.py": {"test_fail_open_client_runs_unmanaged_while_the_daemon_is_away_then_reattaches",
                        "test_a_restore_window_closes_at_its_deadline_not_at_the_next_liveness_tick",
                        "test_100_waiting_clients_back_off_while_the_daemon_is_away_and_are_granted_within_1_s"},
    "test_serving.py": {"test_restart_keeps_registrations"},
    "test_serving_faults.py": {"test_a_hung_request_gets_e_timeout_near_its_timeout",
                               "test_a_model_that_keeps_hanging_is_refused_for_a_while_and_the_device_serves_on",
                               "test_two_hung_requests_do_not_block_a_third_clients_quick_one"},
    "test_serving_shutdown.py": {"test_sigterm_answers_a_queued_infer_and_a_pending_registration_at_once"},
    "test_status.py": {"test_status_under_another_users_flood_answers_root_and_never_fails"},
    "test_suspend.py": {"test_a_cooperative_trainer_parks_frees_the_device_and_resumes",
                        "test_a_trainer_that_never_yields_is_stopped_at_the_deadline_and_continued_on_resume"},
    "test_three_nodes.py": {"test_lend_two_devices_reclaim_one_under_inference_and_lose_no_session"},
    "test_worker_pool.py": {"test_a_request_past_its_deadline_is_answered_and_its_hung_worker_replaced",
                            "test_a_worker_still_starting_gets_sigterm_at_once",
                            "test_shutdown_escalates_and_records_the_step",
                            "test_workers_die_with_a_daemon_killed_by_sigkill_and_its_segment_is_swept"},
}


def _mark_for_workers(items) -> None:
    for item in items:
        name = item.path.name
        if name in ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(name))
        if getattr(item, "originalname", item.name) in SERIAL.get(name, ()):
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` that keeps ONE_WORKER_MODULES together. xdist 3.8 groups by a suffix it
    writes into each item's nodeid, which pytest 9 no longer reads back (nodeid is built from
    ``_id``): its groups never form, and each test was scheduled alone. Here the controller groups
    by the nodeid's module instead; a nodeid that does carry a group keeps xdist's own scope."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if "@" in nodeid:
                return super()._split_scope(nodeid)
            module = nodeid.split("::", 1)[0]
            return module if Path(module).name in ONE_WORKER_MODULES else nodeid

    return ModuleGroups(config, log)


class _Exclusive:
    """Across the workers of one run: a ``serial`` test holds ``room`` exclusively, every other
    test holds it shared. A serial test first takes ``turnstile``, which every other test passes
    through before it takes ``room``, so that a stream of parallel tests cannot starve it."""

    def __init__(self, share: Path) -> None:
        share.mkdir(parents=True, exist_ok=True)
        self.turnstile = os.open(share / "turnstile", os.O_CREAT | os.O_RDWR, 0o600)
        self.room = os.open(share / "room", os.O_CREAT | os.O_RDWR, 0o600)

    def acquire(self, serial: bool) -> None:
        import fcntl
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        if not serial:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        fcntl.flock(self.room, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)

    def release(self) -> None:
        import fcntl
        fcntl.flock(self.room, fcntl.LOCK_UN)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)


_EXCLUSIVE: list[_Exclusive] = []


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's: a wait here is no test's time
def pytest_runtest_protocol(item, nextitem):
    share = _run_share(item.config)
    if share is None:  # not under xdist: nothing runs beside this test
        yield
        return
    if not _EXCLUSIVE:
        _EXCLUSIVE.append(_Exclusive(share))
    lock = _EXCLUSIVE[0]
    lock.acquire(item.get_closest_marker("serial") is not None)
    try:
        yield
    finally:
        lock.release()


def pytest_configure(config):
    if (not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None)
            and not getattr(config.option, "testrunuid", None)):
        config.option.testrunuid = uuid.uuid4().hex  # the workers' shared directory (_run_share)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    _mark_for_workers(items)
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
    BACKGROUND.start(runs, _run_share(session.config))


def _run_share(config) -> Path | None:
    """A directory that every xdist worker of this test run names alike (None without xdist)."""
    if hasattr(config, "workerinput"):
        uid = config.workerinput["testrunuid"]
    else:
        uid = config.option.__dict__.get("testrunuid")
    return Path(tempfile.gettempdir(), f"nodeagent-testrun-{uid}") if uid else None


def pytest_sessionfinish(session):
    from tests.ray_background import BACKGROUND
    BACKGROUND.join()  # an xdist worker done with its own tests must not leave before the runs


def pytest_unconfigure(config):
    share = _run_share(config)
    if share is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(share, ignore_errors=True)  # the controller, after every worker is done
