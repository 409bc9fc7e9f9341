"""The daemon over real sockets: in a thread of this process where only its policy is tested
(start_inproc_daemon), as a process where its own process matters (signals, its socket, pidfds)."""

from __future__ import annotations

import itertools
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from client_lib import Client, ErrorCode
from client_lib import protocol as p
from tests.conftest import BOTH_MODES, REPO, wait_for
from tests.conftest import free_port as _free_port
from tests.rawpeer import RawPeer




def sessions_by_name(status):
    return {s.name: s for d in status.devices for s in d.sessions}


# ------------------------------------------------------------------ sharing

def test_two_training_clients_alternate_and_both_progress(start_inproc_daemon, spawn):
    d = start_inproc_daemon("--quantum-ms", "training=30")
    a = spawn(d.endpoint, "loop", "--name", "a", "--seconds", "2")
    b = spawn(d.endpoint, "loop", "--name", "b", "--seconds", "2")
    done_a, done_b = a.expect("DONE", timeout=20), b.expect("DONE", timeout=20)
    assert int(done_a[2]) > 0 and int(done_b[2]) > 0
    # Both were granted many times over: they took turns rather than one waiting it out.
    assert len(a.events("GRANT")) >= 5 and len(b.events("GRANT")) >= 5
    # They take short turns: with equal weights the scheduler may grant the one
    # that has used less twice in a row, but never leaves the other waiting long.
    timeline = sorted([(t, "a") for _, t, _ in a.events("GRANT")] + [(t, "b") for _, t, _ in b.events("GRANT")])
    start = max(a.events("GRANT")[0][1], b.events("GRANT")[0][1])
    both_running = [who for t, who in timeline if start <= t < min(done_a[1], done_b[1])]
    longest_run = max(len(list(run)) for _, run in itertools.groupby(both_running))
    assert longest_run <= 3, both_running
    assert 0.4 <= both_running.count("a") / len(both_running) <= 0.6, both_running


@BOTH_MODES
def test_inference_preempts_training_or_runs_beside_it(start_inproc_daemon, spawn, sharing):
    """Exclusive: an inference request makes the training holder yield, and it gets the token
    back after each. Co-run (the GPU's default): inference is granted at once in its own lane,
    and the trainer keeps its slice, never asked to yield."""
    d = start_inproc_daemon("--quantum-ms", "training=1000", "--grace-ms", "500")
    trainer = spawn(d.endpoint, "loop", "--name", "trainer", "--seconds", "5")
    trainer.expect("GRANT")
    with Client("infer", workload="inference", endpoint=d.endpoint) as client:
        waits = []
        for _ in range(5):
            asked = time.monotonic()
            with client.slice(timeout=5):
                waits.append(time.monotonic() - asked)
                dev = d.status().devices[0]
                assert dev.holder == client.session_id  # the highest class's holder, in both modes
                states = {s.name: s.state for s in dev.sessions}
                assert states["infer"] == "holding"
                if sharing == "corun":
                    assert states["trainer"] == "holding"  # beside it, in its own lane
            time.sleep(0.05)
    # The training quantum is 1 s: only preemption (or a lane of its own) explains waits far below it.
    assert max(waits) < 0.25, waits
    if sharing == "exclusive":
        assert len(trainer.events("GRANT")) >= 5  # the trainer got the token back after each request
    else:
        assert len(trainer.events("GRANT")) == 1  # one slice throughout: nobody asked it to yield
        assert "ask-yield" not in d.log()


def test_weighted_fair_share(start_inproc_daemon, spawn):
    d = start_inproc_daemon("--quantum-ms", "training=20")
    kids = [spawn(d.endpoint, "loop", "--name", f"w{w}-{i}", "--weight", str(w), "--seconds", "4")
            for i, w in enumerate((1, 1, 2))]
    for kid in kids:
        kid.expect("SESSION")
    time.sleep(3.0)
    sessions = sessions_by_name(d.status())
    times = [sessions[f"w{w}-{i}"].gpu_time_s for i, w in enumerate((1, 1, 2))]
    shares = [t / sum(times) for t in times]
    for kid in kids:
        kid.expect("DONE", timeout=20)
    # Asked 25/25/50. Start-up skew (children connect at different moments) is
    # part of the 3 s window, so the tolerance is wider than the bench's goal.
    assert shares[2] == pytest.approx(0.5, abs=0.07), shares
    assert shares[0] == pytest.approx(0.25, abs=0.07), shares
    assert shares[1] == pytest.approx(0.25, abs=0.07), shares


@BOTH_MODES
def test_holder_killed_with_sigkill_hands_token_on_at_once(daemon, spawn):
    holder = spawn(daemon.endpoint, "hold", "--name", "victim")  # a trainer, as the waiter: one lane in co-run
    holder.expect("GRANT")
    with Client("waiter", endpoint=daemon.endpoint) as waiter:
        granted_at = []
        t = threading.Thread(target=lambda: (waiter.acquire(timeout=10), granted_at.append(time.monotonic())))
        t.start()
        wait_for(lambda: daemon.status().devices[0].queue == [waiter.session_id])
        killed_at = time.monotonic()
        holder.proc.send_signal(signal.SIGKILL)
        t.join()
        latency = granted_at[0] - killed_at
    assert latency < 0.5, f"waiter granted {latency * 1000:.1f} ms after the holder died"
    # Its connection closing and its pidfd becoming readable race (the kernel closes a
    # dying process's files before it becomes a zombie); either ends the session.
    assert "reason=process_exited" in daemon.log() or "reason=disconnected" in daemon.log()
    assert "victim" not in sessions_by_name(daemon.status())


@BOTH_MODES
def test_silent_unverified_session_is_dropped_after_missed_heartbeats(start_inproc_daemon):
    # Over TCP the daemon cannot watch the peer's process: it must send heartbeats.
    # Quantum and grace far longer than the heartbeat timeout: only heartbeats can free the token.
    d = start_inproc_daemon("--heartbeat-ms", "100", "--quantum-ms", "training=20000", "--grace-ms", "20000",
                     endpoint=f"tcp://127.0.0.1:{_free_port()}")
    silent = RawPeer(d.endpoint)  # this test process stays alive: only heartbeats can tell
    assert silent.hello("silent").heartbeat_ms == 100
    silent.call(p.Acquire(id=silent.take_id()))
    silent.next_notice(p.Grant)
    with Client("waiter", endpoint=d.endpoint) as waiter:
        started = time.monotonic()
        waiter.acquire(timeout=5)
        waited = time.monotonic() - started
    assert 0.2 < waited < 2.0, waited  # 3 missed 100 ms heartbeats, not before
    assert "reason=heartbeat" in d.log()
    silent.close()


@BOTH_MODES
def test_holder_that_ignores_yield_is_revoked_after_grace(start_inproc_daemon, sharing):
    """Exclusive: an inference request asks the training holder to yield (preempted). Co-run:
    inference is granted at once beside it, and a trainer's request asks at the end of the
    holder's quantum. Either way, a holder that ignores the ask loses the token at the grace."""
    # enforce=revoke: the stubborn peer lives in this test process, which must not be stopped.
    d = start_inproc_daemon("--grace-ms", "150", "--enforce", "revoke", "--quantum-ms", "training=100")
    stubborn = RawPeer(d.endpoint)
    stubborn.hello("stubborn")
    stubborn.call(p.Acquire(id=stubborn.take_id()))
    grant = stubborn.next_notice(p.Grant)
    with Client("infer", workload="inference", endpoint=d.endpoint) as infer:
        asked = time.monotonic()
        infer.acquire(timeout=5)
        waited = time.monotonic() - asked
    if sharing == "corun":
        assert waited < 0.1, waited  # its own lane: no ask, no grace
        assert stubborn.notices == [] and not stubborn.readable(0.05)
        waiter = Client("trainer", endpoint=d.endpoint)
        asked = time.monotonic()
        waiter.acquire(timeout=5)
        waited = time.monotonic() - asked
        waiter.close()
    ask = stubborn.next_notice(p.YieldRequest)
    reason = "preempted" if sharing == "exclusive" else "quantum"
    assert (ask.grant, ask.reason, ask.deadline_ms) == (grant.grant, reason, 150.0)
    revoke = stubborn.next_notice(p.Revoke)
    assert (revoke.grant, revoke.reason) == (grant.grant, "overrun")
    assert 0.14 < waited < 1.0, waited  # the grace (co-run: after the rest of the quantum too)
    # The revoked grant can no longer be released.
    reply = stubborn.call(p.Release(id=stubborn.take_id(), grant=grant.grant))
    assert reply.code == ErrorCode.NOT_HOLDER
    stubborn.close()


# ------------------------------------------------------------- bad input

def _malformed_frames(n: int, rng: random.Random):
    """n frames that are each wrong in some way, cycling through the kinds."""
    enc = msgspec.msgpack.encode
    kinds = [
        lambda i: rng.randbytes(rng.randint(1, 64)),                        # random bytes
        lambda i: b"",                                                      # empty frame
        lambda i: enc([i, "acquire"]),                                      # not a map
        lambda i: enc({"op": "launch_missiles", "id": i}),                  # unknown op
        lambda i: enc({"op": "release", "id": i}),                          # missing field
        lambda i: enc({"op": "release", "id": i, "grant": "seven"}),        # wrong type
        lambda i: enc({"op": "hello", "id": i, "protocol": "1.0", "name": 3, "pid": "x"}),
        lambda i: enc({"id": i}),                                           # no op at all
        lambda i: enc({"op": "acquire", "id": 2 ** 64 - 1}),                # id out of range
        lambda i: enc({"op": "status", "id": i, "x": "y" * (p.MAX_REQUEST_BYTES + 10)}),  # oversized
    ]
    return [kinds[i % len(kinds)](i + 1) for i in range(n)]


def test_ten_thousand_malformed_frames_each_get_bad_request(daemon):
    holder = RawPeer(daemon.endpoint)
    holder.hello("holder")
    holder.call(p.Acquire(id=holder.take_id()))
    grant = holder.next_notice(p.Grant)
    before = daemon.status()

    attacker = RawPeer(daemon.endpoint)
    frames = _malformed_frames(10_000, random.Random(7))
    replies = []
    for start in range(0, len(frames), 500):  # pipelined in batches
        for frame in frames[start:start + 500]:
            attacker.send(frame)
        for _ in frames[start:start + 500]:
            replies.append(attacker.recv(timeout=10))
    assert len(replies) == 10_000
    assert all(isinstance(r, p.Error) and r.code == ErrorCode.BAD_REQUEST for r in replies)
    # Also a frame whose header declares more than a request may be: answered, and that
    # connection closed (the stream cannot be trusted past it); the daemon serves on.
    liar = RawPeer(daemon.endpoint)
    liar.send_raw((1 << 30).to_bytes(4, "big") + b"\x80")
    assert liar.recv().code == ErrorCode.BAD_REQUEST
    with pytest.raises(ConnectionError):
        liar.recv_frames(2.0)
    liar.close()

    after = daemon.status()
    assert daemon.proc.poll() is None
    strip = lambda st: [(d.holder, d.queue, [(s.id, s.state, s.grants) for s in d.sessions]) for d in st.devices]
    assert strip(after) == strip(before)
    # The held token is still good: the daemon did not lose track of it.
    assert isinstance(holder.call(p.Release(id=holder.take_id(), grant=grant.grant)), p.Ok)
    holder.close()
    attacker.close()


def test_hello_with_unknown_major_gets_e_protocol_naming_both(inproc_daemon):
    peer = RawPeer(inproc_daemon.endpoint)
    reply = peer.call(p.Hello(id=1, protocol=(99, 3), name="future", pid=os.getpid()))
    assert isinstance(reply, p.Error) and reply.code == ErrorCode.PROTOCOL
    assert "99.3" in reply.message and "%d.%d" % p.PROTOCOL_VERSION in reply.message
    assert inproc_daemon.status().devices[0].sessions == []
    peer.close()


def test_newer_minor_is_accepted(inproc_daemon):
    peer = RawPeer(inproc_daemon.endpoint)
    welcome = peer.hello("newer", protocol=(p.PROTOCOL_VERSION[0], p.PROTOCOL_VERSION[1] + 5))
    assert welcome.protocol == p.PROTOCOL_VERSION
    peer.close()


@pytest.mark.parametrize("fields, code, fragment", [
    ({"weight": 0.0}, ErrorCode.INVALID, "weight"),
    ({"weight": float("nan")}, ErrorCode.INVALID, "weight"),
    ({"memory_mb": -1}, ErrorCode.INVALID, "memory_mb"),
    ({"device": 3}, ErrorCode.DEVICE, "devices 0..0"),
    ({"name": ""}, ErrorCode.INVALID, "name"),
])
def test_hello_with_bad_values_is_refused_and_registers_nothing(inproc_daemon, fields, code, fragment):
    peer = RawPeer(inproc_daemon.endpoint)
    fields = {"name": "bad", "pid": os.getpid(), "protocol": p.PROTOCOL_VERSION, **fields}
    reply = peer.call(p.Hello(id=1, **fields))
    assert isinstance(reply, p.Error) and reply.code == code and fragment in reply.message
    assert inproc_daemon.status().devices[0].sessions == []
    peer.close()


def test_requests_without_a_session_get_e_no_session(inproc_daemon):
    peer = RawPeer(inproc_daemon.endpoint)
    for msg in (p.Acquire(id=1), p.Release(id=2, grant=1), p.Cancel(id=3), p.Goodbye(id=4),
                p.Heartbeat(id=5, session="s-nope", key="k")):
        reply = peer.call(msg)
        assert isinstance(reply, p.Error) and reply.code == ErrorCode.NO_SESSION, msg
    peer.close()


def test_quiet_requests_answer_only_errors(inproc_daemon):
    peer = RawPeer(inproc_daemon.endpoint)
    refused = peer.call(p.Acquire(id=1, quiet=True))  # no session yet: an error still comes
    assert refused.code == ErrorCode.NO_SESSION
    peer.hello("quiet")
    peer.send(p.Acquire(id=peer.take_id(), quiet=True))
    grant = peer.recv()
    assert isinstance(grant, p.Grant)  # the grant, and no ok before or after it
    peer.send(p.Release(id=peer.take_id(), grant=grant.grant, quiet=True))
    stale = peer.call(p.Release(id=peer.take_id(), grant=grant.grant, quiet=True))
    assert stale.code == ErrorCode.NOT_HOLDER  # the first release was silent; the second is refused
    assert peer.notices == []
    peer.close()


def test_heartbeat_with_wrong_key_is_refused(inproc_daemon):
    owner = RawPeer(inproc_daemon.endpoint)
    welcome = owner.hello("owner")
    other = RawPeer(inproc_daemon.endpoint)
    # The session lives: a wrong key is forbidden, not "no session" (tests/client_lib/test_protocol_behaviour.py).
    assert other.call(p.Heartbeat(id=1, session=welcome.session, key="guess")).code == ErrorCode.FORBIDDEN
    assert isinstance(other.call(p.Heartbeat(id=2, session=welcome.session, key=welcome.key)), p.HeartbeatAck)
    owner.close()
    other.close()


def test_claimed_pid_is_not_trusted(daemon):
    peer = RawPeer(daemon.endpoint)
    peer.hello("liar", pid=1)  # claims to be init
    (session,) = daemon.status().devices[0].sessions
    assert session.pid == os.getpid() and session.pid_verified
    assert "pid claim mismatch" in daemon.log()
    peer.close()


# ---------------------------------------------------------- status / life

def test_status_json_shape(inproc_daemon):
    daemon = inproc_daemon
    with Client("shape", workload="inference", endpoint=daemon.endpoint) as client:
        with client.slice():
            out = subprocess.run([sys.executable, "-m", "nodeagent", "status", "--json", "--endpoint",
                                  daemon.endpoint], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 0, out.stderr
    doc = msgspec.json.decode(out.stdout)
    (dev,) = doc["devices"]
    assert dev["index"] == 0 and dev["backend"] == "cpu"
    assert dev["holder"] == client.session_id
    assert dev["memory_total_bytes"] > 0
    (sess,) = dev["sessions"]
    assert sess["name"] == "shape" and sess["workload"] == "inference" and sess["state"] == "holding"
    assert isinstance(sess["gpu_time_s"], float) and sess["gpu_time_s"] >= 0


@BOTH_MODES
def test_status_shows_each_holder_and_who_waits(start_inproc_daemon, sharing):
    """What ``status`` shows of one device where a trainer holds, a second trainer waits and
    an inference service asks: exclusive, the trainer is asked to yield and both wait behind
    it; co-run, the service holds beside the trainer (the device's holder is the highest
    class's) and only the second trainer waits. Both holders are in the activity's bucket."""
    d = start_inproc_daemon("--grace-ms", "60000", "--enforce", "revoke")
    trainer, second, infer = RawPeer(d.endpoint), RawPeer(d.endpoint), RawPeer(d.endpoint)
    ids = {"trainer": trainer.hello("trainer").session, "second": second.hello("second").session,
           "infer": infer.hello("infer", workload="inference").session}
    trainer.call(p.Acquire(id=trainer.take_id()))
    grant = trainer.next_notice(p.Grant)
    second.call(p.Acquire(id=second.take_id()))
    infer.call(p.Acquire(id=infer.take_id()))
    if sharing == "exclusive":
        assert trainer.next_notice(p.YieldRequest).reason == "preempted"
        dev = wait_for(lambda: (lambda dev: dev if dev.queue == [ids["infer"], ids["second"]] else None)(
            d.status().devices[0]))
        assert dev.holder == ids["trainer"]
        assert {s.name: s.state for s in dev.sessions} == {"trainer": "yielding", "second": "waiting",
                                                            "infer": "waiting"}
        trainer.call(p.Release(id=trainer.take_id(), grant=grant.grant))
    infer.next_notice(p.Grant)
    dev = d.status().devices[0]
    assert dev.holder == ids["infer"] and dev.queue == [ids["second"]]
    holding = "holding" if sharing == "corun" else "idle"
    assert {s.name: s.state for s in dev.sessions} == {"trainer": holding, "second": "waiting", "infer": "holding"}
    assert set(dev.activity.holders[-1]) == {ids["trainer"], ids["infer"]}  # both held in this bucket
    for peer in (trainer, second, infer):
        peer.close()


def test_status_human_output_and_unreachable_daemon(inproc_daemon, workdir):
    daemon = inproc_daemon
    out = subprocess.run([sys.executable, "-m", "nodeagent", "status", "--endpoint", daemon.endpoint],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 0 and "device 0" in out.stdout and "no sessions" in out.stdout
    nowhere = f"ipc://{workdir}/nobody.sock"
    out = subprocess.run([sys.executable, "-m", "nodeagent", "status", "--endpoint", nowhere, "--timeout", "0.3"],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 1 and nowhere in out.stderr


def test_sigterm_revokes_tokens_and_removes_the_socket(daemon):
    peer = RawPeer(daemon.endpoint)
    peer.hello("holder")
    peer.call(p.Acquire(id=peer.take_id()))
    grant = peer.next_notice(p.Grant)
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o660
    assert daemon.stop(signal.SIGTERM) == 0
    revoke = peer.next_notice(p.Revoke)
    assert (revoke.grant, revoke.reason) == (grant.grant, "shutdown")
    assert not os.path.exists(daemon.socket_path)
    assert "[shutdown] reason=SIGTERM step=revoke tokens=1" in daemon.log()
    peer.close()


def test_sigint_also_shuts_down_cleanly(daemon):
    assert daemon.stop(signal.SIGINT) == 0
    assert not os.path.exists(daemon.socket_path)


def test_second_daemon_on_the_same_endpoint_is_refused(daemon):
    out = subprocess.run([sys.executable, "-m", "nodeagent", "serve", "--backend", "cpu", "--endpoint",
                          daemon.endpoint, "--state-dir", os.path.join(daemon.workdir, "s2")],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 1
    assert f"pid {daemon.proc.pid}" in out.stderr and "another nodeagent" in out.stderr
    assert daemon.status().daemon_pid == daemon.proc.pid  # the first one is untouched


@pytest.mark.parametrize("failing", ["mps", "serving"])
def test_a_start_that_fails_once_bound_stops_what_it_started_and_leaves_no_socket(workdir, monkeypatch, failing):
    from prometheus_client import CollectorRegistry

    from nodeagent.config import ServeConfig
    from nodeagent.daemon.server import AgentServer
    from nodeagent.devices import CpuBackend
    from nodeagent.metrics import Metrics

    config = ServeConfig(backend="cpu", endpoint=f"ipc://{workdir}/start.sock", state_dir=workdir)
    server = AgentServer(config, CpuBackend(1), metrics=Metrics(CollectorRegistry()))
    stopped = []
    monkeypatch.setattr(server._mps, "stop", lambda: stopped.append("mps"))
    monkeypatch.setattr(server._serving, "stop", lambda: stopped.append("serving"))

    def cannot_start(*args):
        raise RuntimeError(f"{failing} cannot start")

    monkeypatch.setattr(getattr(server, f"_{failing}"), "start", cannot_start)
    with pytest.raises(RuntimeError, match="cannot start"):
        server.bind()
    assert stopped == (["mps"] if failing == "mps" else ["serving", "mps"])
    assert not os.path.exists(f"{workdir}/start.sock") and server.journal is None


def test_stale_socket_from_a_killed_daemon_is_replaced(start_daemon):
    d = start_daemon()
    d.kill()  # SIGKILL: socket file left behind
    assert os.path.exists(d.socket_path)
    d2 = start_daemon()
    assert d2.status().daemon_pid == d2.proc.pid


def test_cpu_devices_and_device_choice(start_inproc_daemon):
    d = start_inproc_daemon("--cpu-devices", "2")
    with Client("x", endpoint=d.endpoint) as a, Client("y", endpoint=d.endpoint) as b, \
            Client("z", endpoint=d.endpoint, device=1) as c:
        assert {a.device, b.device} == {0, 1}  # least loaded first
        assert c.device == 1
        # Devices have separate tokens: both can hold at once.
        with a.slice(timeout=2), b.slice(timeout=2):
            st = d.status()
            assert all(dev.holder is not None for dev in st.devices)


@BOTH_MODES
def test_an_unverified_holder_whose_connection_closes_is_dropped_at_once(start_inproc_daemon):
    # Over tcp there is no pidfd, and with long heartbeats and grace nothing but the connection's
    # end can free the token quickly. The waiter takes turns with the holder in both modes: an
    # inference waiter would be granted at once beside it under co-run, whatever became of it.
    import socket as socket_mod
    with socket_mod.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_inproc_daemon("--heartbeat-ms", "20000", "--grace-ms", "20000", endpoint=f"tcp://127.0.0.1:{port}")
    gone = RawPeer(d.endpoint)
    gone.hello("gone")
    gone.call(p.Acquire(id=gone.take_id()))
    gone.next_notice(p.Grant)
    gone.close()  # the process lives on; only the connection ends
    with Client("waiter", workload="training", endpoint=d.endpoint) as waiter:
        asked = time.monotonic()
        waiter.acquire(timeout=10)
        assert time.monotonic() - asked < 1.0
    assert "reason=disconnected" in d.log()


def test_a_watched_session_needs_no_heartbeat_and_ends_when_its_connection_closes(start_daemon):
    d = start_daemon("--heartbeat-ms", "100")
    quiet = RawPeer(d.endpoint)
    welcome = quiet.hello("quiet")
    assert welcome.heartbeat_ms == 0  # watched through its pidfd and its connection
    quiet.call(p.Acquire(id=quiet.take_id()))
    quiet.next_notice(p.Grant)
    time.sleep(0.6)  # six heartbeat intervals without a word: still there
    assert "quiet" in sessions_by_name(d.status())
    with Client("waiter", endpoint=d.endpoint) as waiter:
        closed = time.monotonic()
        quiet.close()  # the process lives on; only the connection goes
        waiter.acquire(timeout=5)
        assert time.monotonic() - closed < 1.0
    assert "reason=disconnected" in d.log()
