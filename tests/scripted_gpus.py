"""The cpu backend with device memory and failures scripted as NVML reports them on cuda, and an
in-process daemon on it whose published events are recorded."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from nodeagent.config import ServeConfig
from nodeagent.daemon.server import AgentServer
from nodeagent.devices import CpuBackend, DeviceError, DeviceLostError, DeviceProcess
from nodeagent.metrics import Metrics


class ScriptedGpus(CpuBackend):
    """The cpu backend with per-process device memory and failures scripted (what NVML reports on cuda)."""

    measures_process_memory = True
    name = "cpu"

    def __init__(self, count: int = 1) -> None:
        super().__init__(count)
        self.used_bytes: dict[int, int | None] = {}
        self.lost: set[int] = set()
        self.broken: set[int] = set()

    def processes(self, index: int) -> list[DeviceProcess]:
        if index in self.lost:
            raise DeviceLostError(index, f"GPU-{index}", "nvmlDeviceGetComputeRunningProcesses failed: GPU is lost")
        if index in self.broken:
            raise DeviceError("cuda backend: nvmlDeviceGetComputeRunningProcesses failed: unknown error")
        return [DeviceProcess(pid, used, mps_client=True) for pid, used in self.used_bytes.items()]


@contextmanager
def scripted_daemon(config: ServeConfig, backend):
    """An in-process daemon on ``backend`` (scripted GPUs), its events recorded: (server, events,
    connect), where ``connect()`` opens a raw peer to it (all closed at the end)."""
    from tests.rawpeer import RawPeer

    server = AgentServer(config, backend, metrics=Metrics(CollectorRegistry()))
    server.bind()
    events = server._cluster.events = RecordingEvents()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    peers: list = []

    def connect():
        peers.append(RawPeer(config.endpoint))
        return peers[-1]

    try:
        yield server, events, connect
    finally:
        for peer in peers:
            peer.close()
        server.request_stop()
        thread.join(timeout=10)


class RecordingEvents:
    """Stands in for the events publisher: keeps what the daemon publishes."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int | None, dict]] = []

    def publish(self, kind: str, device: int | None = None, session: str | None = None, **data) -> None:
        self.events.append((kind, device, data))

    def wanted(self, kind: str) -> bool:
        return True

    def of(self, kind: str) -> list[dict]:
        return [data for k, _, data in self.events if k == kind]
