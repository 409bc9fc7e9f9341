"""Admission (nodeagent/daemon/admission.py) stepped by hand: which device a new session joins and
whom to suspend to make room, over a real session table and real schedulers, with devices of set
sizes, a scripted cluster refusal and scripted worker shares (no daemon, no sockets)."""

from __future__ import annotations

from client_lib import protocol as p
from nodeagent.config import ServeConfig
from nodeagent.daemon.admission import Admission
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.devices import DeviceInfo
from nodeagent.memory import MiB, WorkerShare
from sharing import Workload
from tests.daemon_parts import FakeDevices, make_suspensions, make_tokens

NOW = 100.0


class SizedBackend:
    """Devices of the given sizes in MiB (the cpu backend reports the host's memory, which varies)."""

    def __init__(self, *sizes_mb: int) -> None:
        self._sizes_mb = sizes_mb

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(index=i, uuid=f"GPU-{i}", name="sized", backend="cpu", memory_total_bytes=mb * MiB,
                           memory_used_bytes=None, utilization_percent=None) for i, mb in enumerate(self._sizes_mb)]


class Node:
    """An :class:`Admission` and what it reads: sessions joined by hand, refusals and shares scripted."""

    def __init__(self, *sizes_mb: int, **config) -> None:
        self.devices = FakeDevices(backend=SizedBackend(*sizes_mb))
        self.sessions = SessionTable()
        self.tokens = make_tokens(count=len(sizes_mb), sessions=self.sessions)
        self.refusals: dict[int, str] = {}  # device -> why the cluster endpoint refuses it
        self.asked: list[tuple[int, str, str | None]] = []
        self.shares: dict[int, WorkerShare] = {}
        self.suspensions = make_suspensions(sessions=self.sessions, tokens=self.tokens)
        self.admission = Admission(config=ServeConfig(backend="cpu", **config), devices=self.devices,
                                   sessions=self.sessions, tokens=self.tokens, suspensions=self.suspensions,
                                   refusal=self._refusal, workers_share=self.shares.get)

    def _refusal(self, device: int, workload: str, borrower: str | None) -> str | None:
        self.asked.append((device, workload, borrower))
        return self.refusals.get(device)

    def join(self, sid: str, device: int, workload: Workload = Workload.TRAINING, memory_mb: int = 0,
             suspending: bool = False) -> Session:
        s = Session(id=sid, key="k", route=sid, name=sid, claimed_pid=1, verified_pid=None, start_ticks=None,
                    uid=0, workload=workload, weight=1.0, device=device, memory_mb=memory_mb, last_seen=NOW)
        self.sessions.add(s)
        self.tokens.add(device, sid, workload, 1.0, NOW)
        if suspending:  # asked to suspend: its state is about to be in host memory
            self.suspensions.begin(s, 5000.0, NOW, reason="requested")
        return s


# ------------------------------------------------------------------ pick_device


def test_a_session_joins_the_least_loaded_device_the_lowest_index_on_a_tie():
    node = Node(1000, 1000, 1000)
    assert node.admission.pick_device(None, 0) == (0, "", "")
    node.join("a", 0)
    node.join("b", 0)
    node.join("c", 2)
    assert node.admission.pick_device(None, 0) == (1, "", "")
    node.join("d", 1)
    assert node.admission.pick_device(None, 0) == (1, "", "")  # 1 and 2 hold one each: the lower index
    node.join("e", 1)
    assert node.admission.pick_device(None, 0) == (2, "", "")


def test_a_wanted_device_is_the_only_candidate_even_when_full():
    node = Node(1000, 1000)
    node.join("a", 0, memory_mb=900)
    assert node.admission.pick_device(0, 50) == (0, "", "")  # the busier one, because it was asked for
    device, code, why = node.admission.pick_device(0, 200)
    assert (device, code) == (None, p.ErrorCode.NO_MEMORY) and "device 0 has 100 MiB free" in why, why
    assert node.admission.pick_device(None, 200) == (1, "", "")


def test_a_device_the_node_does_not_have_is_refused_naming_its_range_and_backend():
    node = Node(1000, 1000)
    for wanted in (2, -1):
        assert node.admission.pick_device(wanted, 0) == (
            None, p.ErrorCode.DEVICE, f"no device {wanted}; this node has devices 0..1 (backend cpu)")
    assert node.asked == []  # refused before anything else is asked


def test_a_lost_device_takes_no_session_and_says_why_when_none_is_left():
    node = Node(1000, 1000)
    node.join("a", 1)
    node.devices.lost.lose(0, "Xid 79")
    assert node.admission.pick_device(None, 0) == (1, "", "")  # the less loaded device failed
    device, code, why = node.admission.pick_device(0, 0)
    assert (device, code) == (None, p.ErrorCode.DEVICE) and why == node.devices.lost.refusal(0)
    node.devices.lost.lose(1, "fell off the bus")
    device, code, why = node.admission.pick_device(None, 0)
    assert (device, code) == (None, p.ErrorCode.DEVICE)
    assert why == f"{node.devices.lost.refusal(0)}; {node.devices.lost.refusal(1)}"
    assert [d for d, _, _ in node.asked] == [1]  # a lost device is never offered to the cluster
    node.devices.lost.back(0)
    assert node.admission.pick_device(None, 0) == (0, "", "")


def test_a_refused_device_is_skipped_and_all_refused_is_e_state():
    node = Node(1000, 1000)
    node.refusals[0] = "device 0 is lent to job-a"
    assert node.admission.pick_device(None, 0, "training", "job-b") == (1, "", "")
    assert node.asked == [(0, "training", "job-b"), (1, "training", "job-b")]
    node.refusals[1] = "device 1 is draining"
    assert node.admission.pick_device(None, 0, "inference") == (
        None, p.ErrorCode.STATE, "device 0 is lent to job-a; device 1 is draining")


def test_a_memory_problem_outranks_a_refusal():
    node = Node(1000, 1000)
    node.refusals[0] = "device 0 is draining"
    node.join("a", 1, memory_mb=1000)
    device, code, why = node.admission.pick_device(None, 1)
    assert (device, code) == (None, p.ErrorCode.NO_MEMORY)
    assert why.startswith("device 1 has 0 MiB free") and "draining" not in why, why


def test_memory_counts_declarations_the_workers_share_and_the_reserve():
    node = Node(1000, 1000, memory_reserve_mb=100)
    node.join("a", 0, memory_mb=500)
    node.shares[0] = WorkerShare(workers=2, context_mb=50, pool_mb=25, resident_mb=25)  # 200 MiB held
    assert node.admission.pick_device(0, 200) == (0, "", "")  # 500 + 200 + 200 = 900, the capacity
    device, code, why = node.admission.pick_device(0, 201)
    assert (device, code) == (None, p.ErrorCode.NO_MEMORY)
    assert "200 MiB free" in why and "500 of 900 MiB declared" in why and "100 MiB reserved" in why, why
    assert "200 MiB held for 2 ctxpool worker(s)" in why, why
    assert node.admission.pick_device(None, 201) == (1, "", "")  # the next device, though it is idle too


def test_a_suspended_sessions_declaration_leaves_room():
    node = Node(1000)
    node.join("parked", 0, memory_mb=800, suspending=True)
    node.join("running", 0, memory_mb=100)
    assert node.admission.pick_device(None, 900) == (0, "", "")
    assert node.admission.pick_device(None, 901)[1] == p.ErrorCode.NO_MEMORY


def test_a_class_cap_refuses_its_class_where_memory_would_fit():
    node = Node(1000, memory_class_cap_percent={"training": 50.0})
    node.join("t", 0, memory_mb=400)
    assert node.admission.pick_device(None, 100, "training") == (0, "", "")
    device, code, why = node.admission.pick_device(None, 101, "training")
    assert (device, code) == (None, p.ErrorCode.NO_MEMORY)
    assert "memory.class_cap_percent.training = 50" in why and "at most 500 MiB" in why, why
    assert node.admission.pick_device(None, 600, "inference") == (0, "", "")  # another class: not capped


def test_a_suspended_sessions_declaration_does_not_count_against_its_class_cap():
    node = Node(1000, memory_class_cap_percent={"training": 50.0})
    node.join("parked", 0, memory_mb=400, suspending=True)
    node.join("t", 0, memory_mb=100)
    assert node.admission.pick_device(None, 400, "training") == (0, "", "")  # 100 of 500 counted
    assert "100 MiB declared" in node.admission.pick_device(None, 401, "training")[2]


# --------------------------------------------------------------- make_room_plan


def test_make_room_suspends_the_lowest_class_first_then_the_largest_declarations():
    node = Node(1000)
    node.join("be", 0, Workload.BEST_EFFORT, memory_mb=300)
    node.join("big", 0, memory_mb=500)
    node.join("small", 0, memory_mb=100)
    node.join("svc", 0, Workload.INFERENCE, memory_mb=50)  # not of a lower class: never a victim
    device, victims = node.admission.make_room_plan(None, Workload.INFERENCE, 600)
    assert device == 0 and [s.id for s in victims] == ["be", "big"]  # 950 + 600 - 1000: 550 to free
    device, victims = node.admission.make_room_plan(None, Workload.INFERENCE, 200)
    assert device == 0 and [s.id for s in victims] == ["be"]


def test_make_room_finds_nothing_when_suspending_every_lower_class_is_not_enough():
    node = Node(1000)
    node.join("be", 0, Workload.BEST_EFFORT, memory_mb=200)
    node.join("t", 0, memory_mb=700)  # a training newcomer may suspend best-effort only
    assert node.admission.make_room_plan(None, Workload.TRAINING, 400) == (None, [])
    node.join("was-asked", 0, Workload.BEST_EFFORT, memory_mb=500, suspending=True)  # its room is counted free
    device, victims = node.admission.make_room_plan(None, Workload.TRAINING, 300)
    assert device == 0 and [s.id for s in victims] == ["be"]


def test_make_room_counts_the_workers_share_in_what_must_be_freed():
    node = Node(1000)
    node.join("t1", 0, memory_mb=300)
    node.join("t2", 0, memory_mb=300)
    assert [s.id for s in node.admission.make_room_plan(None, Workload.INFERENCE, 600)[1]] == ["t1"]  # 200 to free
    node.shares[0] = WorkerShare(workers=1, context_mb=100, pool_mb=50, resident_mb=50)  # 200 held: 400 to free
    assert [s.id for s in node.admission.make_room_plan(None, Workload.INFERENCE, 600)[1]] == ["t1", "t2"]


def test_make_room_passes_over_refused_lost_and_capped_devices():
    node = Node(1000, 1000, 1000, 1000, memory_class_cap_percent={"inference": 50.0})
    for device in range(4):
        node.join(f"t{device}", device, memory_mb=900)
    node.refusals[0] = "device 0 is draining"
    node.devices.lost.lose(1, "Xid 79")
    node.join("svc", 2, Workload.INFERENCE, memory_mb=400)  # device 2: inference's cap is 500 MiB
    device, victims = node.admission.make_room_plan(None, Workload.INFERENCE, 200)
    assert device == 3 and [s.id for s in victims] == ["t3"]
    assert node.admission.make_room_plan(2, Workload.INFERENCE, 200) == (None, [])  # asked for: still capped
    assert node.admission.make_room_plan(0, Workload.INFERENCE, 200) == (None, [])
    assert node.admission.make_room_plan(1, Workload.INFERENCE, 200) == (None, [])
    node.refusals.clear()
    device, victims = node.admission.make_room_plan(0, Workload.INFERENCE, 200)
    assert device == 0 and [s.id for s in victims] == ["t0"]
