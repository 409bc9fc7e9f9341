"""A loan node on a real GPU: the path docs/cluster.md describes for GPU nodes, which the cpu
scenario (test_ray_scenario.py) cannot reach. One cuda-backend daemon with its cluster endpoint,
a Ray head without GPUs, the node's LoanAgent with ``gpu=True``. A lend starts a loan raylet
with ``--num-gpus 1`` and the device's UUID in ``CUDA_VISIBLE_DEVICES``; a Ray task that asks
for one GPU and the job's loan unit lands there, sees exactly the lent GPU (by UUID), is
admitted by the daemon as the borrower's training session, and computes on it. The reclaim
stops the loan raylet, and Ray's GPU total is back to 0 within a second."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import REPO

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

JOB = "gpu-job"


def _task():
    """Runs on the loan node: what this worker sees, and one slice of work through nodeagent."""
    import os

    import ray
    import torch

    from client_lib import Client

    seen = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "borrower": os.environ.get("NODEAGENT_BORROWER"), "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "device_count": torch.cuda.device_count()}
    with Client("ray-gpu-worker", workload="training") as client:  # borrower and endpoint from the loan node
        seen["client_cuda_device"] = client.cuda_device
        seen["client_uuid"] = client.device_uuid
        props = torch.cuda.get_device_properties(client.cuda_device)
        seen["torch_uuid"] = "GPU-" + str(props.uuid)
        with client.slice(timeout=30):
            a = torch.ones(1024, 1024, device=client.cuda_device)
            seen["sum"] = float((a @ a).sum().item())
    return seen


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_loan_node_gets_the_lent_gpu_by_uuid_and_ray_drops_it_at_reclaim():
    from client_lib.placement import ClientKeys, PlacementClient, load_server_public
    from nodeagent import keys
    from nodeagent_ray.actors import LoanAgent, LoanSettings, loan_resource
    from nodeagent_ray.raynode import RayNodeProcess, RayNodeSpec, free_port, wait_for_head_address

    work = tempfile.mkdtemp(prefix="rg-", dir="/tmp")  # short: unix socket paths
    daemon = head = placement = None
    try:
        keys_dir = os.path.join(work, "keys")
        client_key = keys.generate(keys_dir, clients=("controller",)).clients["controller"]
        cluster, events = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        config = os.path.join(work, "nodeagent.toml")
        with open(config, "w") as f:
            f.write(f'[cluster]\nendpoint = "{cluster}"\nevents_endpoint = "{events}"\nkeys_dir = "{keys_dir}"\n'
                    'node = "g1"\nprotect_s = 0\n')
        endpoint = f"ipc://{work}/agent.sock"
        with open(os.path.join(work, "daemon.log"), "ab") as log:
            daemon = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--config", config, "--backend",
                                       "cuda", "--endpoint", endpoint, "--state-dir", os.path.join(work, "state"),
                                       "--ctxpool", "off"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        placement = PlacementClient({"g1": cluster}, keys=ClientKeys.load(client_key),
                                    server_keys={"g1": load_server_public(os.path.join(keys_dir, "server.key"))})
        deadline = time.monotonic() + 60
        while True:
            result = placement.inventory()["g1"]
            if result.reply is not None and not hasattr(result.reply, "code"):
                break
            assert daemon.poll() is None and time.monotonic() < deadline, open(os.path.join(work, "daemon.log")).read()
            time.sleep(0.2)
        device = result.reply.devices[0]
        assert device.uuid.startswith("GPU-"), device

        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        ray_tmp = os.path.join(work, "ray")
        head = RayNodeProcess.start(RayNodeSpec(temp_dir=ray_tmp, plasma_dir=work, num_cpus=2, env=env,
                                                resources={"nodeagent_node:g1": 100}),
                                    None, log_path=os.path.join(work, "ray-head.log"))
        address = wait_for_head_address(ray_tmp, head._proc)
        ray.init(address=address, namespace="nodeagent", logging_level="WARNING", log_to_driver=False)
        assert ray.cluster_resources().get("GPU", 0) == 0
        agent = LoanAgent.options(resources={"nodeagent_node:g1": 1}).remote(
            "g1", LoanSettings(address=address, state_dir=os.path.join(work, "loans"), temp_dir=ray_tmp,
                               endpoint=endpoint, gpu=True))

        assert placement.lend("g1", device.index, JOB).state == "LENT"
        up_ms = ray.get(agent.start.remote(device.index, JOB, device.uuid), timeout=90)
        assert ray.cluster_resources().get("GPU", 0) == 1

        seen = ray.get(ray.remote(_task).options(num_gpus=1, resources={loan_resource(JOB): 1}).remote(), timeout=120)
        print({"loan_node_up_ms": round(up_ms), **seen})
        assert seen["borrower"] == JOB
        assert seen["cuda_visible_devices"] == device.uuid  # Ray passed the raylet's one GPU on, by UUID
        assert len(seen["ray_gpu_ids"]) == 1
        assert seen["device_count"] == 1
        assert seen["client_uuid"] == seen["torch_uuid"] == device.uuid
        assert seen["client_cuda_device"] == "cuda:0"
        assert seen["sum"] == 1024.0 ** 3

        started = time.monotonic()
        reply = placement.reclaim("g1", device.index, deadline_ms=2000)
        free_ms = (time.monotonic() - started) * 1000.0
        ray.get(agent.stop.remote(device.index), timeout=10)
        deadline = time.monotonic() + 1.0
        while ray.cluster_resources().get("GPU", 0) != 0:
            assert time.monotonic() < deadline, "Ray still counts the lent GPU a second after the reclaim"
            time.sleep(0.005)
        caught_up_ms = (time.monotonic() - started) * 1000.0
        print({"reclaim": reply.outcome if hasattr(reply, "outcome") else reply, "free_ms": round(free_ms, 1),
               "ray_caught_up_ms": round(caught_up_ms, 1)})
        ray.get(agent.stop_all.remote(), timeout=30)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if placement is not None:
            placement.close()
        for pidfile in sorted(os.listdir(os.path.join(work, "loans"))) if os.path.isdir(os.path.join(work, "loans")) \
                else []:
            if pidfile.endswith(".json"):
                proc = RayNodeProcess.from_pidfile(os.path.join(work, "loans", pidfile))
                if proc is not None:
                    proc.stop()
        if head is not None:
            head.stop()
        if daemon is not None and daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(work, ignore_errors=True)
