"""A real daemon's metrics endpoint against peers that misbehave: a few hundred slow
scrapers cost it no thread and little memory and leave token grants as they were,
and garbage gets an error, never a crash. (bench.scrapers does the same with 2,000.)"""

from __future__ import annotations

import os
import random
import re
import socket
import statistics
import time
import urllib.error
import urllib.request

from client_lib import Client
from bench.scrapers import Sampler, SlowScrapers, threads_of
from tests.conftest import wait_for
from tests.proc_tools import rss_kb
from tests.metrics_scrape import metrics_url, scrape, value


def _port(daemon) -> int:
    return int(re.search(r":(\d+)/metrics$", metrics_url(daemon)).group(1))


def _acquire_latencies_s(client: Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.acquire(timeout=5)
        out.append(time.perf_counter() - t0)
        client.release()
    return out


def test_a_few_hundred_slow_scrapers_cost_no_thread_little_memory_and_no_grant_time(start_daemon, workdir):
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write("[metrics]\nmax_connections = 512\ntimeout_ms = 1000\n")  # all held: each closed by the timeout
    d = start_daemon("--metrics-port", "0")
    port, pid = _port(d), d.proc.pid
    url = metrics_url(d)
    with Client("probe", endpoint=d.endpoint) as client:
        _acquire_latencies_s(client, 100)  # warm
        before = _acquire_latencies_s(client, 300)
        threads0, rss0 = threads_of(pid), rss_kb(pid)
        with Sampler(pid) as sampler, SlowScrapers(port, 300, procs=1, byte_interval_s=0.05, reconnect_s=0.2):
            during = _acquire_latencies_s(client, 300)
            _, families = scrape(url)  # an honest scrape still gets through
            # Every slow one is closed when its second runs out, whatever it trickles.
            wait_for(lambda: value(scrape(url)[1], "nodeagent_metrics_http_closed", reason="timeout") >= 250,
                     timeout=10)
        assert sampler.samples >= 10
    assert threads0 == 1 and sampler.threads_max == threads0  # the old server: one thread per connection
    assert sampler.rss_max_kb - rss0 < 10 * 1024
    p50_before, p50_during = statistics.median(before), statistics.median(during)
    assert p50_during <= 2 * p50_before + 0.0005, (p50_before, p50_during)  # 2 cores shared with the scrapers
    assert not value(families, "nodeagent_internal_errors", where="metrics")


_GARBAGE = [
    b"\x00" * 64 + b"\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n",  # never finished: closed at the timeout
    b"GET /metrics HTTP/1.1\r\n" + b"A: b\r\n" * 3000,  # a head over the limit
    b"GET /metrics HTTP/9.9\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface
    b"GET /%00%ff HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
]


def test_garbage_and_partial_requests_get_errors_and_the_daemon_carries_on(start_daemon, workdir):
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write("[metrics]\ntimeout_ms = 500\n")
    d = start_daemon("--metrics-port", "0")
    port, url = _port(d), metrics_url(d)
    rng = random.Random(21)
    payloads = _GARBAGE + [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000))) + b"\r\n\r\n"
                           for _ in range(100)]
    statuses = []
    for payload in payloads:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                s.sendall(payload)
            except OSError:
                pass  # closed while we sent: a head over the limit
            got = b""
            try:
                while chunk := s.recv(65536):
                    got += chunk
            except ConnectionResetError:
                pass
        statuses.append(int(got.split()[1]) if got.startswith(b"HTTP/1.1 ") else None)
    assert statuses[:8] == [400, None, 431, 505, 505, 404, 200, 200]  # a body is not read: answered, then closed
    assert set(statuses[8:]) <= {400, 431, None}
    text, families = scrape(url)
    assert not value(families, "nodeagent_internal_errors", where="metrics")
    assert value(families, "nodeagent_metrics_http_closed", reason="bad_request") >= 100
    assert value(families, "nodeagent_metrics_http_closed", reason="timeout") >= 1
    assert d.status().devices
    assert urllib.request.urlopen(url, timeout=5).status == 200


_HOGS = r'''
import selectors, socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
request = b"GET /metrics HTTP/1.1\r\nHost: hog\r\n\r\n"
sel = selectors.DefaultSelector()
reconnects = 0

def connect():
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setblocking(False)
    s.sendall(request * 8)  # pipelined: each answer finds the next request already there
    sel.register(s, selectors.EVENT_READ, [0])

for _ in range(count):
    connect()
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    for key, _ in sel.select(0.05):
        s = key.fileobj
        try:
            data = s.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            data = b""
        if not data:  # evicted or at its request cap: back at once, pipelining again
            sel.unregister(s)
            s.close()
            reconnects += 1
            try:
                connect()
            except OSError:
                pass
            continue
        key.data[0] += data.count(b"HTTP/1.1 200")
        if key.data[0] >= 4:  # keep some requests always queued behind the one answered
            key.data[0] -= 4
            try:
                s.sendall(request * 4)
            except OSError:
                pass
print("reconnects", reconnects, flush=True)
'''


def test_a_real_scrape_is_served_under_64_pipelining_keep_alive_hogs(start_daemon, workdir):
    """Issue 32 item 8: 64 keep-alive connections pipelining requests (each always waiting for
    an exposition, and back at once when closed) held every slot: 0 of 32 real scrapes were
    served (503). The oldest waiting repeater now gives its slot up to a newcomer."""
    import subprocess
    import sys

    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write("[metrics]\nmax_connections = 64\ntimeout_ms = 10000\n")
    d = start_daemon("--metrics-port", "0")
    url = metrics_url(d)
    hogs = subprocess.Popen([sys.executable, "-c", _HOGS, str(_port(d)), "64", "60"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert hogs.stdout.readline().strip() == "ready", hogs.stderr.read()
        statuses = []
        for _ in range(32):
            try:
                statuses.append(urllib.request.urlopen(url, timeout=5).status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
        alive = hogs.poll() is None
    finally:
        hogs.kill()
        hogs.wait()
    assert alive, hogs.stderr.read()
    assert statuses == [200] * 32, statuses
