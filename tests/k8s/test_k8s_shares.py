"""What the device plugin advertises and allocates, decided by hand (nodeagent.k8s.shares is
pure: no daemon, no kubelet, no gRPC)."""

from __future__ import annotations

import dataclasses

import pytest

from nodeagent.k8s import shares
from nodeagent.k8s.shares import AllocationSettings, Gpu, NodeView, SharePolicy

A = Gpu(index=0, uuid="GPU-aaaa", backend="cuda", capacity_mb=80_000, state="FREE")
B = Gpu(index=1, uuid="GPU-bbbb", backend="cuda", capacity_mb=40_000, state="RUN")
ALLOC = AllocationSettings(endpoint="ipc:///run/nodeagent/agent.sock", host_socket_dir="/run/nodeagent",
                           container_socket_dir="/run/nodeagent", gpu_access="env")


def health_of(policy: SharePolicy, view: NodeView) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for d in policy.devices(view):
        out.setdefault(shares.parse_share_id(d.id)[0], set()).add(d.health)
    return out


@pytest.mark.parametrize("gpu, lent, healthy", [
    (Gpu(0, "GPU-x", "cuda", 1, state="FREE"), "unhealthy", True),
    (Gpu(0, "GPU-x", "cuda", 1, state="RUN"), "unhealthy", True),
    (Gpu(0, "GPU-x", "cuda", 1, state="PROTECT"), "unhealthy", True),
    (Gpu(0, "GPU-x", "cuda", 1, state=None), "unhealthy", True),  # inventory not answered: status alone
    (Gpu(0, "GPU-x", "cuda", 1, state="LENT", borrower="job"), "unhealthy", False),
    (Gpu(0, "GPU-x", "cuda", 1, state="LENT", borrower="job"), "healthy", True),
    (Gpu(0, "GPU-x", "cuda", 1, state="DRAINING"), "healthy", False),
    (Gpu(0, "GPU-x", "cuda", 1, state="FREE", lost=True, lost_reason="GPU is lost"), "healthy", False),
])
def test_health_follows_the_daemons_device_state(gpu, lent, healthy):
    policy = SharePolicy(shares=2, lent=lent)
    devices = policy.devices(NodeView(reachable=True, gpus=(gpu,)))
    assert [d.id for d in devices] == ["GPU-x::0", "GPU-x::1"]
    assert {d.health for d in devices} == {shares.HEALTHY if healthy else shares.UNHEALTHY}


def test_a_daemon_that_does_not_answer_leaves_every_share_listed_but_unhealthy():
    policy = SharePolicy(shares=3)
    assert health_of(policy, NodeView(reachable=True, gpus=(A, B))) == {"GPU-aaaa": {"Healthy"},
                                                                        "GPU-bbbb": {"Healthy"}}
    away = NodeView(reachable=False, gpus=(A, B), problem="nothing listens there")
    assert len(policy.devices(away)) == 6
    assert health_of(policy, away) == {"GPU-aaaa": {"Unhealthy"}, "GPU-bbbb": {"Unhealthy"}}
    assert shares.describe(away, policy)[0] == "Unhealthy (the daemon does not answer)"
    assert shares.describe(NodeView(reachable=True, gpus=(A,)), policy) == {0: "Healthy"}


def test_allocate_names_the_device_holding_most_of_the_containers_shares():
    policy = SharePolicy(shares=4)
    view = NodeView(reachable=True, gpus=(A, B))
    got = shares.allocate(["GPU-aaaa::0", "GPU-bbbb::1", "GPU-bbbb::2"], view, policy, ALLOC)
    assert got.envs == {
        "NODEAGENT_ENDPOINT": "ipc:///run/nodeagent/agent.sock",
        "CUDA_VISIBLE_DEVICES": "GPU-bbbb,GPU-aaaa",
        "NODEAGENT_DEVICE": "1", "NODEAGENT_DEVICE_UUID": "GPU-bbbb", "NODEAGENT_SHARES": "2",
        "NODEAGENT_MEMORY_MB": str(2 * 40_000 // 4),
        "NVIDIA_VISIBLE_DEVICES": "GPU-bbbb,GPU-aaaa",
    }
    assert got.mounts == [("/run/nodeagent", "/run/nodeagent", True)] and got.cdi_devices == []
    cdi = shares.allocate(["GPU-aaaa::3"], view, policy, dataclasses.replace(ALLOC, gpu_access="cdi"))
    assert cdi.cdi_devices == ["nvidia.com/gpu=GPU-aaaa"] and "NVIDIA_VISIBLE_DEVICES" not in cdi.envs
    none = shares.allocate(["GPU-aaaa::3"], view, policy, dataclasses.replace(ALLOC, gpu_access="none"))
    assert none.cdi_devices == [] and "NVIDIA_VISIBLE_DEVICES" not in none.envs


def test_memory_per_share_is_the_capacity_split_or_what_was_set():
    assert SharePolicy(shares=3).memory_mb(A) == 26_666
    assert SharePolicy(shares=3, memory_mb_per_share=1000).memory_mb(A) == 1000
    assert SharePolicy(shares=3, memory_mb_per_share=0).memory_mb(A) == 0


@pytest.mark.parametrize("ids, fragment", [
    ([], "no devices"),
    (["nonsense"], "is not a device id of this plugin"),
    (["GPU-cccc::0"], "GPU-cccc::0 is not a device the daemon reports"),
    (["GPU-aaaa::4"], "GPU-aaaa::4 is not a device the daemon reports"),  # past --shares
    (["GPU-lost::0"], "is lost: GPU is lost"),
])
def test_allocate_refuses_what_it_cannot_give(ids, fragment):
    lost = Gpu(2, "GPU-lost", "cuda", 1, lost=True, lost_reason="GPU is lost")
    with pytest.raises(shares.AllocationError, match=fragment):
        shares.allocate(ids, NodeView(reachable=True, gpus=(A, B, lost)), SharePolicy(shares=4), ALLOC)


def test_preferred_keeps_one_container_on_one_device_and_spreads_containers():
    available = ["A::0", "A::1", "B::0", "B::1", "B::2", "C::0"]
    assert shares.preferred(available, [], 2) == ["B::0", "B::1"]  # the most free shares, and it fits
    assert shares.preferred(available, ["A::1"], 2) == ["A::1", "A::0"]  # beside what it must have
    assert shares.preferred(available, [], 4) == ["B::0", "B::1", "B::2", "A::0"]  # no device fits: fewest
    assert shares.preferred(available, ["C::0", "A::0"], 1) == ["C::0"]
    assert shares.preferred(["x", "B::0"], [], 1) == ["B::0"]  # not ours: passed over


def test_share_ids_of_a_real_gpu_fit_the_apis_63_characters():
    uuid = "GPU-fef8089b-4820-abfc-e83e-94318197576e"
    assert len(shares.share_id(uuid, 999)) <= shares.MAX_ID_CHARS
    assert shares.parse_share_id(shares.share_id(uuid, 7)) == (uuid, 7)
    with pytest.raises(ValueError, match="shares must be an integer 1..1000"):
        SharePolicy(shares=0)
