"""``nodeagent run``: an unmodified program time-sliced over a real daemon (held in its own
cgroup where one can be made, else its process group; tests/daemon/test_run_cgroup.py tests both)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from client_lib import Client
from client_lib.pace import Pace
from tests.conftest import REPO, wait_for
from tests.proc_tools import gone
from tests.daemon.run_counter import COUNTER


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_cmd_makes_no_progress_while_another_session_holds_the_token(start_daemon, launch):
    d = start_daemon("--quantum-ms", "training=50")
    proc = launch(d.endpoint, "--name", "hog")
    counter = launch.counter
    counter.wait_advancing()

    out = subprocess.run([sys.executable, "-m", "nodeagent", "status", "--json", "--endpoint", d.endpoint],
                         capture_output=True, text=True, cwd=REPO, timeout=10)
    sessions = [s for dev in json.loads(out.stdout)["devices"] for s in dev["sessions"]]
    assert [(s["name"], s["pid"], s["workload"]) for s in sessions] == [("hog", proc.pid, "training")]
    assert sessions[0]["managed_pgid"] == counter.pid()  # the daemon accepted CMD's group as the launcher's child

    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        with client.slice(timeout=5):
            time.sleep(0.05)  # the launcher stopped CMD before releasing; let a last write land
            before, after = counter.frozen_for(0.8)
    assert before > 0 and after == before, "CMD ran while the inference session held the token"
    counter.wait_advancing(timeout=2)  # and runs again once the token is back
    assert proc.poll() is None


@pytest.mark.parametrize("duty", ["pause", "free"])
def test_under_corun_cmd_is_paced_while_inference_holds_and_never_asked_to_yield(start_daemon, launch, duty):
    d = start_daemon("--sharing", "corun", "--corun-duty", duty)
    proc = launch(d.endpoint, "--name", "trainer")
    counter = launch.counter
    counter.wait_advancing()
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        with client.slice(timeout=1) as grant:  # granted at once, beside the trainer
            assert grant
            time.sleep(0.05)
            before, after = counter.frozen_for(0.5)
    if duty == "pause":
        assert before > 0 and after == before, "CMD ran while inference held and the duty said pause"
    else:
        assert after > before + 20, "with duty free CMD keeps running beside inference"
    counter.wait_advancing(timeout=2)
    assert proc.poll() is None


@pytest.mark.parametrize("code, expected", [
    ("raise SystemExit(7)", 7),
    ("import signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL),
])
def test_exit_code_of_cmd_propagates_and_nothing_is_left(daemon, launch, workdir, code, expected):
    pid_file = os.path.join(workdir, "pid")
    cmd = [sys.executable, "-c", f"import os; open({pid_file!r}, 'w').write(str(os.getpid())); {code}"]
    proc = launch(daemon.endpoint, cmd=cmd)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == expected, err
    assert not alive(int(open(pid_file).read()))
    assert daemon.status().devices[0].sessions == []
    assert "[session] close" in daemon.log() and "[session] lost" not in daemon.log()  # a bye, not a crash


def test_sigterm_reaches_cmd_even_while_it_is_stopped(start_daemon, launch):
    d = start_daemon("--quantum-ms", "training=50")
    proc = launch(d.endpoint, term_marker=True)
    counter = launch.counter
    counter.wait_advancing()
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        with client.slice(timeout=5):
            counter.assert_frozen(0.2)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=5)
            assert client.holding  # CMD acted on the signal without waiting for the token
    assert proc.returncode == 0, err
    assert open(counter.marker).read() == "term"


def test_daemon_killed_fail_open_continues_cmd(start_daemon, launch):
    d = start_daemon("--quantum-ms", "training=50", "--heartbeat-ms", "100")
    proc = launch(d.endpoint)
    counter = launch.counter
    counter.wait_advancing()
    client = Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False)
    client.acquire(timeout=5)
    counter.assert_frozen(0.2)
    d.kill()
    counter.wait_advancing(timeout=1.5)  # 3 missed heartbeats of 100 ms, then continued
    client.close()
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)  # no handler in CMD: it dies of it, and so do we, shell-style
    _, err = proc.communicate(timeout=5)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "fail-open" in err


def test_daemon_killed_fail_closed_holds_cmd_until_it_returns(start_daemon, launch):
    d = start_daemon("--quantum-ms", "training=50", "--heartbeat-ms", "100")
    proc = launch(d.endpoint, "--fail-closed")
    counter = launch.counter
    counter.wait_advancing()  # CMD holds the token and runs when the daemon dies
    d.kill()
    time.sleep(0.6)  # 3 missed heartbeats of 100 ms and a little
    before, after = counter.frozen_for(0.8)
    assert after == before, "CMD ran while the daemon was away under --fail-closed"
    assert proc.poll() is None
    d2 = start_daemon("--quantum-ms", "training=50", "--heartbeat-ms", "100")
    counter.wait_advancing(timeout=3)
    # The restored session may be dropped (3 x 100 ms without it) before the launcher, trying
    # every 500 ms, reattaches; then it opens a new one.
    sessions = wait_for(lambda: d2.status().devices[0].sessions, timeout=3)
    assert [(s.name, s.pid) for s in sessions] == [(os.path.basename(sys.executable), proc.pid)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=5)
    assert "--fail-closed" in err and "back" in err


@pytest.mark.parametrize("hold", ["auto", "off"])
def test_launcher_killed_outright_while_cmd_runs_ends_it(start_daemon, launch, hold):
    d = start_daemon("--quantum-ms", "training=50")
    proc = launch(d.endpoint, "--cgroup", hold)
    counter = launch.counter
    counter.wait_advancing()  # it holds the token and runs
    proc.kill()  # no clean-up in the launcher: its keeper (and the parent-death signal) end CMD
    proc.wait()
    wait_for(lambda: gone(counter.pid()), timeout=3)
    wait_for(lambda: d.status().devices[0].sessions == [], timeout=3)


@pytest.mark.parametrize("hold", ["auto", "off"])
def test_whole_group_is_ended_when_the_launcher_dies_while_cmd_is_stopped(start_daemon, launch, hold):
    # The counting is done by a grandchild in CMD's process group: the kernel's
    # parent-death signal reaches only the leader, so only the keeper (or the
    # daemon, which ends what it verified when the launcher's process exits) can.
    d = start_daemon("--quantum-ms", "training=50")
    counter = launch.counter
    nested = ["-c", "import subprocess, sys; subprocess.call([sys.executable, '-c', sys.argv[1], sys.argv[2]])",
              COUNTER, counter.path]
    proc = launch(d.endpoint, "--cgroup", hold, cmd=[sys.executable, *nested])
    counter.wait_advancing()
    writer_group = os.getpgid(counter.pid())
    try:
        with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
            with client.slice(timeout=5):
                counter.assert_frozen(0.2)
                proc.kill()
                proc.wait()
                wait_for(lambda: gone(counter.pid()), timeout=3)
        assert "died" in proc.stderr.read()  # the keeper's word
    finally:
        try:
            os.killpg(writer_group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_usage_errors_exit_like_a_shell(workdir):
    endpoint = f"ipc://{workdir}/nobody.sock"  # never reached: these fail before any hello

    def run(*args):
        return subprocess.run([sys.executable, "-m", "nodeagent", "run", "--endpoint", endpoint, *args],
                              capture_output=True, text=True, cwd=REPO, timeout=10)

    missing = run("--", "no-such-program-xyz", "arg")
    assert missing.returncode == 127
    assert "nodeagent run: no-such-program-xyz: command not found" in missing.stderr
    no_cmd = run()
    assert no_cmd.returncode == 2 and "no command" in no_cmd.stderr
    helped = run("--help")
    assert helped.returncode == 0
    for fragment in ("SIGSTOP", "cgroup.freeze", "--cgroup", "SIGTERM", "--fail-closed", "fail-open", "128+N",
                     "127", "launcher killed"):
        assert fragment in helped.stdout


class _Board:
    """A pace board read by hand: ``now`` is what the next read says."""

    def __init__(self) -> None:
        self.now = Pace(0, False, 1000, 10_000)

    def pace(self) -> Pace:
        return self.now


class _HeldClient:
    """A session that holds one grant, never asked to yield, with a pace board."""

    holding, grant_id, yield_requested = True, 1, False

    def __init__(self) -> None:
        self.pacing = _Board()

    def daemon_healthy(self) -> bool:
        return True


class _RecordedHold:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def stop(self) -> None:
        self.calls.append("stop")

    def cont(self) -> None:
        self.calls.append("cont")


def test_a_continue_after_a_pacing_stop_is_logged_as_quietly_as_the_stop(caplog):
    from nodeagent.launcher import Launcher
    launcher = Launcher(["true"])
    launcher.client, launcher.hold = _HeldClient(), _RecordedHold()
    caplog.set_level(logging.DEBUG, logger="nodeagent.launcher")
    launcher._step_managed()  # the grant: CMD continued, at info
    launcher.client.pacing.now = Pace(1, True, 0, 10_000)  # a higher class holds, duty pause
    launcher._step_managed()
    launcher.client.pacing.now = Pace(0, False, 1000, 10_000)  # it left
    launcher._step_managed()
    assert launcher.hold.calls == ["cont", "stop", "cont"]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "nodeagent.launcher"]
    assert said == [(logging.INFO, "CMD continued (granted)"),
                    (logging.DEBUG, "CMD stopped (paced: a higher class holds the device)"),
                    (logging.DEBUG, "CMD continued (granted)")]  # each pause and resume: -v stays readable
