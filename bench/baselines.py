"""Baselines for the handoff benchmarks: what the transport alone costs.

* pipe ping-pong (:class:`PipePingPong`): two processes bounce one byte over
  a pair of pipes with blocking reads: the floor of any message from one
  process to another and back on this machine, measured in blocks that the
  benchmark interleaves with its own rounds;
* relay (:class:`UnixRelay`): a broker process passes a numbered token around
  N processes over unix stream sockets with the daemon's framing and codec
  (a ``release`` in, a ``grant`` out, length-prefixed MessagePack, the broker
  waiting in epoll), with no scheduler and no bookkeeping: the transport floor
  of a two-hop design (releaser -> daemon -> next holder), in the same rounds;
* zmq ping-pong (:func:`ping_pong`): one DEALER times round trips to a ROUTER
  that echoes over ipc, with a frame the size of a real request: the floor of
  the ZeroMQ transport the local endpoint used before.

Every baseline runs in fresh processes forked for it.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import tempfile
import time

import zmq

from bench import common
from client_lib import codec, framing
from client_lib import protocol as p

PING_WARMUP = 200
_TIMEOUT_S = 45.0
_FRAME = codec.encode(p.Release(id=123456, grant=789012, requeue=False))


# ----------------------------------------------------------------- ping-pong


def _echo_server(ctl: common.WorkerControl, endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ctl.ready()
    while True:
        route, frame = sock.recv_multipart()
        if frame == b"stop":
            break
        sock.send_multipart([route, frame])
    sock.close(0)
    ctx.term()
    ctl.result(None)


def _ping_client(ctl: common.WorkerControl, endpoint: str, round_trips: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    ctl.ready()
    now = time.monotonic_ns
    rtts = []
    for i in range(PING_WARMUP + round_trips):
        t0 = now()
        sock.send(_FRAME)
        sock.recv()
        if i >= PING_WARMUP:
            rtts.append(now() - t0)
    sock.send(b"stop")
    sock.close(linger=1000)
    ctx.term()
    ctl.result(rtts)


def ping_pong(round_trips: int, pairs: int = 1) -> list[list[int]]:
    """Round-trip times (ns) of raw ipc ping-pongs, ``round_trips`` for each of
    ``pairs`` fresh process pairs: the RTT depends on whether the scheduler puts
    both on one core or not, so one pair alone can mislead."""
    per_pair = []
    with tempfile.TemporaryDirectory(prefix="nodeagent-bench-rtt-") as tmp:
        for i in range(pairs):
            endpoint = f"ipc://{tmp}/echo{i}.sock"
            with common.Workers() as server, common.Workers() as client:
                server.start(_echo_server, endpoint)
                server.wait_ready(10)
                server.go()
                client.start(_ping_client, endpoint, round_trips)
                client.wait_ready(10)
                client.go()
                per_pair += client.results(_TIMEOUT_S)
                server.results(10)
    return per_pair


# ------------------------------------------------------------ pipe ping-pong

PIPE_BLOCK_WARMUP = 10  # round trips each block starts with and discards (caches, idle CPUs waking)
_SAMPLE = struct.Struct("=q")


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _pipe_echo(ctl: common.WorkerControl, ping_r: int, pong_w: int, others: list[int]) -> None:
    _close_all(others)  # the fork copied every end; keep ours only
    ctl.ready()
    read, write = os.read, os.write
    while True:
        byte = read(ping_r, 1)
        if byte in (b"", b"q"):
            break
        write(pong_w, byte)
    ctl.result(None)


def _pipe_pinger(ctl: common.WorkerControl, ask_r: int, answer_w: int, ping_w: int, pong_r: int,
                 others: list[int]) -> None:
    _close_all(others)
    ctl.ready()
    read, write, now = os.read, os.write, time.monotonic_ns
    while True:
        try:
            (count,) = _SAMPLE.unpack(_read_exactly(ask_r, _SAMPLE.size))
        except EOFError:
            count = -1
        if count < 0:
            break
        rtts = []
        for _ in range(count):
            t0 = now()
            write(ping_w, b"x")
            read(pong_r, 1)
            rtts.append(now() - t0)
        write(answer_w, struct.pack(f"={count}q", *rtts))
    write(ping_w, b"q")  # the echo process leaves
    ctl.result(None)


class PipePingPong:
    """Two processes that, on :meth:`block`, time ``count`` one-byte round trips over
    a pair of pipes (blocking reads on both sides); they sleep in ``read`` in between.

    Use as a context manager; the processes stay up so that blocks can be taken
    between the rounds of something else without paying a fork each time."""

    def __init__(self) -> None:
        self._workers = common.Workers()
        self._ask_w = self._answer_r = -1

    def __enter__(self) -> "PipePingPong":
        ping_r, ping_w = os.pipe()
        pong_r, pong_w = os.pipe()
        ask_r, self._ask_w = os.pipe()
        self._answer_r, answer_w = os.pipe()
        every = [ping_r, ping_w, pong_r, pong_w, ask_r, self._ask_w, self._answer_r, answer_w]
        mine = (ping_r, pong_w)
        self._workers.start(_pipe_echo, ping_r, pong_w, [fd for fd in every if fd not in mine])
        mine = (ask_r, answer_w, ping_w, pong_r)
        self._workers.start(_pipe_pinger, ask_r, answer_w, ping_w, pong_r, [fd for fd in every if fd not in mine])
        _close_all(fd for fd in every if fd not in (self._ask_w, self._answer_r))  # the children hold theirs
        self._workers.wait_ready(10)
        self._workers.go()
        return self

    def block(self, count: int, warmup: int = PIPE_BLOCK_WARMUP) -> list[int]:
        """``count`` round-trip times (ns), after ``warmup`` discarded ones."""
        total = count + warmup
        os.write(self._ask_w, _SAMPLE.pack(total))
        rtts = struct.unpack(f"={total}q", _read_exactly(self._answer_r, total * _SAMPLE.size))
        return list(rtts[warmup:])

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                os.write(self._ask_w, _SAMPLE.pack(-1))
                self._workers.results(10)
        finally:
            _close_all((self._ask_w, self._answer_r))
            self._workers.__exit__(*exc)


# --------------------------------------------------------------------- relay

_GRANT_SLICE_MS = 200.0


def _relay_broker(ctl: common.WorkerControl, path: str, holders: int, plan: list[int],
                  gate: common.RoundGate) -> None:
    """Accept ``holders`` connections, then in each round pass the token round robin,
    ``holders * plan[r]`` times: grant out, wait (epoll) for its release, next."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(holders)
    ctl.ready()
    conns = [listener.accept()[0] for _ in range(holders)]
    listener.close()
    poller = select.epoll()
    by_fd = {}
    for conn in conns:
        poller.register(conn.fileno(), select.EPOLLIN)
        by_fd[conn.fileno()] = (conn, framing.FrameBuffer(p.MAX_REQUEST_BYTES))
    token = 0
    for loops in plan:
        gate.enter()
        for _ in range(holders * loops):
            token += 1
            conns[token % holders].sendall(
                framing.pack(codec.encode(p.Grant(id=0, grant=token, device=0, slice_ms=_GRANT_SLICE_MS))))
            released = False
            while not released:
                for fd, _ in poller.poll():
                    conn, frames = by_fd[fd]
                    data = conn.recv(65536)
                    if not data:
                        raise RuntimeError("a relay holder hung up")
                    for frame in frames.feed(data):
                        msg = codec.decode_request(frame)
                        released = released or (type(msg) is p.Release and msg.grant == token)
        gate.leave()
    for conn in conns:
        conn.close()
    ctl.result(None)


def _relay_holder(ctl: common.WorkerControl, path: str, plan: list[int], gate: common.RoundGate) -> None:
    """Connect; in each round take the token ``plan[r]`` times (blocking reads), hand it
    straight back; record (round, token, observed, release sent, after the send)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    frames = framing.FrameBuffer(framing.MAX_DAEMON_FRAME_BYTES)
    ctl.ready()
    now = time.monotonic_ns
    records = []
    next_id = 1
    for round_index, loops in enumerate(plan):
        gate.enter()
        for _ in range(loops):
            grant = None
            while grant is None:
                for frame in frames.feed(sock.recv(65536)):
                    msg = codec.decode_reply(frame)
                    if type(msg) is p.Grant:
                        grant = msg.grant
            t_observed = now()
            t_release = now()
            sock.sendall(framing.pack(codec.encode(p.Release(id=next_id, grant=grant, quiet=True))))
            next_id += 1
            records.append((round_index, grant, t_observed, t_release, now()))
        gate.leave()
    sock.close()
    ctl.result(records)


class UnixRelay:
    """``holders`` processes and a broker relaying a token in rounds (see the module
    docstring); :meth:`run_round` runs the next round of ``plan`` (grants per holder
    per round), :meth:`records` returns what the holders recorded, shaped like the
    handoff contenders' records."""

    def __init__(self, holders: int, plan: list[int]) -> None:
        self.holders = holders
        self.plan = list(plan)
        self._tmp = tempfile.TemporaryDirectory(prefix="nodeagent-bench-relay-")
        self._gate = common.RoundGate(holders + 1)
        self._broker = common.Workers()
        self._clients = common.Workers()

    def __enter__(self) -> "UnixRelay":
        path = os.path.join(self._tmp.name, "broker.sock")
        self._broker.start(_relay_broker, path, self.holders, self.plan, self._gate)
        self._broker.wait_ready(10)
        self._broker.go()
        for _ in range(self.holders):
            self._clients.start(_relay_holder, path, self.plan, self._gate)
        self._clients.wait_ready(_TIMEOUT_S)
        self._clients.go()
        return self

    def run_round(self) -> tuple[int, int]:
        return self._gate.run_round()

    def records(self) -> list[tuple[int, int, int, int, int]]:
        per_holder = self._clients.results(_TIMEOUT_S)
        self._broker.results(10)
        return [r for records in per_holder for r in records]

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self._gate.abort()
        self._clients.__exit__(*exc)
        self._broker.__exit__(*exc)
        self._tmp.cleanup()
