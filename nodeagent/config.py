"""Daemon settings: defaults, overridden by command-line flags."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from client_lib.endpoint import daemon_endpoint
from sharing import SchedulerPolicy, Workload


def default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/nodeagent"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "nodeagent")


class ConfigError(ValueError):
    """A setting with a bad value; the message names the setting."""


@dataclass
class ServeConfig:
    backend: str = "auto"  # auto | cuda | cpu
    cpu_devices: int = 1
    endpoint: str = field(default_factory=daemon_endpoint)
    state_dir: str = field(default_factory=default_state_dir)
    metrics_port: int | None = None  # None: no metrics HTTP server
    metrics_addr: str = "127.0.0.1"
    quantum_ms: dict[str, float] = field(
        default_factory=lambda: {"inference": 50.0, "training": 200.0, "best-effort": 200.0})
    grace_ms: float = 100.0
    heartbeat_ms: float = 1000.0  # clients send a heartbeat at least this often
    heartbeat_misses: int = 3  # a session that sent nothing for this many intervals is lost

    def validate(self) -> None:
        if self.backend not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"backend must be auto, cuda or cpu, got {self.backend!r}")
        if self.cpu_devices < 1:
            raise ConfigError(f"cpu_devices must be >= 1, got {self.cpu_devices}")
        if not (self.endpoint.startswith("ipc://") or self.endpoint.startswith("tcp://")):
            raise ConfigError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {self.endpoint!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        for name, value in (("grace_ms", self.grace_ms), ("heartbeat_ms", self.heartbeat_ms)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if self.heartbeat_misses < 1:
            raise ConfigError(f"heartbeat_misses must be >= 1, got {self.heartbeat_misses}")
        try:
            self.policy()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def policy(self) -> SchedulerPolicy:
        unknown = set(self.quantum_ms) - {w.wire for w in Workload}
        if unknown:
            raise ConfigError(f"quantum_ms has unknown workload(s) {sorted(unknown)}; "
                              "valid: inference, training, best-effort")
        quanta = {Workload.parse(name): float(ms) for name, ms in self.quantum_ms.items()}
        return SchedulerPolicy(quantum_ms=quanta, grace_ms=self.grace_ms)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_ms * self.heartbeat_misses / 1000.0
