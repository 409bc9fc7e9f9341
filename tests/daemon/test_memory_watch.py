"""The memory watcher in real deployments: NVML's pids translated into the
daemon's pid namespace (NSpid), whole process trees given to their session,
MPS clients counted, the CUDA context allowed for, and a lost GPU reported as a
device failure. /proc trees are built by hand where a namespace is needed that
this host does not have; real process trees and a real in-process daemon where
it does."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from client_lib import Client, DaemonError, ErrorCode
from nodeagent import memory, procwatch
from nodeagent.config import ConfigError, ServeConfig
from nodeagent.devices import DeviceProcess
from nodeagent.memory import MiB, ProcessUse
from nodeagent.daemon.memory_watch import DeviceBack, DeviceLost, DeviceReading, MemoryWatcher, context_allowance_mb
from nodeagent.metrics import Metrics
from nodeagent.procwatch import INIT_PID_NAMESPACE, PidTranslator
from nodeagent.daemon.server import AgentServer
from nodeagent.daemon.sessions import Session
from sharing import Workload
from tests.conftest import wait_for
from tests.scripted_gpus import ScriptedGpus, RecordingEvents

OURS, OTHER = "pid:[4026532999]", "pid:[4026533111]"  # a container's pid namespace, and another one


# ------------------------------------------------------------ /proc by hand


def write_proc(root, pid: int, *, ppid: int = 1, pgrp: int | None = None, start: int = 1000,
               nspid: tuple[int, ...] | None = None, ns: str | None = None, flags: int = 0) -> None:
    """One process's stat, status (NSpid) and ns/pid link, as the kernel writes them."""
    d = root / str(pid)
    (d / "ns").mkdir(parents=True, exist_ok=True)
    rest = ["S", ppid, pgrp if pgrp is not None else pid, 0, 0, 0, flags] + [0] * 12 + [start] + [0] * 30
    (d / "stat").write_text(f"{pid} (python3 (x)) " + " ".join(map(str, rest)) + "\n")
    (d / "status").write_text(f"Name:\tpython3\nTgid:\t{pid}\nNSpid:\t{' '.join(map(str, nspid or (pid,)))}\n"
                              "VmRSS:\t1 kB\n")
    if ns is not None:
        os.symlink(ns, d / "ns" / "pid")


def test_stat_and_nspid_are_read_from_the_proc_root_given(tmp_path):
    write_proc(tmp_path, 4711, ppid=42, pgrp=40, start=123, nspid=(4711, 7), flags=0x404)
    stat = procwatch.read_stat(4711, str(tmp_path))
    # a ')' in the name does not confuse it; flags: PF_EXITING (0x4), which procwatch.exiting reads
    assert (stat.ppid, stat.pgrp, stat.flags, stat.start_ticks) == (42, 40, 0x404, 123)
    assert procwatch.read_nspid(4711, str(tmp_path)) == (4711, 7)
    assert procwatch.read_nspid(4712, str(tmp_path)) is None


def test_a_live_process_is_not_exiting_and_a_dead_one_is():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfd = os.pidfd_open(child.pid)
    try:
        assert procwatch.exiting(pidfd, child.pid) is False  # its stat's flags read, PF_EXITING not set
        child.kill()
        child.wait()
        assert procwatch.exiting(pidfd, child.pid) is True
    finally:
        os.close(pidfd)


def test_ancestors_walk_up_to_the_root_and_stop_at_gaps_and_loops(tmp_path):
    for pid, ppid in ((30, 20), (20, 10), (10, 1), (1, 0)):
        write_proc(tmp_path, pid, ppid=ppid)
    assert procwatch.ancestors(30, str(tmp_path)) == (20, 10, 1)
    write_proc(tmp_path, 50, ppid=49)  # its parent exited
    assert procwatch.ancestors(50, str(tmp_path)) == (49,)
    write_proc(tmp_path, 60, ppid=61)
    write_proc(tmp_path, 61, ppid=60)
    assert procwatch.ancestors(60, str(tmp_path)) == (61,)
    assert procwatch.ancestors(999, str(tmp_path)) == ()


def test_in_the_host_namespace_nvml_pids_are_the_daemons():
    t = PidTranslator(own_namespace=INIT_PID_NAMESPACE)
    assert t.mode == "host" and t.to_local(123456) == 123456 and t.to_local(0) is None
    assert "host's pid namespace" in t.describe()


def test_in_a_container_host_pids_are_translated_through_the_hosts_proc_nspid(tmp_path):
    host, local = tmp_path / "host", tmp_path / "local"
    write_proc(host, 81234, start=500, nspid=(81234, 17), ns=OURS)  # our process 17, as the host sees it
    write_proc(local, 17, start=500)
    write_proc(host, 81300, start=600, nspid=(81300, 17), ns=OTHER)  # pid 17 of another container
    write_proc(host, 81400, start=700, nspid=(81400, 18), ns=OURS)  # exited; local 18 is someone new
    write_proc(local, 18, start=999)
    t = PidTranslator(str(local), str(host), own_namespace=OURS)
    assert t.mode == "host_proc"
    assert t.to_local(81234) == 17
    assert t.to_local(81300) is None  # not ours, though its inner pid is 17 too
    assert t.to_local(81400) is None  # pid reused between the reads
    assert t.to_local(99999) is None  # gone
    assert f"{host}/PID/status NSpid" in t.describe()


def test_in_a_container_without_the_hosts_proc_the_pids_are_taken_as_given_and_the_log_says_what_to_do():
    t = PidTranslator(own_namespace=OURS)
    assert t.mode == "same" and t.to_local(17) == 17
    assert "set memory.host_proc" in t.describe()


def test_this_host_is_read_as_it_is():
    t = PidTranslator()
    assert t.own_namespace == procwatch.pid_namespace("self")
    assert t.to_local(os.getpid()) == os.getpid()


# ------------------------------------------------------- owners and measure


def session(sid: str, pid: int | None, memory_mb: int = 100, managed_pgid: int | None = None) -> Session:
    return Session(id=sid, key="k", route=None, name=sid, claimed_pid=pid or 1, verified_pid=pid, start_ticks=None,
                   uid=0, workload=Workload.TRAINING, weight=1.0, device=0, memory_mb=memory_mb,
                   last_seen=0.0, managed_pgid=managed_pgid)


def test_a_session_owns_its_process_tree_and_its_launched_group():
    launcher = session("s-run", 100, managed_pgid=101)  # nodeagent run: launcher 100, torchrun leader 101
    nested = session("s-nested", 105)  # a worker that opened its own session
    stranger = session("s-tcp", None)  # unverified: owns nothing
    uses = [
        ProcessUse(102, (101, 100, 1), 101, 2 * 1024 * MiB),  # torchrun worker
        ProcessUse(103, (101, 100, 1), 101, 1 * 1024 * MiB),  # another
        ProcessUse(106, (105, 101, 100, 1), 101, 3 * 1024 * MiB),  # child of the nested session's process
        ProcessUse(107, (1,), 101, 512 * MiB),  # orphan still in the launched group
        ProcessUse(200, (1,), 200, 4 * 1024 * MiB),  # someone else entirely
    ]
    owned = memory.owners([launcher, nested, stranger], uses)
    assert sorted(p.pid for p in owned["s-run"]) == [102, 103, 107]
    assert [p.pid for p in owned["s-nested"]] == [106]
    assert "s-tcp" not in owned


def test_measure_sums_the_tree_and_allows_a_context_per_process():
    s = session("s-1", 100, memory_mb=1000)
    uses = [ProcessUse(100, (1,), 100, 700 * MiB), ProcessUse(101, (100, 1), 100, 700 * MiB),
            ProcessUse(102, (100, 1), 100, None)]  # use not reported: neither counted nor allowed for
    assert memory.measure([s], uses, context_allowance_bytes=0)[0].used_bytes == 1400 * MiB
    assert s.memory_used_bytes == 1400 * MiB
    assert memory.measure([s], uses, context_allowance_bytes=200 * MiB) == []  # 1400 <= 1000 + 2 x 200
    [over] = memory.measure([s], uses, context_allowance_bytes=100 * MiB)
    assert over.allowed_bytes == 1200 * MiB
    assert memory.measure([s], []) == [] and s.memory_used_bytes is None


def test_the_context_allowance_is_512_mib_on_cuda_by_default_and_can_be_set():
    assert context_allowance_mb("auto", "cuda") == 512 and context_allowance_mb("auto", "cpu") == 0
    assert context_allowance_mb(300, "cuda") == 300
    for bad in (-1, "lots", True):
        with pytest.raises(ConfigError, match="memory.context_allowance_mb"):
            ServeConfig(memory_context_allowance_mb=bad).validate()
    with pytest.raises(ConfigError, match="memory.host_proc"):
        ServeConfig(memory_host_proc="host/proc").validate()


# ------------------------------------------------------------ the watcher


def test_the_watcher_reads_trees_in_our_namespace_and_reports_a_lost_device_once(tmp_path):
    host, local = tmp_path / "host", tmp_path / "local"
    write_proc(host, 90017, start=5, nspid=(90017, 17), ns=OURS)
    write_proc(local, 17, ppid=16, pgrp=16, start=5)
    write_proc(local, 16, ppid=1)
    write_proc(local, 1, ppid=0)
    backend = ScriptedGpus(2)
    backend.used_bytes = {90017: 300 * MiB, 90500: 100 * MiB}  # the second is in no namespace of ours
    watcher = MemoryWatcher(backend, 1.0, queue.SimpleQueue(), lambda: None, proc_root=str(local),
                            translator=PidTranslator(str(local), str(host), own_namespace=OURS))
    expected = DeviceReading(0, [ProcessUse(17, (16, 1), 16, 300 * MiB)])
    assert watcher.read_once() == [expected, DeviceReading(1, expected.processes)]
    backend.lost.add(1)
    backend.broken.add(0)  # a read that fails is logged and skipped, not a lost device
    [lost] = watcher.read_once()
    assert isinstance(lost, DeviceLost) and lost.device == 1 and "GPU-1" in lost.message
    assert watcher.read_once() == []  # told once
    backend.lost.clear()
    backend.broken.clear()
    assert watcher.read_once() == [expected, DeviceBack(1), DeviceReading(1, expected.processes)]


@pytest.fixture
def watched_server(workdir):
    servers = []

    def start(**settings) -> tuple[AgentServer, ScriptedGpus, RecordingEvents]:
        config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/mem.sock", state_dir=workdir,
                             memory_watch_ms=20, **settings)
        backend = ScriptedGpus()
        server = AgentServer(config, backend, metrics=Metrics(CollectorRegistry()))
        server.bind()
        events = server._cluster.events = RecordingEvents()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return server, backend, events

    yield start
    for server, thread in servers:
        server.request_stop()
        thread.join(timeout=10)


@pytest.fixture
def grandchild():
    """A process two generations below this one (a torchrun worker below its launcher, say)."""
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(child.stdout.readline())
    yield pid
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    child.kill()
    child.wait()


def _violations(server) -> float:
    return server.metrics.registry.get_sample_value("nodeagent_memory_violations_total",
                                                    {"device": "0", "policy": "warn"}) or 0.0


def test_memory_of_a_descendant_process_counts_against_its_session(watched_server, grandchild):
    server, backend, _ = watched_server()
    with Client("launcher", memory_mb=100, endpoint=server.config.endpoint) as client:
        backend.used_bytes = {grandchild: 250 * MiB}
        wait_for(lambda: _violations(server) == 1)
        [row] = [s for s in server.status().devices[0].sessions if s.id == client.session_id]
        assert row.memory_used_bytes == 250 * MiB


def test_the_context_allowance_keeps_a_small_declaration_from_being_flagged(watched_server):
    server, backend, _ = watched_server(memory_context_allowance_mb=512)
    with Client("small", memory_mb=100, endpoint=server.config.endpoint):
        backend.used_bytes = {os.getpid(): 400 * MiB}  # 100 MiB of tensors and a context
        time.sleep(0.2)
        assert _violations(server) == 0
        backend.used_bytes = {os.getpid(): 700 * MiB}
        wait_for(lambda: _violations(server) == 1)


def test_a_lost_gpu_is_a_health_event_a_revoke_and_an_error_to_its_sessions(watched_server):
    server, backend, events = watched_server()
    with Client("trainer", endpoint=server.config.endpoint) as client:
        client.acquire(timeout=5)
        backend.lost.add(0)
        wait_for(lambda: events.of("health"))
        [lost] = events.of("health")
        assert lost["device_state"] == "lost" and "GPU-0" in lost["reason"]
        with pytest.raises(DaemonError) as info:
            wait_for(lambda: client.yield_point() and False, timeout=2)
        assert info.value.code == ErrorCode.DEVICE and "device 0 has failed" in str(info.value)
        assert not client.holding and client.revocations == 1
        time.sleep(0.1)
        assert len(events.of("health")) == 1  # once, not at every reading
        backend.lost.clear()
        wait_for(lambda: len(events.of("health")) == 2)
        assert events.of("health")[1]["device_state"] == "ok"


def test_a_fault_carries_how_many_processes_outside_mps_had_a_context_now_or_a_pass_ago(tmp_path):
    """NVML does not say which process faulted: the watcher counts the device's compute processes
    that are neither MPS clients nor its server (by command name), in the pass of the fault and the
    one before (a process outside that faulted may have exited in between)."""
    from nodeagent.devices import DeviceFault

    class Faulting(ScriptedGpus):
        def __init__(self) -> None:
            super().__init__(1)
            self.plain: list[int] = []
            self.pending: list[DeviceFault] = []

        def processes(self, index):
            return [DeviceProcess(900, 10 * MiB, mps_client=False)] + \
                [DeviceProcess(pid, MiB, mps_client=False) for pid in self.plain] + super().processes(index)

        def faults(self):
            taken, self.pending = self.pending, []
            return taken

    write_proc(tmp_path, 900)
    (tmp_path / "900" / "comm").write_text("nvidia-cuda-mps\n")  # the server, as the kernel truncates its name
    write_proc(tmp_path, 901)
    (tmp_path / "901" / "comm").write_text("python3\n")
    backend = Faulting()
    backend.used_bytes = {17: MiB}  # an MPS client
    watcher = MemoryWatcher(backend, 1.0, queue.SimpleQueue(), lambda: None, proc_root=str(tmp_path),
                            translator=PidTranslator(str(tmp_path)))
    backend.pending = [DeviceFault(0, 31)]
    assert [r for r in watcher.read_once() if isinstance(r, DeviceFault)] == [DeviceFault(0, 31, outside_mps=0)]
    backend.plain = [901]
    watcher.read_once()
    backend.plain = []  # gone by the pass that reads the fault
    backend.pending = [DeviceFault(0, 43)]
    assert [r for r in watcher.read_once() if isinstance(r, DeviceFault)] == [DeviceFault(0, 43, outside_mps=1)]
