"""The Kubernetes device plugin against a fake kubelet (tests/k8s/fake_kubelet.py: a real gRPC
Registration server on a unix socket, which dials the plugin back as the kubelet does) and
a real daemon: registration, the shares and their health as the daemon's devices are lent,
drained, lost or gone, Allocate's answer used by a real client, kubelet restarts, and the
command's start, refusals and SIGTERM. No cluster: what that leaves untested is in
docs/kubernetes.md."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager

import msgspec
import pytest

grpc = pytest.importorskip("grpc", reason="the k8s extra (grpcio) is not installed")

from prometheus_client import CollectorRegistry  # noqa: E402

from client_lib import protocol as p  # noqa: E402
from client_lib import query_status  # noqa: E402
from nodeagent.config import ServeConfig  # noqa: E402
from nodeagent.daemon.server import AgentServer  # noqa: E402
from nodeagent.k8s import shares  # noqa: E402
from nodeagent.k8s.app import DevicePlugin  # noqa: E402
from nodeagent.k8s.plugin import RunnerSettings  # noqa: E402
from nodeagent.k8s.shares import AllocationSettings  # noqa: E402
from nodeagent.k8s.v1beta1 import api_pb2 as api  # noqa: E402
from nodeagent.k8s.watch import EventsSource  # noqa: E402
from nodeagent.metrics import Metrics  # noqa: E402
from tests.conftest import REPO, Daemon, wait_for  # noqa: E402
from tests.k8s.fake_kubelet import FakeKubelet  # noqa: E402
from tests.cluster_nodes import CurvePeer, write_cluster_config  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.scripted_gpus import ScriptedGpus  # noqa: E402

POD_SOCKET_DIR = "/run/nodeagent-in-pod"


def healthy(devices: dict[str, str], uuid: str) -> bool | None:
    """True/False when every share of ``uuid`` is Healthy/Unhealthy, None when mixed or absent."""
    states = {h for i, h in devices.items() if i.startswith(uuid + "::")}
    return None if len(states) != 1 else states == {shares.HEALTHY}


@pytest.fixture
def kubelet_dir(workdir):
    path = os.path.join(workdir, "dp")
    os.mkdir(path)
    return path


@pytest.fixture
def kubelet(kubelet_dir):
    fake = FakeKubelet(kubelet_dir).start()
    yield fake
    fake.stop()


@pytest.fixture
def run_plugin(kubelet_dir):
    """Factory: an in-process plugin for ``endpoint``, running until the test ends."""
    running = []

    def start(endpoint: str, *, shares_per_device: int = 3, poll_interval_s: float = 0.1,
              events: EventsSource | None = None, memory_mb_per_share: int | None = None) -> DevicePlugin:
        socket_dir = os.path.dirname(endpoint[len("ipc://"):])
        plugin = DevicePlugin(
            endpoint=endpoint, poll_interval_s=poll_interval_s, events=events,
            policy=shares.SharePolicy(shares=shares_per_device, memory_mb_per_share=memory_mb_per_share),
            allocation=AllocationSettings(endpoint=f"ipc://{POD_SOCKET_DIR}/{os.path.basename(endpoint)}",
                                          host_socket_dir=socket_dir, container_socket_dir=POD_SOCKET_DIR),
            runner=RunnerSettings(kubelet_dir=kubelet_dir, resource_name="nodeagent.io/gpu"))
        plugin.start()
        thread = threading.Thread(target=plugin.run, daemon=True)
        thread.start()
        running.append((plugin, thread))
        return plugin

    yield start
    for plugin, thread in running:
        plugin.request_stop()
        thread.join(timeout=15)
        plugin.close()
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def shared_daemon():
    """One `nodeagent serve --backend cpu --cpu-devices 2` for the tests that change nothing in it
    (a daemon takes seconds to start on a small machine)."""
    path = tempfile.mkdtemp(prefix="na-")
    daemon = Daemon(path, ["--cpu-devices", "2"]).start()
    yield daemon
    code = daemon.stop()
    shutil.rmtree(path, ignore_errors=True)
    assert code == 0, daemon.log()


@pytest.fixture
def cluster_daemon(start_daemon, workdir):
    """A `nodeagent serve --backend cpu --cpu-devices 2` with its cluster endpoint and events on."""
    node = write_cluster_config(workdir, health_interval_s=0.05)  # a health event every 50 ms: a cue
    node.daemon = start_daemon("--cpu-devices", "2")
    return node


def events_of(node) -> EventsSource:
    return EventsSource(node.events, node.client_secret, os.path.join(node.keys_dir, "server.key"))


# ------------------------------------------------------------------ registration and the list


def test_registers_and_lists_every_device_as_healthy_shares(kubelet, run_plugin, shared_daemon, caplog):
    caplog.set_level(logging.INFO, logger="nodeagent.k8s")
    daemon = shared_daemon
    plugin = run_plugin(daemon.endpoint, shares_per_device=3)
    reg = kubelet.wait_registrations(1)
    assert (reg.version, reg.endpoint, reg.resource_name) == ("v1beta1", "nodeagent.sock", "nodeagent.io/gpu")
    assert reg.options.get_preferred_allocation_available and not reg.options.pre_start_required
    devices = kubelet.wait_list(lambda d: len(d) == 6)
    uuids = [d.uuid for d in daemon.status().devices]
    assert devices == {f"{u}::{n}": "Healthy" for u in uuids for n in range(3)}
    assert reg.plugin_options == reg.options  # what GetDevicePluginOptions says agrees with the registration
    assert plugin.service.streams == 1
    for index, uuid in enumerate(uuids):  # each device's health is logged as the policy words it
        assert f"[k8s] device={index} uuid={uuid} shares Healthy" in caplog.text
    assert kubelet.plugin().PreStartContainer(api.PreStartContainerRequest(devices_ids=[f"{uuids[0]}::0"]),
                                              timeout=5) == api.PreStartContainerResponse()


def test_allocate_gives_what_a_client_needs_to_join_its_device(kubelet, run_plugin, shared_daemon):
    daemon = shared_daemon
    run_plugin(daemon.endpoint, shares_per_device=4)
    kubelet.wait_registrations(1)
    status = daemon.status()
    dev1 = status.devices[1]
    stub = kubelet.plugin()
    wanted = [f"{dev1.uuid}::2", f"{dev1.uuid}::3"]
    answer = stub.Allocate(api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
        devices_ids=wanted)]), timeout=5)
    [container] = answer.container_responses
    envs = dict(container.envs)
    memory_mb = 2 * (dev1.memory_capacity_mb // 4)
    assert envs == {
        "NODEAGENT_ENDPOINT": f"ipc://{POD_SOCKET_DIR}/agent.sock",
        "CUDA_VISIBLE_DEVICES": dev1.uuid,
        "NODEAGENT_DEVICE": "1",
        "NODEAGENT_DEVICE_UUID": dev1.uuid,
        "NODEAGENT_SHARES": "2",
        "NODEAGENT_MEMORY_MB": str(memory_mb),
    }  # a cpu daemon's devices: no NVIDIA_VISIBLE_DEVICES, no CDI names
    assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == \
        [(POD_SOCKET_DIR, daemon.workdir, True)]
    assert not container.cdi_devices and not container.devices

    # An unmodified Client in a process with exactly that environment (the mount stands in for
    # by pointing the endpoint at the host's directory) reaches the daemon; given the device and
    # memory the environment names, it is admitted there with that declaration.
    env = dict(os.environ, **envs)
    env["NODEAGENT_ENDPOINT"] = envs["NODEAGENT_ENDPOINT"].replace(POD_SOCKET_DIR, daemon.workdir)
    code = ("import os, sys\nfrom client_lib import Client\n"
            "c = Client('pod', device=int(os.environ['NODEAGENT_DEVICE']), "
            "memory_mb=int(os.environ['NODEAGENT_MEMORY_MB']))\n"
            "print(c.device, c.device_uuid, flush=True)\nsys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().split() == ["1", dev1.uuid]
        on_dev1 = daemon.status().devices[1]
        assert [(s.name, s.memory_mb) for s in on_dev1.sessions] == [("pod", memory_mb)]
    finally:
        child.stdin.close()
        child.wait(timeout=10)

    with pytest.raises(grpc.RpcError) as refused:
        stub.Allocate(api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
            devices_ids=["GPU-not-here::0"])]), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "GPU-not-here::0 is not a device the daemon reports" in refused.value.details()


def test_preferred_allocation_keeps_a_container_on_one_device(kubelet, run_plugin, shared_daemon):
    daemon = shared_daemon
    run_plugin(daemon.endpoint, shares_per_device=3)
    kubelet.wait_registrations(1)
    a, b = (d.uuid for d in daemon.status().devices)
    available = [f"{a}::0", f"{b}::0", f"{b}::1", f"{b}::2", f"{a}::1"]
    answer = kubelet.plugin().GetPreferredAllocation(api.PreferredAllocationRequest(container_requests=[
        api.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=2),
        api.ContainerPreferredAllocationRequest(available_deviceIDs=available, must_include_deviceIDs=[f"{a}::1"],
                                                allocation_size=2)]), timeout=5)
    first, second = (list(r.deviceIDs) for r in answer.container_responses)
    assert first == [f"{b}::0", f"{b}::1"]  # the device with the most shares free
    assert second == [f"{a}::1", f"{a}::0"]  # beside the share it must have


# ------------------------------------------------------------------ health follows the daemon


def test_lent_and_draining_devices_are_unhealthy_at_once_through_events(kubelet, run_plugin, cluster_daemon):
    node = cluster_daemon
    # A poll every 30 s: each change below reaches the kubelet by the daemon's events.
    plugin = run_plugin(node.daemon.endpoint, poll_interval_s=30.0, events=events_of(node))
    kubelet.wait_registrations(1)
    a, b = (d.uuid for d in node.daemon.status().devices)
    kubelet.wait_list(lambda d: healthy(d, a) and healthy(d, b))
    wait_for(lambda: plugin.watcher.events_seen, timeout=10)  # subscribed: the periodic health events arrive
    peer = node.peer()
    try:
        assert peer.call(p.Lend(id=0, device=1, borrower="job-a")).state == "LENT"
        kubelet.wait_list(lambda d: healthy(d, a) is True and healthy(d, b) is False, timeout=5)
        seen = kubelet.lists_seen()
        reply = peer.call(p.Reclaim(id=0, device=1, deadline_ms=1000))
        assert reply.state == "PROTECT"  # back for inference: healthy again
        kubelet.wait_list(lambda d: healthy(d, a) is True and healthy(d, b) is True, after=seen, timeout=5)
        assert isinstance(peer.call(p.Drain(id=0, device=0)), p.LifecycleReply)
        kubelet.wait_list(lambda d: healthy(d, a) is False and healthy(d, b) is True, timeout=5)
    finally:
        peer.close()
    assert plugin.watcher.polls < 20  # woken by events, not by the interval


def test_a_daemon_that_goes_makes_every_share_unhealthy_until_it_is_back(kubelet, run_plugin, start_daemon):
    daemon = start_daemon("--cpu-devices", "2")
    run_plugin(daemon.endpoint, shares_per_device=2, poll_interval_s=0.05)
    kubelet.wait_registrations(1)
    a, b = (d.uuid for d in daemon.status().devices)
    kubelet.wait_list(lambda d: healthy(d, a) and healthy(d, b))
    assert daemon.stop() == 0
    gone = kubelet.wait_list(lambda d: healthy(d, a) is False and healthy(d, b) is False)
    assert len(gone) == 4  # kept, not withdrawn: the kubelet leaves running pods alone
    seen = kubelet.lists_seen()
    daemon.start()
    kubelet.wait_list(lambda d: healthy(d, a) and healthy(d, b), after=seen)


@pytest.fixture
def lossy_daemon(workdir):
    """An in-process daemon on two scripted GPUs (their NVML failures scripted) with its cluster
    endpoint and events on: (endpoint, backend, events source)."""
    node = write_cluster_config(workdir)  # keys; its nodeagent.toml is not read here
    config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/lost.sock", state_dir=workdir,
                         memory_watch_ms=20, ctxpool_enabled="off", enforce="revoke",
                         cluster_endpoint=f"tcp://127.0.0.1:{free_port()}", cluster_events_endpoint=node.events,
                         cluster_keys_dir=node.keys_dir, cluster_node="n1", cluster_health_interval_s=0.05)
    backend = ScriptedGpus(2)
    server = AgentServer(config, backend, metrics=Metrics(CollectorRegistry()))
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield config.endpoint, backend, events_of(node)
    server.request_stop()
    thread.join(timeout=10)


def test_a_lost_device_is_unhealthy_and_refused_until_it_answers_again(kubelet, run_plugin, lossy_daemon):
    endpoint, backend, events = lossy_daemon
    plugin = run_plugin(endpoint, shares_per_device=2, poll_interval_s=30.0, events=events)
    kubelet.wait_registrations(1)
    a, b = (d.uuid for d in query_status(endpoint).devices)
    kubelet.wait_list(lambda d: healthy(d, a) and healthy(d, b))
    wait_for(lambda: plugin.watcher.events_seen, timeout=10)  # subscribed: the periodic health events arrive
    backend.lost.add(0)
    kubelet.wait_list(lambda d: healthy(d, a) is False and healthy(d, b) is True, timeout=5)
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.plugin().Allocate(api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
            devices_ids=[f"{a}::0"])]), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "is lost" in refused.value.details()
    seen = kubelet.lists_seen()
    backend.lost.clear()
    kubelet.wait_list(lambda d: healthy(d, a) is True and healthy(d, b) is True, after=seen, timeout=5)


# ------------------------------------------------------------------ the kubelet restarts


def test_the_plugin_waits_for_the_kubelet_and_registers_again_after_each_restart(kubelet_dir, run_plugin,
                                                                                  shared_daemon):
    daemon = shared_daemon
    plugin = run_plugin(daemon.endpoint, shares_per_device=2)
    fake = FakeKubelet(kubelet_dir)
    try:
        assert not os.path.exists(os.path.join(kubelet_dir, "nodeagent.sock"))  # no kubelet yet: not serving
        fake.start()
        first = fake.wait_registrations(1)
        fake.wait_list(lambda d: len(d) == 4, registration=first)
        for count in (2, 3):
            fake.restart()  # removes nodeagent.sock and makes kubelet.sock anew
            again = fake.wait_registrations(count)
            assert again.endpoint == "nodeagent.sock"
            fake.wait_list(lambda d: len(d) == 4, registration=again)
        assert plugin.runner.registrations == 3
        # Our own socket removed while the kubelet stays: served and registered again.
        os.unlink(os.path.join(kubelet_dir, "nodeagent.sock"))
        fake.wait_registrations(4, timeout=15)
    finally:
        fake.stop()


# ------------------------------------------------------------------ the command


def _plugin_command(kubelet_dir: str, endpoint: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "k8s-device-plugin", "--kubelet-dir", kubelet_dir,
         "--endpoint", endpoint, "--shares", "2", "--poll-interval-s", "0.2", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_command_registers_and_stops_cleanly_on_sigterm(kubelet, kubelet_dir, shared_daemon):
    daemon = shared_daemon
    proc = _plugin_command(kubelet_dir, daemon.endpoint, "--resource-name", "example.com/gpu-share")
    try:
        reg = kubelet.wait_registrations(1, timeout=20)
        assert reg.resource_name == "example.com/gpu-share"
        kubelet.wait_list(lambda d: len(d) == 4)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "[k8s] registered resource=example.com/gpu-share" in err and "[k8s] stopped reason=SIGTERM" in err
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(kubelet_dir, "nodeagent.sock"))
    wait_for(lambda: kubelet.registrations[-1].stream_ended)


def test_a_refused_registration_is_one_line_and_tried_again(kubelet_dir, shared_daemon):
    daemon = shared_daemon
    fake = FakeKubelet(kubelet_dir, refuse="resource name nodeagent.io/gpu is taken").start()
    proc = _plugin_command(kubelet_dir, daemon.endpoint)
    try:
        lines: list[str] = []
        wait_for(lambda: lines.append(proc.stderr.readline()) or "registration failed" in lines[-1], timeout=20)
        fake.refuse = None  # the next try (after a second) is accepted
        fake.wait_registrations(1, timeout=10)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        fake.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    failed = next(line for line in lines if "registration failed" in line)
    assert "refused nodeagent.io/gpu: INVALID_ARGUMENT: resource name nodeagent.io/gpu is taken" in failed
    assert "trying again in 1 s" in failed
    assert proc.returncode == 0 and "Traceback" not in "".join(lines) + err


@pytest.mark.parametrize("args, message", [
    (("--events", "tcp://127.0.0.1:7411"), "--events, --events-client-key and --events-server-key go together"),
    (("--endpoint", "tcp://127.0.0.1:7000"), "must be ipc://PATH"),
    (("--resource-name", "gpu"), "expected DOMAIN/NAME"),
    (("--resource-name", "kubernetes.io/gpu"), "Kubernetes' own domain"),
    (("--shares", "0"), "must be 1..1000"),
    (("--socket-name", "kubelet.sock"), "not kubelet.sock"),
    (("--memory-mb-per-share", "lots"), "expected auto or a number of MiB"),
    (("--poll-interval-s", "100"), "--poll-interval-s must be 0.05..60"),
    (("--poll-interval-s", "nan"), "--poll-interval-s: must be a positive number, got 'nan'"),
    (("--shar", "2"), "unrecognized arguments: --shar"),  # no abbreviations
])
def test_bad_settings_are_one_line_and_exit_2(workdir, args, message):
    command = [sys.executable, "-m", "nodeagent", "k8s-device-plugin", "--kubelet-dir", workdir,
               "--endpoint", f"ipc://{workdir}/agent.sock", *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr


def test_a_key_file_that_does_not_load_is_named(workdir, kubelet_dir):
    done = subprocess.run(
        [sys.executable, "-m", "nodeagent", "k8s-device-plugin", "--kubelet-dir", kubelet_dir,
         "--endpoint", f"ipc://{workdir}/agent.sock", "--events", "tcp://127.0.0.1:1",
         "--events-client-key", f"{workdir}/missing.key_secret", "--events-server-key", f"{workdir}/server.key"],
        cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and f"{workdir}/missing.key_secret: cannot load client keys" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_socket_another_process_serves_is_left_alone(kubelet, kubelet_dir, shared_daemon):
    daemon = shared_daemon
    first = _plugin_command(kubelet_dir, daemon.endpoint)
    try:
        kubelet.wait_registrations(1, timeout=20)
        second = subprocess.run(
            [sys.executable, "-m", "nodeagent", "k8s-device-plugin", "--kubelet-dir", kubelet_dir,
             "--endpoint", daemon.endpoint], cwd=REPO, capture_output=True, text=True, timeout=30)
        assert second.returncode == 1
        assert "another process serves" in second.stderr and "Traceback" not in second.stderr
        assert len(kubelet.registrations) == 1 and not kubelet.registrations[0].stream_ended
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=15)
    assert first.returncode == 0


class ScriptedDaemon:
    """A local socket that answers status and inventory as a real daemon on two cpu devices
    would, or, once ``refuse`` is set, every request with an error reply (a busy or buggy daemon)."""

    def __init__(self, workdir: str) -> None:
        import socket as socket_module
        from nodeagent.devices import CpuBackend
        config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/scripted.sock", state_dir=workdir)
        server = AgentServer(config, CpuBackend(2), metrics=Metrics(CollectorRegistry()))
        now = server._clock()
        self.status = server.status()
        self.inventory = server._cluster.inventory_of(self.status, server._cluster.lifecycle_facts(now), now, 0)
        self.endpoint = config.endpoint
        self.refuse = threading.Event()
        self.refused = 0
        self._conns: list = []
        self._listener = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
        self._listener.bind(config.endpoint[len("ipc://"):])
        self._listener.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed: the daemon is gone
            self._conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        from client_lib import codec, framing
        buffer = framing.FrameBuffer(p.MAX_REQUEST_BYTES)
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                for body in buffer.feed(data):
                    msg = codec.decode_request(body)
                    if self.refuse.is_set():
                        self.refused += 1
                        reply = p.Error(id=msg.id, code=p.ErrorCode.UNAVAILABLE, message="busy")
                    elif isinstance(msg, p.StatusRequest):
                        reply = msgspec.structs.replace(self.status, id=msg.id)
                    else:
                        reply = msgspec.structs.replace(self.inventory, id=msg.id)
                    conn.sendall(framing.pack(codec.encode(reply)))
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        import socket as socket_module
        self._listener.close()
        self._thread.join(5)
        for conn in self._conns:
            try:
                conn.shutdown(socket_module.SHUT_RDWR)
            except OSError:
                pass


def test_a_daemon_that_answers_with_errors_keeps_its_shares_healthy(kubelet, run_plugin, workdir):
    """Issue 32 item 5: the plugin read any error reply as "daemon gone" and marked every share
    Unhealthy while a status flood made the daemon refuse it; an answer is not an absence."""
    daemon = ScriptedDaemon(workdir)
    try:
        run_plugin(daemon.endpoint, shares_per_device=2, poll_interval_s=0.05)
        kubelet.wait_registrations(1)
        a, b = (d.uuid for d in daemon.status.devices)
        kubelet.wait_list(lambda d: healthy(d, a) and healthy(d, b))
        seen = kubelet.lists_seen()
        daemon.refuse.set()
        wait_for(lambda: daemon.refused >= 5)  # five polls refused
        lists = kubelet.registrations[-1].lists[seen:]
        assert all(healthy(d, a) and healthy(d, b) for d in lists), lists
    finally:
        daemon.close()
    kubelet.wait_list(lambda d: healthy(d, a) is False and healthy(d, b) is False)  # gone is gone


def test_held_list_and_watch_streams_cannot_starve_allocate(kubelet, run_plugin, shared_daemon):
    """Issue 32 item 12: each ListAndWatch stream holds one of the plugin's 8 gRPC threads for
    its life; seven held open made the kubelet's Allocate time out. A new stream past
    MAX_STREAMS ends the oldest, so threads are always left for Allocate."""
    from nodeagent.k8s import plugin as plugin_module
    daemon = shared_daemon
    plugin = run_plugin(daemon.endpoint, shares_per_device=2)
    kubelet.wait_registrations(1)
    uuid = daemon.status().devices[0].uuid
    held = []
    for _ in range(plugin_module.MAX_WORKERS + 4):  # more than every thread the server has
        stream = kubelet.plugin().ListAndWatch(api.Empty(), timeout=60)
        held.append(stream)
    wait_for(lambda: plugin.service.streams >= 2, timeout=10)  # they are being served
    answer = kubelet.plugin().Allocate(api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
        devices_ids=[f"{uuid}::0"])]), timeout=5)
    assert dict(answer.container_responses[0].envs)["NODEAGENT_DEVICE_UUID"] == uuid
    limit = plugin_module.MAX_STREAMS
    wait_for(lambda: plugin.service.streams <= limit, timeout=5)  # a superseded stream's thread ends on its own turn
    for stream in held[-limit:]:
        assert next(stream).devices  # the newest are served
    for stream in held:
        stream.cancel()
