"""The memory policy component stepped by hand: no server, no sockets, no clock of
its own. Real schedulers, a real session table and the real token gate (token
requests pass it, as the server's do); the actions it takes (send, apply, stop,
publish) are recorded. What a reader learns from its constructor is all it touches."""

from __future__ import annotations

import os
import threading

import pytest
from prometheus_client import CollectorRegistry

from client_lib import protocol as p
from nodeagent.config import ServeConfig
from nodeagent.devices import CpuBackend, DeviceLostError, DeviceProcess
from nodeagent.memory import MiB, ProcessUse
from nodeagent.daemon.gate import LostDevices, TokenGate
from nodeagent.daemon.memory_watch import DeviceBack, DeviceLost, DeviceReading, MemoryPolicy
from nodeagent.metrics import Metrics
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import Grant, Revoked, SessionState, TokenScheduler, Workload
from nodeagent.daemon.bus import Bus, LoopHandle, MayAsk, Published
from nodeagent.daemon.bus import DeviceBack as BusDeviceBack
from nodeagent.daemon.bus import DeviceLost as BusDeviceLost
from tests.conftest import wait_for
from tests.daemon_parts import FakeDevices, make_suspensions


class ScriptedGpus(CpuBackend):
    """The cpu backend with per-process device memory and lost devices scripted (what NVML
    reports on cuda); tests/daemon/test_memory_watch.py has the same for a whole daemon."""

    measures_process_memory = True

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.used_bytes: dict[int, int] = {}
        self.lost: set[int] = set()

    def processes(self, index: int) -> list[DeviceProcess]:
        if index in self.lost:
            raise DeviceLostError(index, f"GPU-{index}", "nvmlDeviceGetComputeRunningProcesses failed: GPU is lost")
        return [DeviceProcess(pid, used, mps_client=False) for pid, used in self.used_bytes.items()]


class RecordingTokens:
    """What MemoryPolicy asks of the tokens component, over real schedulers, every action
    recorded by the harness (stops as the harness scripts them)."""

    device_count = 2

    def __init__(self, harness: "Harness") -> None:
        self.h = harness
        self.schedulers = [TokenScheduler(i) for i in range(2)]
        self.held: dict[str, int] = {}  # session id -> the grant it holds (Tokens.grant_of)
        self.waits: dict[str, float] = {}  # session id -> when its timed wait began (Tokens.waiting_since)

    def grant_of(self, s):
        return self.held.get(s.id)

    def waiting_since(self, s):
        return self.waits.get(s.id)

    def state(self, device, sid):
        return self.schedulers[device].state(sid)

    def on_device(self, device, sid):
        return sid in self.schedulers[device]

    def cancel(self, device, sid, now):
        self.h._apply(self.schedulers[device].cancel(sid, now), now)

    def revoke(self, device, sid, now, reason):
        self.h._apply(self.schedulers[device].revoke(sid, now, reason), now)

    def preempt(self, s, now):
        self.end_slice(s, now)
        self.h._apply(self.schedulers[s.device].preempt(s.id, now), now)

    def request(self, device, sid, now, waiting_since=None):
        self.h._apply(self.schedulers[device].request(sid, now, waiting_since=waiting_since), now)

    def stop(self, s):
        return self.h._stop(s)

    def cancel_session(self, s, now):
        self.cancel(s.device, s.id, now)

    def end_slice(self, s, now):
        self.h.slices_ended.append(s.id)


class Harness:
    """A :class:`MemoryPolicy` over two devices, with every collaborator recorded."""

    def __init__(self, *, policy: str = "warn", stop_works: bool = True, backend=None) -> None:
        self.config = ServeConfig(backend="cpu", memory_policy=policy, memory_context_allowance_mb=0,
                                  memory_watch_ms=10)
        self.sessions = SessionTable()
        self.schedulers = [TokenScheduler(i) for i in range(2)]
        self.metrics = Metrics(CollectorRegistry())
        self.lost = LostDevices()
        self.applied: list = []
        self.sent: list[tuple[object, object]] = []
        self.events: list[tuple] = []
        self.serving_told: list[tuple[int, str, float]] = []
        self.stopped: list[str] = []
        self.slices_ended: list[str] = []
        self.wakes = threading.Event()
        self.stop_works = stop_works
        self.now = 0.0
        devices = FakeDevices(2, backend=backend if backend is not None else ScriptedGpus(2))
        devices.lost = self.lost
        self.tokens = RecordingTokens(self)
        self.schedulers = self.tokens.schedulers
        # The real token gate, which keeps the lost-devices table: it hears a lost device first;
        # the real suspension component, whose suspended sessions it keeps the requests of.
        self.suspensions = make_suspensions(sessions=self.sessions, tokens=self.tokens)
        self.gate = TokenGate(sessions=self.sessions, tokens=self.tokens, devices=devices,
                              suspensions=self.suspensions)
        bus = Bus()
        bus.subscribe(Published, lambda e: self.events.append((e.kind, e.device, e.data)))
        bus.subscribe(BusDeviceLost, self.gate.on_device_lost)
        bus.subscribe(BusDeviceLost, lambda e: self.serving_told.append((e.device, e.notice, e.now)))
        bus.subscribe(BusDeviceBack, self.gate.on_device_back)
        self.policy = MemoryPolicy(
            config=self.config, devices=devices, loop=LoopHandle(None, lambda: self.now, self.wakes.set),
            sessions=self.sessions, tokens=self.tokens, metrics=self.metrics,
            send=lambda route, msg: self.sent.append((route, msg)), bus=bus)
        bus.subscribe(MayAsk, self.gate.on_may_ask)

    def ask(self, sid: str, now: float) -> None:
        """``sid`` asks for the token (an acquire): through the gate, as the server sends it."""
        self.gate.ask(self.sessions[sid], now)

    def _stop(self, s: Session) -> bool:
        self.stopped.append(s.id)
        return self.stop_works

    def _apply(self, actions: list, now: float) -> None:
        """What the token component does with actions, as far as this test needs: who holds."""
        for action in actions:
            self.applied.append(action)
            if type(action) is Grant and action.session in self.sessions:
                self.tokens.held[action.session] = action.grant
            elif type(action) is Revoked:
                self.tokens.held.pop(action.session, None)

    def add(self, sid: str, device: int = 0, *, memory_mb: int = 100, pid: int | None = None) -> Session:
        s = Session(id=sid, key="k", route=f"route-{sid}", name=sid, claimed_pid=pid or 1, verified_pid=pid,
                    start_ticks=None, uid=0, workload=Workload.TRAINING, weight=1.0, device=device,
                    memory_mb=memory_mb, last_seen=0.0)
        self.schedulers[device].add_session(sid, s.workload, s.weight, 0.0)
        self.sessions.add(s)
        return s

    def grants(self) -> list[tuple[str, float]]:
        return [(a.session, a.waited_s) for a in self.applied if type(a) is Grant]

    def count(self, name: str, labels: dict) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def harness():
    made: list[Harness] = []

    def make(**kw) -> Harness:
        made.append(Harness(**kw))
        return made[-1]

    yield make
    for h in made:
        h.policy.stop()
        h.sessions.close()


def test_a_lost_device_revokes_to_nobody_holds_requests_and_grants_them_in_order_when_back(harness):
    h = harness()
    holder, first, second, elsewhere = h.add("s-hold"), h.add("s-first"), h.add("s-second"), h.add("s-other", 1)
    h.ask("s-hold", 0.0)
    h.tokens.waits.update({first.id: 1.0, second.id: 2.0})
    h.ask("s-first", 1.0)
    h.ask("s-second", 2.0)
    assert h.grants() == [("s-hold", 0.0)] and h.tokens.grant_of(holder) is not None

    h.policy.on_readings([DeviceLost(0, "GPU is lost")], 3.0)
    assert h.events == [("health", 0, {"device_state": "lost", "reason": "GPU is lost"})]
    assert [(a.session, a.reason) for a in h.applied if type(a) is Revoked] == [("s-hold", "device_lost")]
    assert h.grants() == [("s-hold", 0.0)]  # the revoke granted nobody: the waiters left the line first
    assert h.schedulers[0].state("s-first") is SessionState.IDLE
    assert [d for d, _, _ in h.serving_told] == [0]
    told = {route: msg for route, msg in h.sent}
    assert set(told) == {"route-s-hold", "route-s-first", "route-s-second"}  # not the session on device 1
    assert all(m.code == p.ErrorCode.DEVICE and "device 0 has failed (GPU is lost)" in m.message
               for m in told.values())

    h.ask("s-hold", 4.0)  # asks again while the device is lost: held
    assert h.grants() == [("s-hold", 0.0)]
    h.ask("s-other", 4.0)  # the other device is not affected
    assert h.grants()[-1] == ("s-other", 0.0)
    h.suspensions.begin(first, 1000.0, 4.5, reason="requested")  # suspended meanwhile: it asks again once resumed

    h.now = 5.0
    h.policy.on_readings([DeviceBack(0)], 5.0)
    assert h.events[-1] == ("health", 0, {"device_state": "ok"})
    assert h.grants()[-1] == ("s-second", 3.0)  # first in line of those held, its wait kept
    assert h.schedulers[0].state("s-hold") is SessionState.WAITING
    assert h.schedulers[0].state("s-first") is SessionState.IDLE


@pytest.mark.parametrize("policy, stop_works, action", [
    ("warn", True, None), ("revoke", True, "revoke"), ("stop", True, "stop"), ("stop", False, "revoke")])
def test_a_holder_over_its_declaration_meets_the_policy_once(harness, policy, stop_works, action):
    h = harness(policy=policy, stop_works=stop_works)
    s = h.add("s-big", memory_mb=100, pid=os.getpid())
    h.ask("s-big", 0.0)
    over = [DeviceReading(0, [ProcessUse(os.getpid(), (), os.getpid(), 300 * MiB)])]
    h.policy.on_readings(over, 1.0)
    h.policy.on_readings(over, 2.0)  # still over: flagged once, not at every reading
    assert h.count("nodeagent_memory_violations_total", {"device": "0", "policy": policy}) == 1
    assert h.policy.over_memory(s) and s.memory_used_bytes == 300 * MiB
    enforced = {a: h.count("nodeagent_enforcements_total", {"kind": a}) for a in ("stop", "revoke")}
    assert enforced == {"stop": float(action == "stop"), "revoke": float(action == "revoke")}
    assert h.stopped == (["s-big"] if policy == "stop" else [])
    assert h.slices_ended == (["s-big"] if action == "stop" else [])
    if action == "revoke":
        assert [(a.session, a.reason) for a in h.applied if type(a) is Revoked] == [("s-big", "memory")]
    if action == "stop":  # preempted: back in line, and the token free for it again
        assert h.grants()[-1][0] == "s-big"

    h.policy.on_readings([DeviceReading(0, [ProcessUse(os.getpid(), (), os.getpid(), 50 * MiB)])], 3.0)
    assert not h.policy.over_memory(s)  # under again: the next overuse counts anew
    h.policy.on_readings(over, 4.0)
    assert h.count("nodeagent_memory_violations_total", {"device": "0", "policy": policy}) == 2


def test_the_watcher_thread_runs_from_start_to_stop_and_wakes_the_loop(harness):
    backend = ScriptedGpus(2)
    h = harness(backend=backend)
    h.add("s-one", memory_mb=100, pid=os.getpid())
    backend.used_bytes = {os.getpid(): 300 * MiB}
    h.policy.start()
    assert h.wakes.wait(5)
    h.policy.apply_readings()  # what the loop does when woken
    assert h.count("nodeagent_memory_violations_total", {"device": "0", "policy": "warn"}) == 1
    backend.lost.add(1)
    wait_for(lambda: (h.policy.apply_readings(), h.lost.is_lost(1))[1])
    assert h.events[0][:2] == ("health", 1)
    h.policy.stop()


def test_without_per_process_memory_no_watcher_runs(harness):
    backend = ScriptedGpus(1)
    backend.measures_process_memory = False
    h = harness(backend=backend)
    h.policy.start()
    assert not h.wakes.wait(0.1)  # a watcher would have read (and woken the loop) every 10 ms
