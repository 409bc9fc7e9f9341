"""Client library behaviour against a real daemon, including the daemon going away."""

from __future__ import annotations

import signal
import subprocess
import sys
import socket
import threading
import time

import pytest

from client_lib import (Client, DaemonUnavailableError, GrantTimeoutError, HandshakeTimeoutError,
                        NodeAgentError)
from tests.conftest import BOTH_MODES, REPO, wait_for


@BOTH_MODES
def test_yield_point_without_a_request_keeps_the_token(inproc_daemon):
    with Client("solo", endpoint=inproc_daemon.endpoint) as client:
        with client.slice() as grant:
            for _ in range(100):
                assert client.yield_point() is False
            assert client.holding
            assert inproc_daemon.status().devices[0].holder == client.session_id
        assert not client.holding
        assert grant >= 1


@BOTH_MODES
def test_yield_point_gives_way_to_a_waiting_peer_and_comes_back(start_inproc_daemon):
    d = start_inproc_daemon("--quantum-ms", "training=20")
    with Client("a", endpoint=d.endpoint) as a, Client("b", endpoint=d.endpoint) as b:
        a.acquire()
        b_granted = []
        # b is used only from this thread from here on (a Client is single-threaded).
        t = threading.Thread(target=lambda: (b.acquire(timeout=5), b_granted.append(time.monotonic()),
                                             b.release()))
        t.start()
        deadline = time.monotonic() + 5
        while not a.yield_point():  # False until the 20 ms quantum ends with b waiting
            assert time.monotonic() < deadline, "never asked to yield"
        back = time.monotonic()
        t.join()
        assert b_granted and b_granted[0] <= back  # b ran in between
        assert a.holding


def test_a_tcp_client_waiting_past_the_heartbeat_timeout_keeps_its_session(start_inproc_daemon):
    """A session the daemon cannot watch (tcp) sends heartbeats; one blocked in ``acquire``
    behind a holder for longer than ``heartbeat.misses`` intervals must keep its session and
    its place in line, not be dropped as silent and say hello again at the back."""
    from tests.conftest import free_port
    from tests.rawpeer import RawPeer
    from client_lib import protocol as p
    d = start_inproc_daemon("--heartbeat-ms", "100", "--quantum-ms", "training=20000", "--grace-ms", "20000",
                            endpoint=f"tcp://127.0.0.1:{free_port()}")  # only its release frees the token
    holder = RawPeer(d.endpoint)
    welcome = holder.hello("holder")
    holder.call(p.Acquire(id=holder.take_id()))
    grant = holder.next_notice(p.Grant)

    def hold_then_release() -> None:  # heartbeats of its own for 0.6 s, twice the timeout, then gives back
        until = time.monotonic() + 0.6
        while time.monotonic() < until:
            holder.send(p.Heartbeat(id=holder.take_id(), session=welcome.session, key=welcome.key))
            time.sleep(0.03)
        holder.send(p.Release(id=holder.take_id(), grant=grant.grant, quiet=True))

    beats = threading.Thread(target=hold_then_release)
    with Client("waiter", endpoint=d.endpoint) as waiter:
        first = waiter.session_id
        beats.start()
        waiter.acquire(timeout=5)
        beats.join()
        assert waiter.session_id == first
    assert "reason=heartbeat" not in d.log()
    holder.close()


@BOTH_MODES
def test_acquire_timeout_withdraws_the_request(inproc_daemon):
    with Client("holder", endpoint=inproc_daemon.endpoint) as holder, Client("late", endpoint=inproc_daemon.endpoint) as late:
        holder.acquire()
        with pytest.raises(GrantTimeoutError):
            late.acquire(timeout=0.2)
        time.sleep(0.05)
        dev = inproc_daemon.status().devices[0]
        states = {s.name: s.state for s in dev.sessions}
        assert states["late"] == "idle" and dev.queue == []
        assert dev.holder == holder.session_id


def test_an_error_reply_to_a_request_sent_without_waiting_is_raised_at_the_next_call(inproc_daemon):
    """A quiet request is not waited for: its error reply (here E_INVALID for a queue length out
    of range) is kept and raised by the client's next call into the library, once."""
    from client_lib import DaemonError
    from client_lib import protocol as p
    with Client("quiet", endpoint=inproc_daemon.endpoint) as client:
        client._transport.send_quiet(p.Acquire(id=client._transport.take_id(), quiet=True, waiting=-1))
        with pytest.raises(DaemonError, match="E_INVALID") as caught:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                client.holding  # pumps what arrived: the error is raised here
                time.sleep(0.005)
        assert caught.value.code == p.ErrorCode.INVALID
        assert client.holding is False  # raised once


def test_no_daemon_is_said_at_once_naming_the_endpoint(workdir):
    endpoint = f"ipc://{workdir}/nobody.sock"
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError) as info:
        Client("lonely", endpoint=endpoint, handshake_timeout_s=5)
    assert time.monotonic() - started < 1  # not the handshake timeout: nothing listens
    assert endpoint in str(info.value) and "nothing listens there" in str(info.value)
    assert info.value.endpoint == endpoint


def test_a_daemon_that_never_answers_gives_a_handshake_timeout_naming_the_setting(workdir):
    path = f"{workdir}/mute.sock"
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(path)
    mute.listen(1)  # accepts (the kernel does) but never reads nor answers
    try:
        with pytest.raises(HandshakeTimeoutError) as info:
            Client("lonely", endpoint=f"ipc://{path}", handshake_timeout_s=0.3)
        assert "handshake_timeout_s" in str(info.value)
    finally:
        mute.close()


def test_daemon_killed_while_waiting_raises_unavailable(start_daemon):
    d = start_daemon("--heartbeat-ms", "100")
    with Client("holder", endpoint=d.endpoint, reconnect=False) as holder, \
            Client("waiter", endpoint=d.endpoint, reconnect=False) as waiter:
        holder.acquire()
        d.kill()
        started = time.monotonic()
        with pytest.raises(DaemonUnavailableError) as info:
            waiter.acquire(timeout=10)
        assert time.monotonic() - started < 2.0  # ~3 missed heartbeats of 100 ms
        assert d.endpoint in str(info.value)
        with pytest.raises(DaemonUnavailableError):
            holder.yield_point()


def test_a_request_after_a_failed_reattach_says_the_daemon_is_unavailable(start_daemon):
    d = start_daemon()
    with Client("orphan", endpoint=d.endpoint, reconnect=False) as client:
        d.kill()
        assert not client.try_resume()  # the failed attempt leaves no connection open
        with pytest.raises(DaemonUnavailableError, match="no connection"):
            client.status(timeout=1)


def test_reconnecting_client_carries_on_after_a_daemon_restart(start_daemon):
    d = start_daemon("--heartbeat-ms", "100")
    client = Client("phoenix", endpoint=d.endpoint, reconnect=True, reconnect_timeout_s=20)
    first_session = client.session_id
    with client.slice():
        pass
    d.kill()
    d2 = start_daemon("--heartbeat-ms", "100")
    # The program does not call the library for longer than the restarted daemon waits
    # for restored sessions to reattach (3 x 100 ms): the liveness thread reattaches it.
    time.sleep(1.0)
    (info,) = d2.status().devices[0].sessions
    assert info.id == first_session and info.attached
    with client.slice(timeout=10):
        assert d2.status().devices[0].holder == client.session_id
    assert client.session_id == first_session  # restored from the journal, resumed
    client.close()


def test_closed_client_refuses_work(inproc_daemon):
    client = Client("done", endpoint=inproc_daemon.endpoint)
    client.close()
    with pytest.raises(NodeAgentError, match="closed"):
        client.acquire()
    # bye reached the inproc_daemon: the session is gone at once, not after heartbeats.
    deadline = time.monotonic() + 2
    while inproc_daemon.status().devices[0].sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inproc_daemon.status().devices[0].sessions == []


def test_bad_workload_is_refused_before_connecting():
    with pytest.raises(ValueError, match="inference, training, best-effort"):
        Client("x", workload="gaming", endpoint="ipc:///nonexistent")


def test_client_lib_does_not_import_torch():
    code = "import sys, client_lib, client_lib.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_close_then_immediate_exit_is_a_clean_close_not_a_lost_session(daemon):
    # multiprocessing children leave through os._exit: nothing unsent survives it.
    code = ("import os, sys; from client_lib import Client; "
            "c = Client('brief', endpoint=sys.argv[1]); c.close(); os._exit(0)")
    for _ in range(10):
        subprocess.run([sys.executable, "-c", code, daemon.endpoint], check=True, cwd=REPO, timeout=30)
    # The daemon answers the bye before it writes its log line: read the log once all ten are there.
    log = wait_for(lambda: (lambda text: text if text.count("[session] close") == 10 else None)(daemon.log()))
    assert "lost session" not in log


def _lost_total(daemon_url: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(daemon_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("nodeagent_sessions_lost_total{"))


def _metrics_url(daemon) -> str:
    import re
    return wait_for(lambda: re.search(r"\[metrics\] serving (http://\S+/metrics)", daemon.log())).group(1)


# A client process that closes its connection, waits argv[2] s, then ends without Python's
# finalizers (os._exit): its connection closes before the kernel marks it exiting, as a script's
# does when its interpreter finalizes (Client.__del__'s bye may or may not get out by then).
_CLOSE_THEN_EXIT = """
import os, socket, sys, time
from client_lib import Client
c = Client("unclosed", endpoint=sys.argv[1], reconnect=False)  # nothing reattaches it
c.acquire(timeout=10)
c.release()
for fd in os.listdir("/proc/self/fd"):
    try:
        if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            socket.socket(fileno=int(fd)).shutdown(socket.SHUT_RDWR)  # at once, whoever polls it
    except OSError:
        pass
time.sleep(float(sys.argv[2]))
os._exit(0)
"""


def test_a_process_that_ends_without_closing_its_client_is_not_a_lost_session(start_daemon):
    """A script that never calls close() nor uses `with` (issue 29): its session ends, by the
    bye Client.__del__ sends at interpreter exit or, where that does not get out, as `exited`
    (its pidfd, no token held, no frame half-sent): never lost."""
    d = start_daemon("--metrics-port", "0")
    url = _metrics_url(d)
    code = ("import sys; from client_lib import Client; "
            "c = Client('unclosed', endpoint=sys.argv[1]); c.acquire(timeout=10); c.release()")
    for _ in range(3):
        subprocess.run([sys.executable, "-c", code, d.endpoint], check=True, cwd=REPO, timeout=60)
    log = wait_for(lambda: (lambda text: text if text.count("[session] end ") + text.count("[session] close ")
                            == 3 else None)(d.log()), timeout=15)
    assert "lost session" not in log
    assert _lost_total(url) == 0


def test_a_connection_closed_just_before_its_process_exits_is_not_a_lost_session(start_daemon):
    """The race behind the unclosed script: its connection closes while the kernel still has
    it running (not yet exiting). The daemon waits for its pidfd (ENDED_GRACE_S) instead of
    calling it lost; on a loaded host the gap is seconds."""
    d = start_daemon("--metrics-port", "0")
    url = _metrics_url(d)
    for _ in range(2):
        subprocess.run([sys.executable, "-c", _CLOSE_THEN_EXIT, d.endpoint, "0.5"], check=True, cwd=REPO,
                       timeout=60)
    log = wait_for(lambda: (lambda text: text if text.count("[session] end ") == 2 else None)(d.log()), timeout=15)
    assert "lost session" not in log and "reason=exited" in log
    assert _lost_total(url) == 0


def test_a_connection_closed_by_a_process_that_lives_on_is_lost_after_the_grace(start_daemon):
    """The fault side: a process that closes its connection and lives on is a lost session,
    `disconnected`, once the grace passes (nothing waits on it forever)."""
    from nodeagent.daemon.server import ENDED_GRACE_S
    d = start_daemon("--metrics-port", "0")
    url = _metrics_url(d)
    proc = subprocess.Popen([sys.executable, "-c", _CLOSE_THEN_EXIT, d.endpoint, "60"], cwd=REPO)
    try:
        try:
            log = wait_for(lambda: (lambda text: text if "lost session" in text else None)(d.log()),
                           timeout=ENDED_GRACE_S + 10)
        except AssertionError:
            raise AssertionError(d.log()) from None
        assert "reason=disconnected" in log and proc.poll() is None, log
        assert wait_for(lambda: _lost_total(url) == 1)
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_dies_holding_the_token_is_still_a_lost_session(start_daemon, spawn):
    d = start_daemon("--metrics-port", "0")
    url = _metrics_url(d)
    holder = spawn(d.endpoint, "hold", "--name", "victim")
    holder.expect("GRANT")
    holder.proc.send_signal(signal.SIGKILL)
    log = wait_for(lambda: (lambda text: text if "lost session" in text else None)(d.log()))
    assert "name=victim" in log and "reason=process_exited" in log
    assert wait_for(lambda: _lost_total(url) == 1)


@BOTH_MODES
def test_a_process_out_of_descriptors_gets_a_clear_error_and_its_clients_carry_on(daemon, sharing):
    """One descriptor per Client (no heartbeat socket, no I/O thread): a process runs
    out of descriptors only at its own limit, and then the next Client says so. Under co-run a
    training Client also maps its device's pace board, and Python's mmap keeps a descriptor of
    its own (``trackfd`` is 3.13's): two each."""
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from client_lib import Client, NodeAgentError
clients = []
try:
    while len(clients) < 200:
        clients.append(Client(f"c{{len(clients)}}", endpoint={daemon.endpoint!r}, reconnect=False))
except NodeAgentError as exc:
    print("REFUSED", len(clients), exc)
with clients[0].slice(timeout=5):
    pass
with clients[-1].slice(timeout=5):
    pass
print("SERVED")
for c in clients:
    c.close()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    refused = next(line for line in out.stdout.splitlines() if line.startswith("REFUSED"))
    per_client = 1 if sharing == "exclusive" else 2
    assert int(refused.split()[1]) > 40 // per_client  # of 64: about one descriptor per client (two)
    assert "out of file descriptors" in refused
    assert "SERVED" in out.stdout


def test_a_paced_client_with_descriptors_above_1024_still_sees_its_daemon(start_daemon):
    """A co-run trainer waiting on the pace board asks whether its daemon is still there; in a
    process holding more than FD_SETSIZE descriptors (a data loader's files), select() refuses the
    connection's descriptor, and the trainer took the daemon for gone and ran through every pause."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard descriptor limit here is {hard}, under 1,200")
    d = start_daemon("--sharing", "corun")
    code = f"""
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
from client_lib import Client
with Client("t", workload="training", endpoint={d.endpoint!r}) as c:
    assert c._transport.conn.fileno() > 1024, c._transport.conn.fileno()
    assert c._pace is not None
    print("THERE", c._daemon_there())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "THERE True" in out.stdout


def test_the_reattach_backoff_doubles_to_its_bound_with_jitter():
    """Issue 32 item 7: a client waiting on a daemon that is away waits between attempts, from
    20 ms doubling to 250 ms, each wait drawn from the upper half so that clients spread out."""
    import random

    from client_lib.client import reattach_delay_s
    rng = random.Random(7)
    for failures, bound in ((1, 0.02), (2, 0.04), (3, 0.08), (4, 0.16), (5, 0.25), (50, 0.25), (10**6, 0.25)):
        waits = [reattach_delay_s(failures, rng) for _ in range(200)]
        assert all(bound / 2 <= w <= bound for w in waits), (failures, min(waits), max(waits))
        assert max(waits) - min(waits) > bound / 4  # jittered, not in step
