"""The daemon's MPS component (nodeagent/daemon/mps.py, ``MpsPartitions``) stepped by hand.

What it decides: which devices get a control daemon (and what happens when one cannot start,
asked for or chosen by "auto"), restarting a daemon whose pidfd fired, who joins a device's MPS
server (one user at a time, none while a faulted server recovers), what a client is told to set,
and the ``partition`` request's answers. The partition tables are real (``sharing.partition``);
the control daemons are a scripted stand-in put where the component builds them (the real
``nodeagent.mps.MpsControl`` runs processes, and has tests of its own in test_mps.py); the poller
is real, watching pipes the stand-in hands out as its pidfds."""

from __future__ import annotations

import logging
import os

import pytest

from client_lib import protocol as p
from nodeagent.config import ConfigError, ServeConfig
from nodeagent.daemon import mps as daemon_mps
from nodeagent.daemon.bus import MpsFaulted
from nodeagent.daemon.loop import EventLoopPoller
from nodeagent.daemon.mps import MpsPartitions
from nodeagent.devices import CpuBackend
from nodeagent.mps import MpsRestartBudgetError, MpsStartError, QuitStep
from sharing.partition import ACTIVE_THREAD_PERCENTAGE_ENV, PINNED_MEM_LIMIT_ENV, PartitionError


class StandInControl:
    """A control daemon that does what the test says: a start that fails for ``failing`` devices,
    a pipe for its pidfd (a new one per restart), a restart that fails once ``budget`` is spent."""

    def __init__(self, script: "Script", device: int, uuid: str, runtime_dir: str, binary: str,
                 dir_mode: int = 0o700) -> None:
        self.script, self.device, self.uuid, self.runtime_dir, self.binary = script, device, uuid, runtime_dir, binary
        self.dir_mode = dir_mode
        self.pid = 4000 + device
        self.restarts = 0
        self.quit_timeout_s: float | None = None
        self._pipe: tuple[int, int] | None = None

    def start(self) -> None:
        if self.device in self.script.failing:
            raise MpsStartError(f"nvidia-cuda-mps-control for device {self.device} exited at once")
        self._new_pipe()

    def watch_fd(self) -> int | None:
        return self._pipe[0] if self._pipe is not None else None

    def ensure_running(self) -> bool:
        if self.restarts >= self.script.budget:
            raise MpsRestartBudgetError(f"device {self.device}: died {self.restarts + 1} times")
        self.restarts += 1
        self.pid += 100
        self._new_pipe()
        return True

    def quit(self, timeout_s: float = 5.0) -> QuitStep:
        self.quit_timeout_s = timeout_s
        return QuitStep.QUIT

    def client_env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": f"{self.runtime_dir}/mps-{self.device}/pipe",
                "CUDA_VISIBLE_DEVICES": self.uuid}

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _new_pipe(self) -> None:
        fresh = os.pipe()  # before the old one closes: a number of its own, so the test tells them apart
        self.close()
        self._pipe = fresh


class Script:
    """The stand-ins made so far and how they behave."""

    def __init__(self) -> None:
        self.failing: set[int] = set()
        self.budget = 3
        self.made: dict[int, StandInControl] = {}

    def __call__(self, device, uuid, runtime_dir, binary, dir_mode=0o700) -> StandInControl:
        control = StandInControl(self, device, uuid, runtime_dir, binary, dir_mode)
        self.made[device] = control
        return control


class AutoConfig(ServeConfig):
    """Settings as "auto" resolves them on a root cuda co-run node with the binary found."""

    def mps_devices_for(self, backend: str, count: int) -> tuple[list[int], bool]:
        return list(range(count)), True


@pytest.fixture
def script(monkeypatch):
    made = Script()
    monkeypatch.setattr(daemon_mps, "MpsControl", made)
    yield made
    for control in made.made.values():
        control.close()


class World:
    """An ``MpsPartitions`` over ``count`` cpu devices; what it sends and answers is recorded."""

    def __init__(self, script: Script, *, devices: list[int] | None = None, count: int = 2, auto: bool = False,
                 min_percent: int = 5) -> None:
        settings = dict(backend="cpu", mps_devices=devices if devices is not None else [0, 1],
                        mps_min_percent=min_percent, mps_control_binary="/opt/mps/nvidia-cuda-mps-control")
        config = AutoConfig(**{**settings, "mps_devices": "auto"}) if auto else ServeConfig(**settings)
        self.script = script
        self.poller = EventLoopPoller()
        self.sent: list[tuple[object, object]] = []
        self.errors: list[tuple[object, int, str, str]] = []
        self.info = CpuBackend(count).devices()
        self.mps = MpsPartitions(config, self.info, self.poller, send=lambda r, m: self.sent.append((r, m)),
                                 error=lambda r, rid, code, text: self.errors.append((r, rid, code, text)))

    def fd(self, device: int) -> int:
        return self.script.made[device].watch_fd()


@pytest.fixture
def world(script):
    w = World(script)
    w.mps.start("/run/na")
    return w


# ------------------------------------------------------------------ life


def test_mps_on_a_device_the_node_does_not_have_is_a_config_error(script):
    with pytest.raises(ConfigError, match=r"mps.devices names \[2\], but this node has devices 0..1"):
        World(script, devices=[0, 2])


def test_start_gives_each_listed_device_a_watched_control_daemon(script):
    w = World(script, devices=[1])
    assert not w.mps.runs_on(1)  # nothing before start
    w.mps.start("/run/na")
    control = script.made[1]
    assert (control.device, control.uuid, control.runtime_dir, control.binary) == (
        1, w.info[1].uuid, "/run/na", "/opt/mps/nvidia-cuda-mps-control")
    assert control.dir_mode == (0o755 if os.geteuid() == 0 else 0o700)
    assert w.mps.runs_on(1) and w.mps.control(1) is control
    assert not w.mps.runs_on(0) and w.mps.control(0) is None and 0 not in script.made
    assert w.poller.reader(w.fd(1)).where == "mps"


def test_a_listed_device_whose_daemon_cannot_start_stops_the_start(script):
    script.failing.add(1)
    w = World(script)
    with pytest.raises(MpsStartError, match="device 1"):
        w.mps.start("/run/na")


def test_a_device_auto_chose_whose_daemon_cannot_start_runs_without_mps(script, caplog):
    script.failing.add(1)
    w = World(script, auto=True)
    with caplog.at_level(logging.WARNING, logger="nodeagent.daemon.mps"):
        w.mps.start("/run/na")
    assert w.mps.runs_on(0) and not w.mps.runs_on(1)
    assert any("device=1: no MPS" in r.getMessage() for r in caplog.records)
    assert w.mps.join("s-a", 1, 0) is False  # its table is gone too: no share is planned
    assert w.mps.shares(1) == {}
    w.mps.on_partition("root", p.Partition(id=3, device=1, shares={"s-a": 50.0}))
    assert w.errors[-1][2] == p.ErrorCode.DEVICE


def test_a_daemon_whose_pidfd_fires_is_restarted_and_its_new_pidfd_watched(world):
    old = world.fd(0)
    other = world.fd(1)
    world.mps.on_exit(old, 1)
    control = world.script.made[0]
    assert control.restarts == 1
    new = world.fd(0)
    assert world.poller.reader(new).where == "mps" and old not in world.poller
    assert other in world.poller and world.script.made[1].restarts == 0  # the other device's is left alone
    world.mps.on_exit(old, 1)  # a stale readiness of the old pidfd: not a second restart
    assert control.restarts == 1


def test_a_daemon_past_its_restart_budget_is_given_up_and_no_longer_watched(script, caplog):
    script.budget = 1
    w = World(script, devices=[0])
    w.mps.start("/run/na")
    w.mps.on_exit(w.fd(0), 1)
    fd = w.fd(0)
    with caplog.at_level(logging.ERROR, logger="nodeagent.daemon.mps"):
        w.mps.on_exit(fd, 1)  # does not raise: the loop goes on
    assert fd not in w.poller
    assert any("cannot be kept running" in r.getMessage() for r in caplog.records)


def test_stop_quits_every_daemon_and_unwatches_them(world):
    fds = [world.fd(0), world.fd(1)]
    world.mps.stop()
    assert [world.script.made[d].quit_timeout_s for d in (0, 1)] == [5, 5]
    assert not any(fd in world.poller for fd in fds)
    assert not world.mps.runs_on(0) and not world.mps.runs_on(1)


# ------------------------------------------------------------------ sessions


def test_sessions_that_join_share_the_device_and_a_leaver_gives_its_share_back(world):
    assert world.mps.join("s-a", 0, 0, uid=1000) is True
    assert world.mps.shares(0) == {"s-a": 100}
    assert world.mps.join("s-b", 0, 0, uid=1000) is True
    assert world.mps.shares(0) == {"s-a": 50, "s-b": 50}
    assert world.mps.shares(1) == {}  # per device
    world.mps.leave("s-a", 0)
    assert world.mps.shares(0) == {"s-b": 100}
    world.mps.leave("s-never", 0)  # unknown: ignored
    world.mps.leave("s-b", 7)  # a device off MPS: ignored
    with pytest.raises(PartitionError):
        world.mps.join("s-b", 0, 0, uid=1000)  # already in


def test_one_user_at_a_time_is_on_a_devices_mps_server(world):
    assert world.mps.join("s-alice", 0, 0, uid=1000) is True
    assert world.mps.join("s-bob", 0, 0, uid=1001) is False  # a plain context beside it
    assert world.mps.shares(0) == {"s-alice": 100}
    assert world.mps.client_env("s-bob", 0) == {}
    assert world.mps.join("s-bob-1", 1, 0, uid=1001) is True  # another device has its own server
    world.mps.leave("s-alice", 0)
    assert world.mps.join("s-bob-2", 0, 0, uid=1001) is True  # the server has no client left


def test_an_unverified_uid_counts_as_a_user_of_its_own(world):
    assert world.mps.join("s-unknown", 0, 0, uid=None) is True
    assert world.mps.join("s-unknown-2", 0, 0, uid=None) is False
    assert world.mps.join("s-root", 0, 0, uid=0) is False
    world.mps.leave("s-unknown", 0)
    assert world.mps.join("s-root", 0, 0, uid=0) is True
    assert world.mps.join("s-unknown-3", 0, 0, uid=None) is False


def test_a_device_off_mps_takes_no_one(world):
    w = World(world.script, devices=[1])
    w.mps.start("/run/na")
    assert w.mps.join("s-a", 0, 100, uid=1000) is False
    assert w.mps.client_env("s-a", 0) == {} and w.mps.shares(0) == {}


def test_a_client_is_told_its_daemon_and_share_and_its_memory_limit_if_it_declared_memory(world):
    world.mps.join("s-a", 0, 300, uid=1000)
    world.mps.join("s-b", 0, 0, uid=1000)
    env_a = world.mps.client_env("s-a", 0)
    assert env_a["CUDA_MPS_PIPE_DIRECTORY"] == "/run/na/mps-0/pipe"
    assert env_a["CUDA_VISIBLE_DEVICES"] == world.info[0].uuid
    assert env_a[ACTIVE_THREAD_PERCENTAGE_ENV] == "50"
    assert env_a[PINNED_MEM_LIMIT_ENV] == "0=300M"
    assert PINNED_MEM_LIMIT_ENV not in world.mps.client_env("s-b", 0)  # declared none: no limit
    assert ACTIVE_THREAD_PERCENTAGE_ENV not in world.mps.client_env("s-b", 0, uncapped=True)
    assert world.mps.client_env("s-never", 0) == {}


def test_after_a_server_fault_no_one_joins_it_until_every_client_it_had_has_left(world):
    world.mps.join("s-a", 0, 0, uid=1000)
    world.mps.join("s-b", 0, 0, uid=1000)
    world.mps.join("s-other-user", 0, 0, uid=1001)  # outside MPS: the fault is not its
    world.mps.on_fault(MpsFaulted(0, ("s-a", "s-b", "s-other-user", "s-elsewhere"), 1.0))
    assert world.mps.recovering(0) == 2 and world.mps.recovering(1) == 0
    assert world.mps.client_env("s-a", 0) == {}  # a reattaching client of the faulted server too
    assert world.mps.join("s-new", 0, 0, uid=1000) is False
    world.mps.leave("s-a", 0)
    assert world.mps.recovering(0) == 1 and world.mps.join("s-new", 0, 0, uid=1000) is False
    world.mps.leave("s-b", 0)
    assert world.mps.recovering(0) == 0
    assert world.mps.join("s-new", 0, 0, uid=1000) is True
    assert world.mps.client_env("s-new", 0)[ACTIVE_THREAD_PERCENTAGE_ENV] == "100"


def test_a_fault_naming_no_client_of_the_server_changes_nothing(world):
    world.mps.on_fault(MpsFaulted(0, ("s-elsewhere",), 1.0))
    assert world.mps.recovering(0) == 0
    assert world.mps.join("s-a", 0, 0, uid=1000) is True


# ------------------------------------------------------------------ partition


def test_partition_sets_the_shares_and_says_who_runs_with_an_older_one(world):
    world.mps.join("s-a", 0, 0, uid=1000)
    world.mps.join("s-b", 0, 0, uid=1000)
    world.mps.client_env("s-a", 0)  # s-a's client started with 50%
    world.mps.on_partition("root", p.Partition(id=9, device=0, shares={"s-a": 70.0, "s-b": None},
                                               memory_mb={"s-b": 200}))
    assert world.errors == []
    route, reply = world.sent[-1]
    assert route == "root" and isinstance(reply, p.PartitionReply)
    assert (reply.id, reply.device, reply.shares, reply.memory_limits_mb, reply.stale) == (
        9, 0, {"s-a": 70, "s-b": 30}, {"s-b": 200}, ["s-a"])
    assert world.mps.shares(0) == {"s-a": 70, "s-b": 30}


def test_partition_refuses_a_device_off_mps_strangers_and_what_cannot_be_planned(world):
    world.mps.join("s-a", 0, 0, uid=1000)
    world.mps.on_partition("root", p.Partition(id=1, device=5, shares={"s-a": 50.0}))
    world.mps.on_partition("root", p.Partition(id=2, device=0, shares={"s-a": 50.0, "s-x": 10.0, "s-b": 5.0}))
    world.mps.on_partition("root", p.Partition(id=3, device=0, shares={"s-a": 150.0}))
    codes = [(rid, code) for _, rid, code, _ in world.errors]
    assert codes == [(1, p.ErrorCode.DEVICE), (2, p.ErrorCode.INVALID), (3, p.ErrorCode.PARTITION)]
    assert "mps.devices" in world.errors[0][3]
    assert "['s-b', 's-x']" in world.errors[1][3]  # every stranger, sorted
    assert world.sent == [] and world.mps.shares(0) == {"s-a": 100}  # nothing changed


def test_a_session_that_joins_after_its_daemon_was_given_up_is_not_pointed_at_it(script):
    script.budget = 0
    w = World(script, devices=[0])
    w.mps.start("/run/na")
    w.mps.on_exit(w.fd(0), 1)  # died; no restart left
    assert not w.mps.join("s-late", 0, 0, uid=1000)  # a plain context: not counted on MPS (Session.mps)
    assert w.mps.client_env("s-late", 0) == {}
    assert not w.mps.runs_on(0) and w.mps.shares(0) == {}  # status shows the device off MPS
    w.mps.leave("s-late", 0)
    w.mps.stop()  # nothing left to quit
