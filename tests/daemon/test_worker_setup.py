"""Which GPU a ctxpool worker and a client use (by UUID, never by NVML index), and the memory the
workers may hold: the budget arithmetic and the share admission holds for them. Pure functions on a
fake backend whose GPUs have UUIDs and memory totals; the daemon-level wiring is in
tests/daemon/test_worker_devices.py."""

from __future__ import annotations

import pytest

from client_lib import device_id
from client_lib.device_id import DeviceNotVisibleError
from nodeagent import memory
from nodeagent.daemon import worker_setup
from nodeagent.devices import DeviceBackend, DeviceInfo, DeviceProcess, cuda_visible_name
from nodeagent.daemon.server import welcome_ordinal

MiB = 1 << 20
UUIDS = ["GPU-5ad0a5d2-1b4c-4f7e-9a0e-3c1d2e3f4a5b", "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"]


class FakeGpus(DeviceBackend):
    """Two GPUs as NVML would list them: NVML index 1 is the second UUID, whatever CUDA calls it."""

    name = "cuda"

    def __init__(self, totals_mb=(81559, 40960), uuids=UUIDS) -> None:
        self._totals_mb, self._uuids = list(totals_mb), list(uuids)

    def count(self) -> int:
        return len(self._totals_mb)

    def device(self, index: int) -> DeviceInfo:
        self._check_index(index)
        return DeviceInfo(index=index, uuid=self._uuids[index], name="NVIDIA H100 80GB HBM3", backend="cuda",
                          memory_total_bytes=self._totals_mb[index] * MiB, memory_used_bytes=0,
                          utilization_percent=0.0)

    def processes(self, index: int) -> list[DeviceProcess]:
        return []

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ identity


def test_a_worker_sees_only_its_gpu_by_uuid_and_uses_ordinal_0():
    gpus = FakeGpus()
    second = gpus.device(1)
    env, ordinal = worker_setup.worker_env("cuda", second)
    # NVML index 1, yet the worker's device is CUDA ordinal 0: the only one CUDA_VISIBLE_DEVICES leaves it
    assert env["CUDA_VISIBLE_DEVICES"] == UUIDS[1] and ordinal == 0
    assert env[worker_setup.DEVICE_UUID_ENV] == UUIDS[1] and "CUDA_DEVICE_ORDER" not in env


def test_a_worker_of_an_mps_device_gets_the_devices_mps_client_settings():
    mps = {"CUDA_MPS_PIPE_DIRECTORY": "/run/nodeagent/mps/0/pipe", "CUDA_MPS_LOG_DIRECTORY": "/run/nodeagent/mps/0/log",
           "CUDA_VISIBLE_DEVICES": UUIDS[0]}
    env, ordinal = worker_setup.worker_env("cuda", FakeGpus().device(0), mps_env=mps)
    assert {k: env[k] for k in mps} == mps and ordinal == 0
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env  # the control daemon's default share
    cpu = DeviceInfo(index=1, uuid="CPU-0123abcd-1", name="cpu:1", backend="cpu", memory_total_bytes=8 << 30,
                     memory_used_bytes=None, utilization_percent=None)
    env, ordinal = worker_setup.worker_env("cpu", cpu, mps_env=mps)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == mps["CUDA_MPS_PIPE_DIRECTORY"] and ordinal == 1
    assert worker_setup.worker_env("cpu", cpu)[0] == {worker_setup.DEVICE_UUID_ENV: "CPU-0123abcd-1"}


def test_a_gpu_without_a_uuid_is_named_by_pci_bus_order():
    gpus = FakeGpus(uuids=[UUIDS[0], "GPU-unknown-1"])  # what CudaBackend records when NVML gives none
    assert cuda_visible_name(gpus.device(0)) == UUIDS[0] and cuda_visible_name(gpus.device(1)) is None
    env, ordinal = worker_setup.worker_env("cuda", gpus.device(1))
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and ordinal == 0


def test_the_welcome_says_which_ordinal_where_the_daemon_can_tell():
    assert welcome_ordinal("cuda", UUIDS[1], {"CUDA_VISIBLE_DEVICES": UUIDS[1], "CUDA_MPS_PIPE_DIRECTORY": "/x"}) == 0
    assert welcome_ordinal("cuda", UUIDS[1], {}) is None  # the client's own CUDA_VISIBLE_DEVICES decides
    assert welcome_ordinal("cpu", "CPU-0123abcd-0", {"CUDA_VISIBLE_DEVICES": "CPU-0123abcd-0"}) is None


def test_a_client_finds_its_gpu_from_cuda_visible_devices_or_torchs_uuids():
    never = lambda: pytest.fail("asked torch although CUDA_VISIBLE_DEVICES decided it")  # noqa: E731
    both = ",".join(reversed(UUIDS))
    assert device_id.cuda_ordinal(UUIDS[1], {"CUDA_VISIBLE_DEVICES": both}, never) == 0
    assert device_id.cuda_ordinal(UUIDS[0], {"CUDA_VISIBLE_DEVICES": both}, never) == 1
    assert device_id.cuda_ordinal(UUIDS[0], {"CUDA_VISIBLE_DEVICES": f"{UUIDS[1]},GPU-5ad0a5d2"}, never) == 1  # a prefix
    # indices (Slurm's) or nothing: the positions of torch's devices decide, not NVML's numbers
    assert device_id.cuda_ordinal(UUIDS[0], {"CUDA_VISIBLE_DEVICES": "3,1"}, lambda: [UUIDS[1], UUIDS[0]]) == 1
    assert device_id.cuda_ordinal(UUIDS[1], {}, lambda: list(UUIDS)) == 1
    with pytest.raises(DeviceNotVisibleError, match="does not name it"):
        device_id.cuda_ordinal(UUIDS[0], {"CUDA_VISIBLE_DEVICES": f"{UUIDS[1]},0"}, never)  # CUDA stops at "0"
    with pytest.raises(DeviceNotVisibleError, match="empty"):
        device_id.cuda_ordinal(UUIDS[0], {"CUDA_VISIBLE_DEVICES": ""}, never)
    with pytest.raises(DeviceNotVisibleError, match="not among the 1 CUDA device"):
        device_id.cuda_ordinal(UUIDS[0], {"CUDA_VISIBLE_DEVICES": "1"}, lambda: [UUIDS[1]])


# ------------------------------------------------------------------ memory


def test_auto_budget_is_half_of_what_contexts_pools_and_sessions_leave_split_between_workers():
    # an H100 (81559 MiB), two workers with 512 MiB contexts, nothing declared
    assert memory.auto_resident_mb(81559, 2, 512, 0, 0) == (81559 - 1024) // 2 // 2 == 20133
    assert memory.auto_resident_mb(81559, 2, 512, 1024, 30000) == (81559 - 2 * 1536 - 30000) // 2 // 2
    assert memory.auto_resident_mb(81559, 1, 512, 0, 0) == (81559 - 512) // 2
    assert memory.auto_resident_mb(1000, 2, 512, 0, 0) == 0  # the contexts take it all: never negative
    assert memory.auto_resident_mb(81559, 2, 512, 0, 90000) == 0
    with pytest.raises(ValueError):
        memory.auto_resident_mb(81559, 0, 512, 0, 0)


def test_each_device_gets_its_own_budget_from_its_capacity_and_its_sessions():
    gpus = FakeGpus()
    shares = worker_setup.worker_shares(gpus.devices(), workers=2, context_mb=512, pool_mb=0, resident_mb="auto",
                                        reserve_mb=1024, declared_mb={1: 8000})
    assert shares[0].resident_mb == memory.auto_resident_mb(81559 - 1024, 2, 512, 0, 0)
    assert shares[1].resident_mb == memory.auto_resident_mb(40960 - 1024, 2, 512, 0, 8000)
    assert shares[0].total_mb == 2 * (512 + shares[0].resident_mb)
    fixed = worker_setup.worker_shares(gpus.devices(), workers=2, context_mb=512, pool_mb=256, resident_mb=4096,
                                       reserve_mb=0, declared_mb={})
    assert fixed[1].total_mb == 2 * (512 + 256 + 4096)
    unbounded = worker_setup.worker_shares(gpus.devices(), workers=2, context_mb=512, pool_mb=0, resident_mb=0,
                                           reserve_mb=0, declared_mb={})
    assert unbounded[0].resident_mb is None and unbounded[0].total_mb == 1024
    setup = worker_setup.setup_for("cuda", gpus.device(1), shares[1])
    assert setup.memory_budget_bytes == shares[1].resident_mb * MiB and setup.ordinal == 0
    assert setup.env["CUDA_VISIBLE_DEVICES"] == UUIDS[1]
    assert worker_setup.setup_for("cuda", gpus.device(0), unbounded[0]).memory_budget_bytes is None


def test_admission_holds_the_workers_share_and_says_so():
    info = FakeGpus().device(0)
    share = memory.WorkerShare(workers=2, context_mb=512, pool_mb=0, resident_mb=20000)
    free = 81559 - 1000 - share.total_mb  # 1000 declared by another session
    assert memory.admission_problem(info, 0, 1000, free, share) is None
    problem = memory.admission_problem(info, 0, 1000, free + 1, share)
    assert problem is not None and problem.startswith(f"device 0 has {free} MiB free for declarations")
    assert "41024 MiB held for 2 ctxpool worker(s): 512 context + 0 pool + 20000 resident models" in problem
    assert memory.admission_problem(info, 0, 1000, free + 1, None) is None  # no workers: they hold nothing
    assert memory.held_mb(None) == 0 and memory.held_mb(share) == 41024
