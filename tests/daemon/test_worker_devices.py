"""Through a real daemon: its warm workers start pointed at their device by UUID, with their device's
MPS client settings on an MPS device; clients learn the UUID in the welcome; the workers' memory is
held in admission. cpu backend, two logical devices, the stand-in MPS control program."""

from __future__ import annotations

import os

import pytest
import torch

from client_lib import Client, DaemonError, ErrorCode
from nodeagent import memory
from tests import models_for_tests as m
from tests.mps_stand_in import write_fake_control

pytestmark = pytest.mark.slow


@pytest.fixture
def clean_environ():
    """The MPS client applies its welcome's env to this process, and the daemon's workers inherit
    ours: start without those variables, and leave none behind."""
    saved = dict(os.environ)
    for name in m.ECHOED_ENV:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def mps_workers_daemon(workdir, start_daemon, clean_environ):
    binary = write_fake_control(workdir)
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write(f'[mps]\ndevices = [0]\ncontrol_binary = "{binary}"\n[ctxpool]\nworkers_per_device = 1\n')
    return start_daemon("--ctxpool", "on", "--cpu-devices", "2")


def test_workers_and_clients_name_their_device_by_uuid_and_mps_workers_get_its_settings(mps_workers_daemon):
    status = mps_workers_daemon.status()
    uuids = [dev.uuid for dev in status.devices]
    x = torch.ones(1, 1)
    seen = {}
    for device in (0, 1):
        with Client(f"svc{device}", workload="inference", device=device, endpoint=mps_workers_daemon.endpoint) as c:
            assert c.device_uuid == uuids[device] and c.welcome.cuda_ordinal is None and c.cuda_device == "cpu"
            if device == 0:
                c.register_model("echo", "tests.models_for_tests:env_echo", example_input=x)
                pipe_dir = c.welcome.env["CUDA_MPS_PIPE_DIRECTORY"]
            seen[device] = m.read_env_echo(c.infer("echo", x))
    assert seen[0]["NODEAGENT_DEVICE_UUID"] == uuids[0] and seen[1]["NODEAGENT_DEVICE_UUID"] == uuids[1]
    assert seen[0]["CUDA_MPS_PIPE_DIRECTORY"] == pipe_dir  # the worker is a client of its device's MPS daemon
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == uuids[0]  # as MPS names it
    assert "CUDA_MPS_PIPE_DIRECTORY" not in seen[1]  # device 1 has no MPS


def test_the_workers_memory_is_held_in_admission_and_named_when_a_session_does_not_fit(mps_workers_daemon):
    dev = mps_workers_daemon.status().devices[1]
    capacity = dev.memory_capacity_mb
    held = memory.auto_resident_mb(capacity, workers=1, context_mb=0, pool_mb=0, declared_mb=0)  # cpu: no context
    assert dev.memory_workers_mb == held > 0
    with pytest.raises(DaemonError) as info:
        Client("big", workload="training", device=1, memory_mb=capacity - held + 1, endpoint=mps_workers_daemon.endpoint)
    assert info.value.code == ErrorCode.NO_MEMORY
    assert f"{held} MiB held for 1 ctxpool worker(s)" in str(info.value), str(info.value)
    with Client("fits", workload="training", device=1, memory_mb=capacity - held, endpoint=mps_workers_daemon.endpoint):
        assert mps_workers_daemon.status().devices[1].memory_declared_mb == capacity - held
