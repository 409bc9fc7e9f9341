"""MPS through the daemon: a control daemon per configured device, shares handed
to clients in the welcome and to nodeagent run's CMD in its environment,
partitions set by root. Uses the stand-in control program (no GPU needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from client_lib import Client, DaemonError, ErrorCode, set_partition
from tests.conftest import REPO, wait_for
from tests.mps_stand_in import write_fake_control

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="partitions are root-only; these tests set them")


@pytest.fixture
def mps_daemon(workdir, start_daemon):
    binary = write_fake_control(workdir)
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write(f'[mps]\ndevices = [0]\ncontrol_binary = "{binary}"\nmin_percent = 10\n')
    return start_daemon("--cpu-devices", "2")


def test_clients_get_their_mps_daemon_and_share_in_the_welcome(mps_daemon, workdir):
    d = mps_daemon
    with Client("a", device=0, endpoint=d.endpoint) as a:
        env = a.welcome.env
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == os.path.join(workdir, "mps", "0", "pipe")
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == env["CUDA_MPS_PIPE_DIRECTORY"]  # applied
        with Client("b", device=0, endpoint=d.endpoint) as b:
            assert b.welcome.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            dev = d.status().devices[0]
            assert dev.mps and dev.partition == {a.session_id: 50, b.session_id: 50}
        with Client("c", device=1, endpoint=d.endpoint) as c:  # device 1 has no MPS
            assert c.welcome.env == {} and not d.status().devices[1].mps


def test_root_sets_partitions_and_bad_ones_are_refused(mps_daemon):
    d = mps_daemon
    with Client("a", device=0, endpoint=d.endpoint) as a, Client("b", device=0, endpoint=d.endpoint) as b:
        reply = set_partition(0, {a.session_id: 30, b.session_id: 70}, endpoint=d.endpoint)
        assert reply.shares == {a.session_id: 30, b.session_id: 70}
        assert set(reply.stale) == {a.session_id, b.session_id}  # both run with the share they started with
        assert d.status().devices[0].partition == {a.session_id: 30, b.session_id: 70}
        for shares, device, code in (({a.session_id: 80, b.session_id: 50}, 0, ErrorCode.PARTITION),
                                     ({a.session_id: 5, b.session_id: 50}, 0, ErrorCode.PARTITION),
                                     ({"s-stranger": 50}, 0, ErrorCode.INVALID),
                                     ({a.session_id: 50}, 1, ErrorCode.DEVICE)):
            with pytest.raises(DaemonError) as info:
                set_partition(device, shares, endpoint=d.endpoint)
            assert info.value.code == code, shares
        assert d.status().devices[0].partition == {a.session_id: 30, b.session_id: 70}  # unchanged


def test_nodeagent_run_hands_the_share_to_cmd_before_it_starts(mps_daemon, workdir):
    out = os.path.join(workdir, "env.json")
    cmd = ["-c", "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))", out]
    proc = subprocess.run([sys.executable, "-m", "nodeagent", "run", "--endpoint", mps_daemon.endpoint,
                           "--device", "0", "--", sys.executable, *cmd], cwd=REPO, timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    env = json.load(open(out))
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert env["CUDA_MPS_PIPE_DIRECTORY"].endswith("/mps/0/pipe")


def test_a_dead_control_daemon_is_restarted_and_quit_at_shutdown(mps_daemon, workdir):
    d = mps_daemon
    pid_file = os.path.join(workdir, "mps", "0", "pipe", "nvidia-cuda-mps-control.pid")
    first = int(open(pid_file).read())
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: "[mps] restart device=0" in d.log(), timeout=10)
    wait_for(lambda: os.path.exists(pid_file) and int(open(pid_file).read() or 0) not in (0, first), timeout=10)
    second = int(open(pid_file).read())
    assert d.stop() == 0
    assert "[shutdown] step=mps device=0 result=quit" in d.log()
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{second}") or open(f"/proc/{second}/stat").read().split()[2] == "Z"


def test_mps_on_a_device_that_does_not_exist_stops_the_daemon_at_start(workdir):
    with open(os.path.join(workdir, "bad.toml"), "w") as f:
        f.write("[mps]\ndevices = [5]\n")
    out = subprocess.run([sys.executable, "-m", "nodeagent", "serve", "--config", os.path.join(workdir, "bad.toml"),
                          "--backend", "cpu", "--endpoint", f"ipc://{workdir}/x.sock", "--state-dir", workdir],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 2 and "mps.devices names [5]" in out.stderr


_EARLY_CHILD = """
import ctypes, json, os, sys
from client_lib import Client
from client_lib.errors import CudaTooEarlyError
if sys.argv[1] != "-":
    ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL).cuInit(0)  # as torch.cuda.is_available() does
try:
    with Client("early", device=0) as client:
        print(json.dumps({"env": client.welcome.env}))
except CudaTooEarlyError as exc:
    print(json.dumps({"error": exc.code, "variables": exc.variables, "message": str(exc)}))
"""


def _early_child(endpoint: str, library: str, env: dict | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}  # nothing inherited from a test
    out = subprocess.run([sys.executable, "-c", _EARLY_CHILD, library], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**clean, **(env or {}), "NODEAGENT_ENDPOINT": endpoint})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_process_that_started_cuda_before_its_welcome_is_refused_and_its_session_closed(mps_daemon, tmp_path):
    from tests.fake_cuda import build_fake_libcuda

    library = build_fake_libcuda(str(tmp_path))
    if library is None:
        pytest.skip("needs a C compiler to build the stand-in libcuda")
    d = mps_daemon
    seen = _early_child(d.endpoint, library)
    assert seen["error"] == "E_CUDA_TOO_EARLY", seen
    assert seen["variables"]["CUDA_MPS_PIPE_DIRECTORY"].endswith("/mps/0/pipe")
    assert "Create the Client before any torch.cuda call" in seen["message"]
    wait_for(lambda: d.status().devices[0].sessions == [])  # said goodbye: no session left behind
    # The same program without the early start gets its settings; one that set them itself may start early.
    settings = _early_child(d.endpoint, "-")["env"]
    wait_for(lambda: d.status().devices[0].sessions == [])
    assert _early_child(d.endpoint, library, env=settings) == {"env": settings}
