"""Raw ZeroMQ baselines for the handoff benchmark: what the transport alone costs.

* ping-pong: one DEALER times round trips to a ROUTER that echoes (RTT);
* relay: a ROUTER broker passes a numbered token around N DEALER processes,
  one frame in and one frame out per pass, with no logic, no acks and no
  decoding: the same topology and message count as the daemon's handoff
  (release in, grant out) with nodeagent taken away.

Both use ipc sockets in fresh processes and a frame the size of a real request.
"""

from __future__ import annotations

import tempfile
import time

import zmq

from bench import common
from client_lib import codec
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


# --------------------------------------------------------------------- relay


def _broker(ctl: common.WorkerControl, endpoint: str, holders: int, passes: int) -> None:
    """Wait for ``holders`` hellos, then pass token 1, 2, ... round robin."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ctl.ready()
    routes = [sock.recv_multipart()[0] for _ in range(holders)]
    sock.send_multipart([routes[0], b"1"])
    for token in range(2, passes + 1):
        sock.recv_multipart()  # the holder hands the token back
        sock.send_multipart([routes[(token - 1) % holders], b"%d" % token])
    sock.recv_multipart()
    time.sleep(0.1)  # let the last frames leave
    sock.close(0)
    ctx.term()
    ctl.result(None)


def _holder(ctl: common.WorkerControl, endpoint: str, loops: int) -> None:
    """Take the token ``loops`` times; record (token, observed, handed back)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    ctl.ready()
    sock.send(b"hello")
    now = time.monotonic_ns
    records = []
    for _ in range(loops):
        token = int(sock.recv())
        t_observed = now()
        t_release = now()
        sock.send(_FRAME)
        records.append((token, t_observed, t_release, now()))
    sock.close(linger=1000)
    ctx.term()
    ctl.result(records)


def relay(holders: int, loops: int) -> list[tuple[int, int, int, int]]:
    """Token-pass records of a raw broker relay, shaped like the handoff workers' records."""
    with tempfile.TemporaryDirectory(prefix="nodeagent-bench-relay-") as tmp:
        endpoint = f"ipc://{tmp}/broker.sock"
        with common.Workers() as broker, common.Workers() as clients:
            broker.start(_broker, endpoint, holders, holders * loops)
            broker.wait_ready(10)
            broker.go()
            for _ in range(holders):
                clients.start(_holder, endpoint, loops)
            clients.wait_ready(_TIMEOUT_S)
            clients.go()
            per_holder = clients.results(_TIMEOUT_S)
            broker.results(10)
    return [r for records in per_holder for r in records]
