"""The kubelet-facing half of the device plugin: the ``DevicePlugin`` gRPC service
(:class:`DevicePluginService`) on our socket (:class:`PluginServer`), registration, and
:class:`PluginRunner`, which serves and registers again when ``kubelet.sock`` is made anew
or our socket goes (docs/kubernetes.md, Restarts). What to advertise comes from a
:class:`~nodeagent.k8s.watch.ViewBoard`; the decisions are :mod:`nodeagent.k8s.shares`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from nodeagent.k8s import shares
from nodeagent.k8s.dirwatch import IN_CREATE, IN_MOVED_TO, DirWatch
from nodeagent.k8s.v1beta1 import api_pb2 as api
from nodeagent.k8s.v1beta1 import api_grpc
from nodeagent.k8s.watch import ViewBoard

log = logging.getLogger("nodeagent.k8s")

API_VERSION = "v1beta1"
KUBELET_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
STREAM_CHECK_S = 1.0  # how often an idle ListAndWatch stream looks whether its kubelet is still there
MAX_WORKERS = 8  # gRPC threads: a ListAndWatch stream holds one for its life
# ListAndWatch streams at once; a new one past it ends the oldest (a kubelet that restarted
# dials anew, and the newest is the one that matters), so MAX_WORKERS - MAX_STREAMS threads
# are always there for Allocate and the other calls, however many streams are held open.
MAX_STREAMS = 2
MAX_CONCURRENT_RPCS = 16  # past this the server answers RESOURCE_EXHAUSTED
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
BACKOFF_S = (1.0, 30.0)  # first and longest wait before registering again after a refusal
OPTIONS = api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


class PluginError(Exception):
    """The plugin cannot serve (its socket is in use, the path is not usable): one line, no traceback."""


class RegistrationError(Exception):
    """The kubelet refused the registration or did not answer."""


class DevicePluginService:
    """The gRPC methods the kubelet calls. Reads the board; changes nothing outside itself."""

    def __init__(self, board: ViewBoard, policy: shares.SharePolicy, allocation: shares.AllocationSettings,
                 stopping: threading.Event) -> None:
        self._board = board
        self._policy = policy
        self._allocation = allocation
        self._stopping = stopping
        self._lock = threading.Lock()
        self._open_streams: list[threading.Event] = []  # oldest first; set: that stream is to end
        self.streams = 0  # ListAndWatch streams open now

    def GetDevicePluginOptions(self, request, context):
        return OPTIONS

    def ListAndWatch(self, request, context):
        """The device list now, then again each time it changes, until the kubelet goes, we
        stop, or ``MAX_STREAMS`` newer streams came (the oldest ends: each holds a thread)."""
        ended = threading.Event()
        with self._lock:
            self._open_streams.append(ended)
            self.streams += 1
            while len(self._open_streams) > MAX_STREAMS:
                self._open_streams.pop(0).set()
        self._board.wake()  # a superseded stream waiting for a newer view ends now
        try:
            view, version = self._board.current()
            sent: list[shares.ShareDevice] | None = None
            while True:
                devices = self._policy.devices(view)
                if devices != sent:
                    yield api.ListAndWatchResponse(devices=[api.Device(ID=d.id, health=d.health) for d in devices])
                    sent = devices
                if ended.is_set() or self._stopping.is_set() or self._board.closed or not context.is_active():
                    if ended.is_set():
                        log.info("[k8s] a ListAndWatch stream ended: newer ones came (at most %d at once)",
                                 MAX_STREAMS)
                    return
                view, version = self._board.wait_newer(version, STREAM_CHECK_S, unless=ended.is_set)
        finally:
            with self._lock:
                self.streams -= 1
                if ended in self._open_streams:
                    self._open_streams.remove(ended)

    def GetPreferredAllocation(self, request, context):
        return api.PreferredAllocationResponse(container_responses=[
            api.ContainerPreferredAllocationResponse(deviceIDs=shares.preferred(
                list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size))
            for req in request.container_requests])

    def Allocate(self, request, context):
        view, _ = self._board.current()
        answers = []
        for req in request.container_requests:
            ids = list(req.devices_ids)
            try:
                got = shares.allocate(ids, view, self._policy, self._allocation)
            except shares.AllocationError as exc:
                log.warning("[k8s] allocate refused devices=%s: %s", ",".join(ids), exc)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            answers.append(api.ContainerAllocateResponse(
                envs=got.envs,
                mounts=[api.Mount(container_path=c, host_path=h, read_only=ro) for c, h, ro in got.mounts],
                cdi_devices=[api.CDIDevice(name=name) for name in got.cdi_devices]))
            log.info("[k8s] allocate devices=%s device=%s memory_mb=%s", ",".join(ids),
                     got.envs["NODEAGENT_DEVICE"], got.envs["NODEAGENT_MEMORY_MB"])
        return api.AllocateResponse(container_responses=answers)

    def PreStartContainer(self, request, context):
        return api.PreStartContainerResponse()  # not asked for (pre_start_required is false)


def _identity(path: str) -> tuple[int, int, int] | None:
    """(device, inode, change time) of ``path``, or None if there is nothing there: a socket made
    anew differs even where its inode number is reused."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


class PluginServer:
    """The DevicePlugin service on a unix socket at ``path`` (a file in the kubelet's directory)."""

    def __init__(self, service: DevicePluginService, path: str) -> None:
        self.service = service
        self.path = path
        self._server: grpc.Server | None = None
        self.identity: tuple[int, int, int] | None = None

    def start(self) -> None:
        """Serve on a fresh socket. PluginError if another process serves ``path``."""
        self._clear_stale()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="k8s-grpc"),
                             maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                             options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        api_grpc.add_servicer(server, "DevicePlugin", self.service)
        detail = "the address could not be bound"
        try:
            bound = server.add_insecure_port(f"unix:{self.path}")
        except RuntimeError as exc:
            bound, detail = 0, str(exc)
        if not bound:
            server.stop(None)
            raise PluginError(f"cannot serve on {self.path}: {detail}")
        server.start()
        self._server = server
        self.identity = _identity(self.path)

    def _clear_stale(self) -> None:
        if not os.path.lexists(self.path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except OSError:
            pass  # nobody there: a socket left by an earlier run
        else:
            raise PluginError(f"another process serves {self.path}: is a second device plugin running? "
                              "(change --socket-name to run two)")
        finally:
            probe.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise PluginError(f"cannot remove the old socket {self.path}: {exc.strerror}") from None

    def alive(self) -> bool:
        """True while serving and our socket is still the file at ``path`` (a kubelet restart removes it)."""
        return self._server is not None and self.identity is not None and _identity(self.path) == self.identity

    def stop(self, grace_s: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.stop(grace_s).wait(grace_s + 1.0)
        if self.identity is not None and _identity(self.path) == self.identity:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.identity = None


def register(kubelet_socket: str, endpoint_name: str, resource_name: str, timeout_s: float) -> None:
    """Register with the kubelet at ``kubelet_socket``; RegistrationError saying why not."""
    request = api.RegisterRequest(version=API_VERSION, endpoint=endpoint_name, resource_name=resource_name,
                                  options=OPTIONS)
    with grpc.insecure_channel(f"unix:{kubelet_socket}") as channel:
        try:
            api_grpc.Stub(channel, "Registration").Register(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            details = exc.details() or ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise RegistrationError(f"no answer from the kubelet at {kubelet_socket} within {timeout_s:g} s "
                                        f"({code.name}: {details.splitlines()[0] if details else '-'})") from None
            raise RegistrationError(f"the kubelet at {kubelet_socket} refused {resource_name}: "
                                    f"{code.name}: {details}") from None


@dataclass(frozen=True)
class RunnerSettings:
    kubelet_dir: str = KUBELET_DIR
    socket_name: str = "nodeagent.sock"
    resource_name: str = "nodeagent.io/gpu"
    register_timeout_s: float = 5.0
    check_interval_s: float = 5.0  # with inotify: a safety net; without it, how often the directory is looked at


class PluginRunner:
    """Keeps the plugin served and registered with whichever kubelet is there, until ``stop``."""

    def __init__(self, settings: RunnerSettings, service: DevicePluginService) -> None:
        self.settings = settings
        self.server = PluginServer(service, os.path.join(settings.kubelet_dir, settings.socket_name))
        self.kubelet_socket = os.path.join(settings.kubelet_dir, KUBELET_SOCKET)
        self.registrations = 0  # registrations the kubelet accepted (tests read it)
        self._registered_with: tuple[int, int, int] | None = None  # the kubelet.sock we registered with
        self._next_try = 0.0
        self._backoff_s = BACKOFF_S[0]
        self._waiting_logged = False

    def run(self, stop: threading.Event, wake_fd: int | None = None) -> None:
        """Until ``stop`` is set (``wake_fd`` readable wakes the wait at once). PluginError when our
        socket cannot be served at all."""
        watch = DirWatch(self.settings.kubelet_dir)
        try:
            while not stop.is_set():
                self._step(time.monotonic())
                self._wait(watch, wake_fd, stop)
        finally:
            watch.close()

    def _step(self, now: float) -> None:
        kubelet = _identity(self.kubelet_socket)
        if kubelet is None:
            if self._registered_with is not None or not self._waiting_logged:
                log.info("[k8s] waiting for the kubelet: no %s", self.kubelet_socket)
                self._waiting_logged = True
            self._registered_with = None
            return
        self._waiting_logged = False
        fresh = kubelet != self._registered_with
        if not fresh and self.server.alive():
            return
        if now < self._next_try:
            return
        if self._registered_with is not None:
            why = "kubelet.sock was made anew (a kubelet restart)" if fresh else f"{self.server.path} went away"
            log.info("[k8s] serving and registering again: %s", why)
        self.server.stop()
        self.server.start()  # PluginError ends the run: nothing here would fix it
        try:
            register(self.kubelet_socket, self.settings.socket_name, self.settings.resource_name,
                     self.settings.register_timeout_s)
        except RegistrationError as exc:
            self._registered_with = None
            self._next_try = time.monotonic() + self._backoff_s
            log.warning("[k8s] registration failed: %s; trying again in %.0f s", exc, self._backoff_s)
            self._backoff_s = min(self._backoff_s * 2, BACKOFF_S[1])
            return
        self._registered_with = kubelet
        self._backoff_s = BACKOFF_S[0]
        self.registrations += 1
        log.info("[k8s] registered resource=%s endpoint=%s kubelet=%s", self.settings.resource_name,
                 self.server.path, self.kubelet_socket)

    def _wait(self, watch: DirWatch, wake_fd: int | None, stop: threading.Event) -> None:
        watching = watch.ensure()
        timeout = self.settings.check_interval_s if watching else min(self.settings.check_interval_s, 1.0)
        if self._registered_with is None and self._next_try > time.monotonic():
            timeout = min(timeout, self._next_try - time.monotonic())
        fds = [fd for fd in (watch.fileno(), wake_fd) if fd is not None]
        if stop.is_set():
            return
        try:  # a signal does not end it (PEP 475 retries it): request_stop writes to wake_fd
            ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise
            return
        if watch.fileno() is not None and watch.fileno() in ready:
            for mask, name in watch.read():
                if name == KUBELET_SOCKET and mask & (IN_CREATE | IN_MOVED_TO):
                    self._next_try = 0.0  # a new kubelet: no reason to wait out a backoff
