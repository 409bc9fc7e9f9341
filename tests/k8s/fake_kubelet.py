"""A kubelet's device manager, as much of it as a device plugin meets, for tests: the
``Registration`` gRPC service on ``<dir>/kubelet.sock`` (a real server on a unix socket),
which on each registration dials the plugin's socket in the same directory, asks for its
options and keeps a ``ListAndWatch`` stream open, recording every device list it gets.
:meth:`FakeKubelet.restart` does what a restarted kubelet does to the directory: its
socket goes, every plugin socket is removed, and a new ``kubelet.sock`` appears."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import grpc
from concurrent import futures

from nodeagent.k8s.v1beta1 import api_pb2 as api
from nodeagent.k8s.v1beta1 import api_grpc


@dataclass
class Registration:
    version: str
    endpoint: str
    resource_name: str
    options: api.DevicePluginOptions
    plugin_options: api.DevicePluginOptions | None = None  # what GetDevicePluginOptions answered
    lists: list[dict[str, str]] = field(default_factory=list)  # every ListAndWatch answer: id -> health
    stream_ended: bool = False


class FakeKubelet:
    def __init__(self, directory: str, refuse: str | None = None) -> None:
        self.directory = directory
        self.socket = os.path.join(directory, "kubelet.sock")
        self.refuse = refuse  # a message: refuse every registration with it
        self.registrations: list[Registration] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._channels: list[grpc.Channel] = []

    # ------------------------------------------------------------ life

    def start(self) -> FakeKubelet:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_grpc.add_servicer(server, "Registration", self)
        if not server.add_insecure_port(f"unix:{self.socket}"):
            raise RuntimeError(f"cannot bind {self.socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None).wait(5)
            self._server = None
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass

    def restart(self) -> None:
        """As a kubelet restart: the old socket and every plugin's socket removed, a new kubelet.sock."""
        self.stop()
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if not os.path.isdir(path):
                os.unlink(path)
        self.start()

    # ------------------------------------------------------------ Registration

    def Register(self, request, context):
        if self.refuse is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)
        reg = Registration(request.version, request.endpoint, request.resource_name, request.options)
        with self._cond:
            self.registrations.append(reg)
            self._cond.notify_all()
        # The kubelet dials the plugin after answering; so do we, from a thread of our own.
        threading.Thread(target=self._watch, args=(reg,), daemon=True).start()
        return api.Empty()

    def _watch(self, reg: Registration) -> None:
        channel = grpc.insecure_channel(f"unix:{os.path.join(self.directory, reg.endpoint)}")
        self._channels.append(channel)
        stub = api_grpc.Stub(channel, "DevicePlugin")
        try:
            reg.plugin_options = stub.GetDevicePluginOptions(api.Empty(), timeout=5)
            for answer in stub.ListAndWatch(api.Empty()):
                with self._cond:
                    reg.lists.append({d.ID: d.health for d in answer.devices})
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        except ValueError:  # "Cannot invoke RPC: Channel closed!": the kubelet restarted (stop()) meanwhile
            pass
        finally:
            with self._cond:
                reg.stream_ended = True
                self._cond.notify_all()

    # ------------------------------------------------------------ what tests ask

    def lists_seen(self) -> int:
        """Lists the latest registration's stream has brought so far (for ``wait_list(after=...)``)."""
        with self._cond:
            return len(self.registrations[-1].lists) if self.registrations else 0

    def wait_registrations(self, count: int, timeout: float = 10.0) -> Registration:
        """The ``count``-th registration, once it came."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.registrations) >= count, timeout):
                raise AssertionError(f"{len(self.registrations)} registrations within {timeout} s, wanted {count}")
            return self.registrations[count - 1]

    def wait_list(self, predicate, registration: Registration | None = None, timeout: float = 10.0,
                  after: int = 0) -> dict[str, str]:
        """The first device list (id -> health) on the latest (or the given) registration's stream
        that satisfies ``predicate``, from its ``after``-th list on."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                reg = registration or (self.registrations[-1] if self.registrations else None)
                if reg is not None:
                    for devices in reg.lists[after:]:
                        if predicate(devices):
                            return devices
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = reg.lists if reg is not None else []
                    raise AssertionError(f"no device list as wanted within {timeout} s; got {seen}")
                self._cond.wait(left)

    def plugin(self, registration: Registration | None = None) -> api_grpc.Stub:
        reg = registration or self.registrations[-1]
        channel = grpc.insecure_channel(f"unix:{os.path.join(self.directory, reg.endpoint)}")
        self._channels.append(channel)
        return api_grpc.Stub(channel, "DevicePlugin")
