"""What the daemon reports, kept current for the device plugin: :class:`DaemonWatcher` polls
``status`` and ``inventory`` (and, with ``events``, acts at once on the event kinds that can
change the list) and publishes a :class:`~nodeagent.k8s.shares.NodeView` on a :class:`ViewBoard`.
A lost GPU is told only by the events: docs/kubernetes.md (What the plugin advertises).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from client_lib import DaemonError, NodeAgentError, query_status
from client_lib import protocol as p
from client_lib.placement import ClientKeys, PlacementClient, load_server_public
from nodeagent.k8s.shares import Gpu, NodeView, SharePolicy, describe

log = logging.getLogger("nodeagent.k8s")

EVENT_TOPICS = (b"health", b"device_state", b"lend", b"reclaim")
REQUEST_TIMEOUT_S = 2.0  # for each status and inventory request


class ViewBoard:
    """The latest :class:`NodeView` and its version; readers wait for a newer one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._view = NodeView()
        self._version = 0
        self._closed = False

    def publish(self, view: NodeView) -> bool:
        """Make ``view`` current; False (nobody woken) when it equals the current one."""
        with self._cond:
            if view == self._view and self._version > 0:
                return False
            self._view = view
            self._version += 1
            self._cond.notify_all()
            return True

    def current(self) -> tuple[NodeView, int]:
        with self._cond:
            return self._view, self._version

    def wait_newer(self, version: int, timeout: float, unless: Callable[[], bool]) -> tuple[NodeView, int]:
        """The view once its version is past ``version``, or as it is after ``timeout`` s, a
        close, or a :meth:`wake` that finds ``unless()`` true."""
        with self._cond:
            self._cond.wait_for(lambda: self._version > version or self._closed or unless(), timeout)
            return self._view, self._version

    def wake(self) -> None:
        """Have every waiter look at its ``unless`` again."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter for good (the plugin is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


@dataclass(frozen=True)
class EventsSource:
    """The daemon's events endpoint and the CURVE keys to subscribe with."""

    endpoint: str  # tcp://HOST:PORT ([cluster] events_endpoint)
    client_key_file: str  # this client's .key_secret (its public key in the daemon's allowed/)
    server_key_file: str  # the daemon's server.key

    def open(self, context: zmq.Context) -> zmq.Socket:
        """A SUB socket on the kinds the plugin acts on; ValueError naming a key file that will not load."""
        keys = ClientKeys.load(self.client_key_file)
        server = load_server_public(self.server_key_file)
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1000)  # bounded: a backlog past this is dropped and a poll covers it
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys.public, keys.secret, server
        for topic in EVENT_TOPICS:
            sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(self.endpoint)
        return sock


class DaemonWatcher:
    """Polls the daemon (and listens to its events) on a thread of its own; publishes on ``board``,
    and logs each device's health (in ``policy``'s words) once per change."""

    def __init__(self, endpoint: str, board: ViewBoard, policy: SharePolicy, *, poll_interval_s: float = 2.0,
                 events: EventsSource | None = None) -> None:
        self.endpoint = endpoint
        self.board = board
        self.policy = policy
        self.poll_interval_s = poll_interval_s
        self.events = events
        self._lost: dict[int, tuple[int, str]] = {}  # device -> (boot it was lost in, why)
        self._boot: int | None = None
        self._last: NodeView | None = None
        self._said: dict[int, str] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ctx = zmq.Context()
        self._sub: zmq.Socket | None = None
        self._placement: PlacementClient | None = None
        self._thread: threading.Thread | None = None
        self.polls = 0  # status requests made (tests read it)
        self.events_seen = 0

    # ------------------------------------------------------------ life

    def start(self) -> None:
        """Open the events socket (ValueError for a bad key file), take a first look, start the thread."""
        try:
            if self.events is not None:
                self._sub = self.events.open(self._ctx)
            self._placement = PlacementClient({"local": self.endpoint}, keys=None,
                                              timeout_ms=REQUEST_TIMEOUT_S * 1000.0)
        except BaseException:
            self.close()
            raise
        self._publish(self.poll_once())
        self._thread = threading.Thread(target=self._run, name="k8s-daemon-watch", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Poll now rather than at the next interval."""
        with contextlib.suppress(OSError):  # a poke is pending already (the pipe is full), or closed
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Stop the thread and close everything; again is a no-op."""
        if self._wake_w < 0:
            return
        self._stop.set()
        self.poke()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=REQUEST_TIMEOUT_S * 2 + 1)
        if self._placement is not None:
            self._placement.close()
            self._placement = None
        if self._sub is not None:
            self._sub.close(0)
            self._sub = None
        self._ctx.destroy(linger=0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._sub is not None:
            poller.register(self._sub, zmq.POLLIN)
        next_poll = time.monotonic() + self.poll_interval_s
        while not self._stop.is_set():
            timeout_ms = max(0.0, (next_poll - time.monotonic()) * 1000.0)
            poll_now = False
            try:
                ready = dict(poller.poll(timeout_ms))
            except zmq.ZMQError as exc:  # the context went at close
                if self._stop.is_set():
                    return
                log.warning("[k8s] events poll failed: %s", exc)
                ready = {}
            if self._wake_r in ready:
                self._drain_wake()
                poll_now = True
            if self._sub is not None and self._sub in ready:
                poll_now |= self._read_events()
            if self._stop.is_set():
                return
            if poll_now or time.monotonic() >= next_poll:
                try:
                    self._publish(self.poll_once())
                except Exception as exc:  # a bug here must not end the plugin's view of the daemon
                    log.error("[k8s] poll failed: %s: %s", type(exc).__name__, exc)
                next_poll = time.monotonic() + self.poll_interval_s

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):  # empty now (BlockingIOError), or closed
            while os.read(self._wake_r, 64):
                pass

    def _read_events(self) -> bool:
        """Take what the SUB socket holds; True when one of them may change the device list."""
        decoder = msgspec.msgpack.Decoder(p.Event)
        changed = False
        for _ in range(1000):  # bounded per turn; the rest waits for the next one
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                continue
            try:
                event = decoder.decode(frames[1])
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.warning("[k8s] undecodable event from %s: %s", self.events.endpoint, exc)
                continue
            self.events_seen += 1
            changed |= self.on_event(event)
        return changed

    def on_event(self, event: p.Event) -> bool:
        """Note a lost or recovered device; True when the event may change what is advertised."""
        if event.kind == "health" and event.device is not None and "device_state" in event.data:
            if event.data["device_state"] == "lost":
                self._lost[event.device] = (event.boot, str(event.data.get("reason") or ""))
            else:
                self._lost.pop(event.device, None)
            return True
        if event.kind in ("device_state", "lend", "reclaim"):
            return True
        return self._boot is not None and event.boot != self._boot  # a restarted daemon: look again

    # ------------------------------------------------------------ asking the daemon

    def poll_once(self) -> NodeView:
        """The daemon's devices now (status, then inventory where it answers); never raises for a
        daemon that is away: the last devices are kept, marked not reachable."""
        self.polls += 1
        try:
            status = query_status(self.endpoint, timeout=REQUEST_TIMEOUT_S)
        except DaemonError as exc:  # it answered, with an error (busy, a bug): it is there, keep what it said
            log.debug("[k8s] status refused: %s", exc)
            if self._last is not None and self._last.reachable:
                return self._last
            return NodeView(reachable=False, problem=f"the daemon refused status: {exc}")
        except NodeAgentError as exc:
            gpus = self._last.gpus if self._last is not None else ()
            return NodeView(reachable=False, gpus=gpus, problem=str(exc))
        if status.boot != self._boot:
            self._boot = status.boot
            self._lost = {d: v for d, v in self._lost.items() if v[0] == status.boot}
        states = self._inventory_states()
        if states is None:  # refused: what the last answer said, for the devices it named
            last = self._last.gpus if self._last is not None and self._last.reachable else ()
            states = {g.index: (g.state, g.borrower) for g in last}
        gpus = []
        for info in status.devices:
            state, borrower = states.get(info.index, (None, None))
            lost = self._lost.get(info.index)
            gpus.append(Gpu(index=info.index, uuid=info.uuid, backend=info.backend,
                            capacity_mb=info.memory_capacity_mb, state=state, borrower=borrower,
                            lost=lost is not None and lost[0] == status.boot,
                            lost_reason=lost[1] if lost is not None else ""))
        return NodeView(reachable=True, gpus=tuple(gpus))

    def _inventory_states(self) -> dict[int, tuple[str, str | None]] | None:
        """Device -> (lifecycle state, borrower) from ``inventory``; {} where it did not answer,
        None where it answered with an error (busy: the last states still hold)."""
        if self._placement is None:
            return {}
        try:
            result = self._placement.inventory()["local"]
        except (OSError, DaemonError) as exc:  # the daemon went between the two requests
            log.debug("[k8s] inventory failed: %s", exc)
            return {}
        if isinstance(result.reply, p.Error):
            log.debug("[k8s] inventory refused: %s", result.reply.message)
            return None
        if result.error is not None or not isinstance(result.reply, p.InventoryReply):
            log.debug("[k8s] inventory failed: %s", result.error)
            return {}
        return {d.index: (d.state, d.borrower) for d in result.reply.devices}

    def _publish(self, view: NodeView) -> None:
        last = self._last
        self._last = view
        if last is None or last.reachable != view.reachable:
            if view.reachable:
                log.info("[k8s] daemon at %s answers: devices=%d", self.endpoint, len(view.gpus))
            else:
                log.warning("[k8s] daemon at %s does not answer (%s); its devices' shares are unhealthy until "
                            "it does", self.endpoint, view.problem)
        said = describe(view, self.policy)
        for index, words in said.items():
            if self._said.get(index) != words:
                gpu = next(g for g in view.gpus if g.index == index)
                log.info("[k8s] device=%d uuid=%s shares %s", index, gpu.uuid, words)
        for index in set(self._said) - set(said):
            log.info("[k8s] device=%d is no longer reported: its shares are withdrawn", index)
        self._said = said
        self.board.publish(view)
