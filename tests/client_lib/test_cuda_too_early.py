"""A process that initialised CUDA before its session's welcome cannot take the
session's MPS settings: the client says so with CudaTooEarlyError instead of
running outside its partition. The probe that tells, without initialising CUDA,
is tested against scripted drivers and a compiled stand-in libcuda; the end to
end refusal runs against a daemon with MPS in tests/daemon/test_mps_daemon.py."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from client_lib import cuda_probe
from client_lib.client import _apply_env
from client_lib.errors import CudaTooEarlyError
from tests.conftest import REPO
from tests.fake_cuda import build_fake_libcuda


class ScriptedDriver:
    """cuDeviceGetCount answering a given CUresult."""

    def __init__(self, result: int) -> None:
        self.result = result
        self.calls = 0

    def cuDeviceGetCount(self, count_ref) -> int:
        self.calls += 1
        return self.result


@pytest.mark.parametrize("result, initialised", [(3, False), (0, True), (100, True), (999, True)])
def test_the_driver_counts_as_initialised_unless_it_says_not_initialized(result, initialised):
    assert cuda_probe.driver_initialised(ScriptedDriver(result)) is initialised


def test_a_driver_not_loaded_or_without_the_entry_point_is_not_initialised():
    assert cuda_probe.driver_initialised(None) is False
    assert cuda_probe.driver_initialised(object()) is False
    assert cuda_probe.loaded_driver() is None  # this host has no CUDA driver loaded (or at all)


def test_torch_lazy_init_is_seen_first_and_the_driver_probe_covers_is_available(monkeypatch):
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert cuda_probe.cuda_initialised_by(lambda: ScriptedDriver(3)) is None
    # torch.cuda.is_available() ran cuInit; torch's own flag stays false.
    assert "cuInit has run" in cuda_probe.cuda_initialised_by(lambda: ScriptedDriver(0))
    fake_torch.cuda.is_initialized = lambda: True
    assert "torch.cuda.is_initialized()" in cuda_probe.cuda_initialised_by(lambda: ScriptedDriver(3))


def test_settings_that_differ_after_cuda_started_are_refused_and_not_applied(monkeypatch):
    monkeypatch.setattr(cuda_probe, "loaded_driver", lambda: ScriptedDriver(0))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/nodeagent/mps/0/pipe")
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/run/nodeagent/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
    with pytest.raises(CudaTooEarlyError) as info:
        _apply_env(env)
    err = info.value
    assert err.code == "E_CUDA_TOO_EARLY"
    assert err.variables == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}  # the pipe dir was already right
    assert "Create the Client before any torch.cuda call" in str(err) and "CUDA_MPS_PIPE_DIRECTORY" in str(err)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
    # Settings the process already runs with are no reason to refuse.
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30")
    _apply_env(env)


def test_settings_are_applied_while_cuda_has_not_started(monkeypatch):
    monkeypatch.setattr(cuda_probe, "loaded_driver", lambda: ScriptedDriver(3))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    _apply_env({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"})
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


_PROBE_CHILD = """
import ctypes, json, os, sys
from client_lib import cuda_probe
seen = {"before_load": cuda_probe.cuda_initialised_by()}
driver = ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)  # what the CUDA runtime does on its first call
seen["loaded"] = cuda_probe.cuda_initialised_by()
seen["loaded_twice"] = cuda_probe.cuda_initialised_by()  # asking does not initialise
driver.cuInit(0)  # what torch.cuda.is_available() ends in
seen["after_cuinit"] = cuda_probe.cuda_initialised_by()
print(json.dumps(seen))
"""


def test_the_probe_finds_a_loaded_driver_by_soname_and_never_initialises_it(tmp_path):
    library = build_fake_libcuda(str(tmp_path))
    if library is None:
        pytest.skip("needs a C compiler to build the stand-in libcuda")
    out = subprocess.run([sys.executable, "-c", _PROBE_CHILD, library], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True)
    seen = __import__("json").loads(out.stdout)
    assert seen["before_load"] is None and seen["loaded"] is None and seen["loaded_twice"] is None
    assert "cuInit has run" in seen["after_cuinit"]


_ORDER_CHILD = """
import runpy, sys
import torch
import client_lib
events = []
torch.cuda.is_available = lambda: events.append("torch.cuda.is_available") or False
class RecordingClient(client_lib.Client):
    def __init__(self, *args, **kwargs):
        events.append("Client")
        super().__init__(*args, **kwargs)
client_lib.Client = RecordingClient
sys.argv = ["train_loop.py", "--steps", "2", "--width", "8"]
try:
    runpy.run_path("examples/train_loop.py", run_name="__main__")
except SystemExit as exc:
    assert exc.code == 0, exc.code
print(" ".join(events))
"""


def test_the_training_example_opens_its_session_before_touching_cuda(daemon):
    env = dict(os.environ, NODEAGENT_ENDPOINT=daemon.endpoint)
    out = subprocess.run([sys.executable, "-c", _ORDER_CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    events = out.stdout.strip().splitlines()[-1].split()
    assert events[0] == "Client" and "torch.cuda.is_available" in events


_REAL_CHILD = """
import json, torch
from client_lib import cuda_probe
seen = {"before": cuda_probe.cuda_initialised_by()}
available = torch.cuda.is_available()
seen.update(available=available, torch_flag=torch.cuda.is_initialized(), after=cuda_probe.cuda_initialised_by())
print(json.dumps(seen))
"""


@pytest.mark.gpu
def test_on_a_real_driver_is_available_initialises_cuda_and_the_probe_sees_it():
    torch = pytest.importorskip("torch")
    if not torch.backends.cuda.is_built():
        pytest.skip("torch without CUDA")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    out = subprocess.run([sys.executable, "-c", _REAL_CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    seen = __import__("json").loads(out.stdout)
    if not seen["available"]:
        pytest.skip("no usable GPU")
    assert seen["before"] is None  # importing torch did not start CUDA, and asking did not either
    assert not seen["torch_flag"]  # why torch's own flag is not enough
    assert "cuInit has run" in seen["after"]
