"""Tests of nodeagent.mps against tests/fake_mps_control.py, a stand-in control daemon.

Real processes throughout: the stand-in daemonizes as the real program does,
so each test's daemons are found by pid and killed in the fixture's teardown.
Misbehaviour is cued through FAKE_MPS_* environment variables.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeagent.mps import (
    PID_FILE,
    MpsControl,
    MpsError,
    MpsRestartBudgetError,
    MpsStartError,
    MpsState,
    QuitStep,
)
from tests.conftest import wait_for
from tests.mps_stand_in import write_fake_control

UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _server_list(m: MpsControl) -> list[int]:
    """Pids of the MPS servers ``m``'s control daemon runs (one per line; none when idle)."""
    return [int(word) for word in m.command("get_server_list").split()]


@pytest.fixture
def control_binary(workdir) -> str:
    return write_fake_control(workdir)


@pytest.fixture
def make_mps(workdir, control_binary):
    """Factory: ``make_mps(FAKE_MPS_IGNORE_QUIT="1", restart_budget=2)`` -> MpsControl (not started)."""
    made: list[MpsControl] = []

    def make(device_index: int = 0, *, env: dict | None = None, **knobs) -> MpsControl:
        options = {k: knobs.pop(k) for k in list(knobs) if not k.startswith("FAKE_")}
        m = MpsControl(device_index, UUID, workdir, control_binary, env={**os.environ, **(env or {}), **knobs},
                       **options)
        made.append(m)
        return m

    yield make
    for m in made:  # the daemons are not our children: end each one by its pid
        pids = {m.pid}
        try:
            pids.add(int(Path(m.pipe_dir, PID_FILE).read_text()))
        except (OSError, ValueError):
            pass
        for pid in pids - {None}:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def kill_and_wait(m: MpsControl) -> int:
    pid = m.pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid))
    return pid


# ---------------------------------------------------------------- start


def test_start_creates_private_dirs_and_daemon_answers(make_mps, workdir):
    m = make_mps()
    m.start(timeout_s=10)
    assert m.state is MpsState.RUNNING and m.alive() and not m.adopted
    for path in (m.pipe_dir, m.log_dir):
        assert path.startswith(os.path.join(workdir, "mps", "0"))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert int(Path(m.pipe_dir, PID_FILE).read_text()) == m.pid
    assert _server_list(m) == []
    assert f"using socket {m.pipe_dir}/control" in Path(m.log_dir, "control.log").read_text()


def test_daemon_gets_its_gpu_and_dirs_and_no_client_limits(make_mps):
    m = make_mps(env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_VISIBLE_DEVICES": "3"})
    m.start()
    environ = dict(item.split("=", 1) for item in
                   Path(f"/proc/{m.pid}/environ").read_bytes().decode().split("\0") if "=" in item)
    assert environ["CUDA_VISIBLE_DEVICES"] == UUID
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == m.pipe_dir
    assert environ["CUDA_MPS_LOG_DIRECTORY"] == m.log_dir
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in environ
    assert m.client_env() == {"CUDA_MPS_PIPE_DIRECTORY": m.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": m.log_dir,
                              "CUDA_VISIBLE_DEVICES": UUID}


def test_one_daemon_per_device_each_in_its_own_dirs(make_mps):
    a, b = make_mps(0), make_mps(1)
    a.start()
    b.start()
    assert a.pid != b.pid and a.pipe_dir != b.pipe_dir
    a.command("set_default_active_thread_percentage 30")
    assert b.command("get_default_active_thread_percentage").strip() == "100.0"
    assert a.command("get_default_active_thread_percentage").strip() == "30.0"


def test_start_adopts_a_daemon_left_running_by_an_earlier_run(make_mps):
    first = make_mps()
    first.start()
    second = make_mps()
    second.start()
    assert second.adopted and second.pid == first.pid
    assert second.quit() is QuitStep.QUIT
    assert not pid_alive(first.pid)


def test_start_failure_names_the_log_dir_and_what_it_said(make_mps):
    m = make_mps(FAKE_MPS_FAIL_START="1")
    with pytest.raises(MpsStartError) as info:
        m.start(timeout_s=1.0)
    message = str(info.value)
    assert m.log_dir in message and "did not answer within 1 s" in message
    assert "Failed to start control daemon" in message  # the tail of control.log
    assert m.state is MpsState.STOPPED


def test_start_kills_a_daemon_that_never_answers(make_mps):
    m = make_mps(FAKE_MPS_HANG="1")
    with pytest.raises(MpsStartError, match="did not answer"):
        m.start(timeout_s=1.5)
    pid = int(Path(m.pipe_dir, PID_FILE).read_text())
    wait_for(lambda: not pid_alive(pid))


def test_start_with_a_missing_binary_says_so(workdir):
    m = MpsControl(0, UUID, workdir, control_binary=os.path.join(workdir, "no-such-mps-control"))
    with pytest.raises(MpsStartError, match="cannot run .*no-such-mps-control -d"):
        m.start(timeout_s=1)


def test_launcher_exit_status_and_output_are_reported(workdir):
    refusing = os.path.join(workdir, "refusing-mps-control")
    with open(refusing, "w") as f:
        f.write('#!/bin/sh\necho "An instance of this daemon is already running"\nexit 1\n')
    os.chmod(refusing, 0o755)
    m = MpsControl(0, UUID, workdir, control_binary=refusing)
    with pytest.raises(MpsStartError) as info:
        m.start(timeout_s=2)
    assert "-d exited 1" in str(info.value) and "already running" in str(info.value)
    assert m.log_dir in str(info.value)


def test_runtime_dir_too_long_for_a_socket_is_refused_early(workdir):
    with pytest.raises(ValueError, match="shorter runtime_dir"):
        MpsControl(0, UUID, os.path.join(workdir, "x" * 100))


# ---------------------------------------------------------------- commands


def test_command_round_trips(make_mps):
    m = make_mps()
    m.start()
    m.command("set_default_device_pinned_mem_limit 0 2048M")
    assert m.command("get_default_device_pinned_mem_limit 0").strip() == "2048M"
    m.command("start_server -uid 1000")
    servers = _server_list(m)
    assert len(servers) == 1 and servers[0] > 0


def test_bad_commands_are_refused(make_mps):
    m = make_mps()
    for text in ("", "get_server_list\nquit"):
        with pytest.raises(ValueError):
            m.command(text)


def test_command_without_a_daemon_is_an_error(make_mps):
    m = make_mps()
    with pytest.raises(MpsError, match="Cannot find MPS control daemon process"):
        _server_list(m)


def test_command_to_a_stuck_daemon_times_out(make_mps):
    m = make_mps()
    m.start()
    os.kill(m.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(MpsError, match="did not answer 'get_server_list' within 0.5 s"):
            m.command("get_server_list", timeout_s=0.5)
        assert time.monotonic() - started < 3
    finally:
        os.kill(m.pid, signal.SIGCONT)


# ---------------------------------------------------------------- supervision


def test_killed_daemon_is_restarted(make_mps, caplog):
    m = make_mps()
    m.start()
    assert m.ensure_running() is False and m.restarts == 0
    old = kill_and_wait(m)
    assert not m.alive()
    with caplog.at_level(logging.WARNING, logger="nodeagent.mps"):
        assert m.ensure_running() is True
    assert m.restarts == 1 and m.pid != old and m.alive()
    assert "[mps] restart device=0 reason=exited restarts=1" in caplog.text
    assert _server_list(m) == []


def test_watch_fd_becomes_readable_when_the_daemon_dies(make_mps):
    m = make_mps()
    m.start()
    fd = m.watch_fd()
    assert fd is not None and not select.select([fd], [], [], 0)[0]
    os.kill(m.pid, signal.SIGKILL)
    assert select.select([fd], [], [], 5)[0]
    m.ensure_running()
    assert m.watch_fd() is not None and not select.select([m.watch_fd()], [], [], 0)[0]


def test_restart_budget_gives_up_and_stays_failed(make_mps):
    clock = FakeClock()
    m = make_mps(restart_budget=2, restart_window_s=60.0, clock=clock)
    m.start()
    for _ in range(2):
        kill_and_wait(m)
        clock.now += 1
        assert m.ensure_running() is True
    kill_and_wait(m)
    clock.now += 1
    with pytest.raises(MpsRestartBudgetError, match=r"more than 2 restarts in 60 s .*logs in"):
        m.ensure_running()
    assert m.state is MpsState.FAILED and m.restarts == 2
    with pytest.raises(MpsRestartBudgetError):
        m.ensure_running()
    m.start()  # an explicit start clears the failure
    assert m.state is MpsState.RUNNING and m.alive()


def test_restarts_older_than_the_window_do_not_count(make_mps):
    clock = FakeClock()
    m = make_mps(restart_budget=1, restart_window_s=10.0, clock=clock)
    m.start()
    kill_and_wait(m)
    assert m.ensure_running() is True
    clock.now += 11
    kill_and_wait(m)
    assert m.ensure_running() is True and m.restarts == 2


# ---------------------------------------------------------------- quit


def test_quit_by_command(make_mps):
    m = make_mps()
    m.start()
    pid = m.pid
    assert m.quit(timeout_s=5) is QuitStep.QUIT
    assert not pid_alive(pid) and m.state is MpsState.STOPPED and not m.alive()
    assert m.ensure_running() is False  # a stopped daemon is not supervised


def test_quit_ignored_needs_sigterm(make_mps):
    m = make_mps(FAKE_MPS_IGNORE_QUIT="1")
    m.start()
    pid = m.pid
    assert m.quit(timeout_s=2) is QuitStep.SIGTERM
    assert not pid_alive(pid)
    assert "quit ignored" in Path(m.log_dir, "control.log").read_text()


def test_quit_and_sigterm_ignored_needs_sigkill(make_mps):
    m = make_mps(FAKE_MPS_IGNORE_QUIT="1", FAKE_MPS_IGNORE_SIGTERM="1")
    m.start()
    pid = m.pid
    started = time.monotonic()
    assert m.quit(timeout_s=1.5) is QuitStep.SIGKILL
    assert time.monotonic() - started < 5
    wait_for(lambda: not pid_alive(pid))


def test_quit_when_not_running(make_mps):
    m = make_mps()
    assert m.quit() is QuitStep.NOT_RUNNING
    m.start()
    kill_and_wait(m)
    assert m.quit() is QuitStep.NOT_RUNNING


def test_never_touches_gpu_settings(make_mps, workdir):
    """The manager runs only the control program: an nvidia-smi first on PATH is never called."""
    spy_dir = os.path.join(workdir, "spy")
    os.makedirs(spy_dir)
    marker = os.path.join(workdir, "nvidia-smi-called")
    with open(os.path.join(spy_dir, "nvidia-smi"), "w") as f:
        f.write(f'#!/bin/sh\necho "$@" >> "{marker}"\n')
    os.chmod(os.path.join(spy_dir, "nvidia-smi"), 0o755)
    m = make_mps(env={"PATH": spy_dir + os.pathsep + os.environ.get("PATH", "")})
    m.start()
    m.command("set_default_active_thread_percentage 50")
    kill_and_wait(m)
    m.ensure_running()
    assert m.quit() is QuitStep.QUIT
    assert not os.path.exists(marker)


# ---------------------------------------------------------------- the real thing


def _gpu_uuid() -> str | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() < 1:
                return None
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
            return uuid.decode() if isinstance(uuid, bytes) else uuid
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


@pytest.mark.gpu
def test_real_control_daemon(workdir):
    binary = shutil.which("nvidia-cuda-mps-control")
    if binary is None:
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
    uuid = _gpu_uuid()
    if uuid is None:
        pytest.skip("no NVIDIA GPU visible through NVML")
    m = MpsControl(0, uuid, workdir, control_binary=binary)
    m.start(timeout_s=30)
    try:
        assert m.pid is not None and Path(m.pipe_dir, "control").exists()
        assert _server_list(m) == []
        m.command("set_default_active_thread_percentage 50")
        assert float(m.command("get_default_active_thread_percentage").split()[-1]) == 50.0
    finally:
        step = m.quit(timeout_s=20)
    assert step is QuitStep.QUIT


# A CUDA busy loop: half-precision matmuls for a fixed time, then prints the count.
_MATMUL_LOOP = r"""
import sys, time, torch
seconds = float(sys.argv[1])
x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
for _ in range(3):
    x @ x
torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.readline()  # start together
n, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(8):
        x @ x
    torch.cuda.synchronize()
    n += 8
print(n, flush=True)
"""


@pytest.mark.gpu
def test_real_mps_shares_of_30_and_70_percent_split_throughput(workdir):
    """Two processes on one GPU under MPS with 30 % and 70 % of its SMs: the
    busier one should do roughly 7/3 of the work. The ratio is printed and, where
    NODEAGENT_RESULTS_DIR is set, written there as JSON for bench/results/."""
    binary = shutil.which("nvidia-cuda-mps-control")
    uuid = _gpu_uuid()
    if binary is None or uuid is None:
        pytest.skip("needs nvidia-cuda-mps-control on PATH and an NVIDIA GPU")
    pytest.importorskip("torch")
    from sharing.partition import plan_partition
    plan = plan_partition({"low": 30, "high": 70})
    m = MpsControl(0, uuid, workdir, control_binary=binary)
    m.start(timeout_s=30)
    procs = {}
    try:
        for name in ("low", "high"):
            env = {**os.environ, **m.client_env(), **plan.env_for(name)}
            procs[name] = subprocess.Popen([sys.executable, "-c", _MATMUL_LOOP, "10"], env=env, text=True,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for proc in procs.values():
            assert proc.stdout.readline().strip() == "READY"
        for proc in procs.values():
            proc.stdin.write("go\n")
            proc.stdin.flush()
        done = {name: int(proc.stdout.readline()) for name, proc in procs.items()}
        for proc in procs.values():
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        m.quit(timeout_s=20)
    ratio = done["high"] / done["low"]
    result = {"device_uuid": uuid, "shares": dict(plan.shares), "matmuls": done, "throughput_ratio": ratio,
              "expected_ratio": 70 / 30}
    print(json.dumps(result))
    out_dir = os.environ.get("NODEAGENT_RESULTS_DIR")
    if out_dir:
        with open(os.path.join(out_dir, "mps_30_70.json"), "w") as f:
            json.dump(result, f, indent=2)
    assert 1.5 < ratio < 3.5, result  # 7/3 with room for how MPS rounds SMs and for clocks


def test_a_control_daemon_watched_through_a_descriptor_above_1024_is_still_seen(tmp_path):
    """Before: alive() and wait() asked select(), which raises ValueError for a descriptor past
    FD_SETSIZE; a daemon holding its 4096 connections opens the pidfd of a restarted control daemon there."""
    import resource

    from nodeagent.mps import _DaemonProcess

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 2000:
        pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} leaves no descriptor past 2000")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2001), hard))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc = _DaemonProcess(child.pid)
    try:
        if proc.pidfd is None:
            pytest.skip("no pidfds on this kernel")
        high = os.dup2(proc.pidfd, 2000)
        os.close(proc.pidfd)
        proc.pidfd = high
        assert proc.alive() and proc.wait(0.05) is False
        child.kill()
        assert proc.wait(5.0) is True and not proc.alive()
    finally:
        proc.close()
        child.kill()
        child.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
