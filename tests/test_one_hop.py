"""One-hop handoffs (nodeagent/daemon/one_hop.py): a holder told who is next wakes
it through its wake channel; the daemon's promise makes every other ending of the
slice give the same answer. Real daemon, real clients and processes."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from client_lib import Client
from client_lib import protocol as p
from tests.conftest import wait_for


def _waiter(client: Client, timeout: float = 10.0):
    """``client.acquire()`` in a thread; returns (thread, result dict)."""
    out: dict = {}

    def run() -> None:
        try:
            out["grant"] = client.acquire(timeout=timeout)
            out["at"] = time.monotonic()
        except Exception as exc:  # surfaced by the test's assertions
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _hinted(holder: Client) -> bool:
    """True once ``holder`` has heard who comes next (reads its socket)."""
    holder.holding  # noqa: B018 - the property reads what the daemon sent
    return holder._wake.hint is not None and holder._wake.hint[1] is not None


@pytest.fixture
def patient_daemon(start_inproc_daemon):
    """Slices long enough that no holder here is asked to yield while a test sleeps, and
    enforcement by revoke: the holders are this process, which must never be stopped."""
    return start_inproc_daemon("--quantum-ms", "inference=10000", "--quantum-ms", "training=10000", "--enforce", "revoke",
                               "--grace-ms", "2000")


def _holder(patient_daemon) -> str | None:
    return patient_daemon.status().devices[0].holder


def _hand_on_alone(holder: Client, grant: int) -> None:
    """``holder``'s release, with its wake word written well before the daemon hears of it: a
    successor that reads its notices before its wake channel takes the word, not the daemon's
    copy, only when the word comes first."""
    hint = holder._wake.hint
    assert hint is not None and hint[0] == grant
    holder._wake.hand_on(hint)
    time.sleep(0.2)
    holder._send_quiet(p.Release(id=holder._take_id(), grant=grant, quiet=True, handed=hint[1]))
    holder._grant = None


def test_a_release_wakes_the_next_holder_through_its_wake_channel(patient_daemon):
    a = Client("a", endpoint=patient_daemon.endpoint, one_hop=True)
    b = Client("b", endpoint=patient_daemon.endpoint, one_hop=True)
    wake_dir = os.path.join(os.path.dirname(patient_daemon.socket_path), "wake")
    for c in (a, b):
        assert os.path.dirname(c.welcome.wake) == wake_dir
        mode = os.stat(c.welcome.wake).st_mode
        # The session's user reads; under a root daemon the socket's group may write (a per-user one: its user alone).
        assert stat.S_ISFIFO(mode) and stat.S_IMODE(mode) == (0o620 if os.geteuid() == 0 else 0o600)
    grant = a.acquire()
    thread, out = _waiter(b)
    wait_for(lambda: _hinted(a))
    assert a._wake.hint[1] == grant + 1
    a.release()
    thread.join(5)
    assert out.get("grant") == grant + 1, out
    assert a.handed_on == 1  # the word was written whole to b's FIFO
    wait_for(lambda: _holder(patient_daemon) == b.session_id)
    # Back and forth: every handoff of the pair goes one hop, and the daemon agrees on every holder.
    for n in range(2, 6):
        thread, out = _waiter(a)
        wait_for(lambda: _hinted(b))
        b.release()
        thread.join(5)
        a, b = b, a
        assert out.get("grant") == grant + n, out
        wait_for(lambda: _holder(patient_daemon) == b.session_id)
    assert a.handed_on + b.handed_on == 5
    # Each word was written before the daemon heard the release, so b takes it first unless
    # it was descheduled until the daemon's grant had come too (notices are read first): on a
    # loaded machine that can happen now and then, never on all five handoffs.
    assert a.woken + b.woken >= 3, (a.woken, b.woken)
    path = b.welcome.wake
    b.close()
    wait_for(lambda: not os.path.exists(path))  # a session's channel goes with it
    a.close()


def test_a_client_that_does_not_ask_keeps_the_two_hop_path(patient_daemon):
    a = Client("a", endpoint=patient_daemon.endpoint, one_hop=False)
    b = Client("b", endpoint=patient_daemon.endpoint, one_hop=True)
    c = Client("c", endpoint=patient_daemon.endpoint, one_hop=False)
    assert a.welcome.wake == "" and c.welcome.wake == ""
    grant = a.acquire()
    thread, out = _waiter(b)
    time.sleep(0.2)
    a.release()  # a holder that did not ask hears of no successor: the daemon grants
    thread.join(5)
    assert out.get("grant") == grant + 1 and b.woken == 0 and a._wake.hint is None
    thread, out = _waiter(c)
    time.sleep(0.2)
    assert b._wake.hint is None  # nor is a waiter without a channel promised anything
    b.release()
    thread.join(5)
    assert out.get("grant") == grant + 2 and b.handed_on == 0
    for client in (a, b, c):
        client.close()


def test_stale_wake_channels_are_removed_at_start(start_daemon, workdir):
    wake_dir = os.path.join(workdir, "wake")
    os.makedirs(wake_dir)
    stale = os.path.join(wake_dir, "s-0123456789ab")
    os.mkfifo(stale)
    d = start_daemon()
    assert not os.path.exists(stale)
    with Client("a", endpoint=d.endpoint, one_hop=True) as a:
        assert os.path.exists(a.welcome.wake)


def test_forged_and_replayed_wake_words_are_ignored(patient_daemon):
    a = Client("a", endpoint=patient_daemon.endpoint, one_hop=True)
    b = Client("b", endpoint=patient_daemon.endpoint, one_hop=True)
    first = a.acquire()
    thread, out = _waiter(b)
    wait_for(lambda: _hinted(a))
    promised, secret = b._wake.standby
    # Anyone who may open the FIFO can write to it; none of these is the word of b's promise.
    with open(b.welcome.wake, "wb", buffering=0) as fifo:
        fifo.write(p.wake_word(os.urandom(16), promised))  # a guessed secret
        fifo.write(p.wake_word(secret, promised + 1))  # the right secret, another grant
        fifo.write(b"x" * 7)  # misaligns whatever follows
    time.sleep(0.3)
    assert "grant" not in out and b.woken == 0
    assert _holder(patient_daemon) == a.session_id
    _hand_on_alone(a, first)  # the real word still gets through, after the junk
    thread.join(5)
    assert out.get("grant") == promised == first + 1 and (a.handed_on, b.woken) == (1, 1), (a.handed_on, b._wake.tail)
    b.release()
    # Replayed later, while b waits again (behind a), the old word is nobody's promise.
    a.acquire()
    thread, out = _waiter(b)
    wait_for(lambda: _hinted(a))
    with open(b.welcome.wake, "wb", buffering=0) as fifo:
        fifo.write(p.wake_word(secret, promised))
    time.sleep(0.3)
    assert "grant" not in out and _holder(patient_daemon) == a.session_id
    _hand_on_alone(a, first + 2)
    thread.join(5)
    assert out.get("grant") == first + 3 and b.woken == 2
    a.close()
    b.close()


def test_a_successor_that_woke_before_the_withdrawal_holds_and_inference_waits_for_it(patient_daemon):
    """The holder handed on before a higher class came: the successor had woken, says so when
    the promise is withdrawn, and holds the promised grant; inference waits for it to give way."""
    a = Client("a", endpoint=patient_daemon.endpoint, one_hop=True)
    b = Client("b", endpoint=patient_daemon.endpoint, one_hop=True)
    infer = Client("i", workload="inference", endpoint=patient_daemon.endpoint, one_hop=True)
    grant = a.acquire()
    b.request()
    wait_for(lambda: _hinted(a))
    wait_for(lambda: b._pump(0) or b._wake.standby is not None)
    hint = a._wake.hint
    assert a._wake.hand_on(hint) == hint[1]  # the word, before anything else happens
    wait_for(lambda: b._pump(10) or b.holding)  # b reads it: it holds
    assert b._grant == hint[1] and b.woken == 1
    i_thread, i_out = _waiter(infer)
    wait_for(lambda: b._pump(10) or b.yield_requested or not b.holding or _answered(patient_daemon))
    a._send_quiet(p.Release(id=a._take_id(), grant=grant, quiet=True, handed=hint[1]))
    a._grant = None
    wait_for(lambda: _holder(patient_daemon) == b.session_id)  # the promise was kept: b holds its grant
    assert "grant" not in i_out
    wait_for(lambda: b.yield_requested)  # and gives way to inference at once
    b.release()
    i_thread.join(5)
    assert i_out.get("grant") is not None and i_out["grant"] != hint[1]
    for client in (a, b, infer):
        client.close()


def test_a_successor_told_of_the_withdrawal_first_never_wakes_on_a_late_word(patient_daemon):
    """Issue 21, break 2: the holder writes its successor's word after the promise was
    withdrawn (a lying or late holder) and releases without handing: the successor, which
    answered the withdrawal first, ignores the word, and inference alone holds."""
    a = Client("a", endpoint=patient_daemon.endpoint, one_hop=True)
    b = Client("b", endpoint=patient_daemon.endpoint, one_hop=True)
    infer = Client("i", workload="inference", endpoint=patient_daemon.endpoint, one_hop=True)
    grant = a.acquire()
    b_thread, b_out = _waiter(b)
    wait_for(lambda: _hinted(a))
    hint = a._wake.hint  # what a liar keeps: the successor's channel, secret and promised grant
    i_thread, i_out = _waiter(infer)
    _await_answer(patient_daemon)  # b heard the withdrawal and answered: not woken
    assert a._wake.hand_on(hint) == hint[1]  # the word anyway
    a._send_quiet(p.Release(id=a._take_id(), grant=grant, quiet=True, handed=None))
    a._grant = None
    i_thread.join(5)
    assert i_out.get("grant") is not None and i_out["grant"] != hint[1]
    time.sleep(0.3)
    assert "grant" not in b_out and b.woken == 0 and b._grant is None  # one holder: inference
    assert _holder(patient_daemon) == infer.session_id
    infer.release()
    b_thread.join(5)
    assert b_out.get("grant") not in (None, hint[1])  # b's turn comes under a new grant
    for client in (a, b, infer):
        client.close()


def test_a_holder_that_reads_the_withdrawal_releases_to_the_new_first_in_line(patient_daemon):
    a = Client("a", endpoint=patient_daemon.endpoint, one_hop=True)
    b = Client("b", endpoint=patient_daemon.endpoint, one_hop=True)
    infer = Client("i", workload="inference", endpoint=patient_daemon.endpoint, one_hop=True)
    a.acquire()
    b_thread, b_out = _waiter(b)
    wait_for(lambda: _hinted(a))
    i_thread, i_out = _waiter(infer)
    wait_for(lambda: a.yield_requested)  # read: the withdrawal came first, then the yield request
    a.release()  # to inference: handed on one hop if the daemon already named it, else two
    i_thread.join(5)
    assert i_out.get("grant") is not None and b.woken == 0
    assert "grant" not in b_out  # b waits behind inference
    infer.release()
    b_thread.join(5)
    assert b_out.get("grant") is not None
    for client in (a, b, infer):
        client.close()


def _answered(patient_daemon) -> bool:
    """True once the daemon logged a successor's answer to a withdrawal."""
    return "[one-hop] answered" in patient_daemon.log()


def _await_answer(patient_daemon, timeout: float = 1.0) -> None:
    """Wait for a successor's answer to a withdrawal, but carry on without one after ``timeout``
    (a daemon that asks for none, as before issue 21, must fail on the overlap, not here)."""
    deadline = time.monotonic() + timeout
    while not _answered(patient_daemon) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.slow
def test_a_promise_binds_when_the_holder_is_enforced_or_dies(start_daemon, spawn):
    """A holder that never reads its socket may have written the FIFO before it was stopped
    or died. A promise withdrawn meanwhile (inference came first) is settled by the successor's
    answer: it had not woken, so inference gets the token at the holder's deadline and the
    successor waits. A promise still out when the holder dies is kept: the successor gets it."""
    d = start_daemon("--grace-ms", "100", "--quantum-ms", "training=100", "--enforce", "revoke")
    holder = spawn(d.endpoint, "hold", "--name", "holder", "--one-hop")
    holder.expect("GRANT")
    b = Client("b", endpoint=d.endpoint, one_hop=True)
    b_thread, b_out = _waiter(b)
    wait_for(lambda: d.status().devices[0].queue == [b.session_id])
    time.sleep(0.1)  # the hint went to the holder (unread)
    infer = Client("i", workload="inference", endpoint=d.endpoint, one_hop=True)
    i_thread, i_out = _waiter(infer)
    i_thread.join(5)  # the holder is revoked at its deadline; b answered that it had not woken
    assert "grant" in i_out, i_out
    assert "grant" not in b_out and b.woken == 0
    rows = {s.id: s for s in d.status().devices[0].sessions}
    assert sum(1 for s in rows.values() if s.state in ("holding", "yielding")) == 1
    infer.release()
    b_thread.join(5)
    assert "grant" in b_out
    b.release()
    # The same when the holder dies with a promise out.
    b.acquire()
    other = spawn(d.endpoint, "hold", "--name", "other", "--one-hop")  # waits behind b
    wait_for(lambda: d.status().devices[0].queue)
    b.release()
    other.expect("GRANT")
    c = Client("c", endpoint=d.endpoint, one_hop=True)
    c_thread, c_out = _waiter(c)
    wait_for(lambda: d.status().devices[0].queue == [c.session_id])
    time.sleep(0.1)
    other.kill()
    c_thread.join(5)
    assert "grant" in c_out
    for client in (b, infer, c):
        client.close()
    holder.kill()


def test_a_woken_successors_release_that_overtakes_its_holders_is_kept_for_its_grant(patient_daemon):
    """Two connections, no order between them: the successor, woken, may finish and release
    before the daemon reads the holder's release. That release is kept for the grant (and an
    acquire after it requeues), never dropped as "not the holder", which left the daemon
    granting a slice the client had already given back."""
    a = Client("a", endpoint=patient_daemon.endpoint, one_hop=True)
    b = Client("b", endpoint=patient_daemon.endpoint, one_hop=True)
    grant = a.acquire()
    thread, out = _waiter(b)
    wait_for(lambda: _hinted(a))
    hint = a._wake.hint
    assert a._wake.hand_on(hint) == grant + 1  # a wakes b ...
    thread.join(5)
    assert out.get("grant") == grant + 1
    b.release()  # ... b is done at once, and asks again, before the daemon has heard from a
    b.request()
    time.sleep(0.1)
    assert _holder(patient_daemon) == a.session_id  # nothing was done to a on b's word
    a._send_quiet(p.Release(id=a._take_id(), grant=grant, quiet=True, handed=grant + 1))
    a._grant = None
    # b's slice grant+1 begins and ends at once; its second request gets grant+2.
    wait_for(lambda: b.holding)
    assert b._grant == grant + 2
    wait_for(lambda: _holder(patient_daemon) == b.session_id)
    b.release()
    wait_for(lambda: _holder(patient_daemon) is None)
    a.close()
    b.close()


def test_a_tcp_peer_gets_no_wake_channel(start_daemon):
    """Over tcp the daemon cannot tell who a peer is, and has no socket directory: it makes
    no FIFO for anyone (a file it would create for an unknown user), and asking for one-hop
    handoffs there still gets the token, in two hops."""
    from tests.test_enforce import _free_port
    d = start_daemon(endpoint=f"tcp://127.0.0.1:{_free_port()}")
    with Client("remote", endpoint=d.endpoint, one_hop=True) as c:
        assert c.welcome.wake == ""
        assert c.acquire(timeout=5)
    assert not os.path.exists(os.path.join(d.workdir, "wake")) or not os.listdir(os.path.join(d.workdir, "wake"))


def test_the_default_asks_for_one_hop_where_there_are_cores_to_spare(patient_daemon, monkeypatch):
    """Measured: one-hop wins on 16 cores and loses on 2 (docs/architecture.md, One-hop
    handoffs). NODEAGENT_ONE_HOP overrides; a value it does not know is an error, not a guess."""
    from client_lib import client as client_mod

    monkeypatch.delenv(client_mod.ENV_ONE_HOP, raising=False)
    for cpus, expected in ((2, False), (client_mod.ONE_HOP_MIN_CPUS - 1, False), (client_mod.ONE_HOP_MIN_CPUS, True),
                           (16, True)):
        monkeypatch.setattr(client_mod, "usable_cpus", lambda cpus=cpus: cpus)
        with Client("auto", endpoint=patient_daemon.endpoint) as c:
            assert c.one_hop is expected and (c.welcome.wake != "") is expected, cpus
    monkeypatch.setattr(client_mod, "usable_cpus", lambda: 2)
    for value, expected in (("1", True), ("on", True), ("0", False), ("auto", False)):
        monkeypatch.setenv(client_mod.ENV_ONE_HOP, value)
        assert client_mod.one_hop_default() is expected, value
    monkeypatch.setenv(client_mod.ENV_ONE_HOP, "0")
    with Client("told", endpoint=patient_daemon.endpoint, one_hop=True) as c:  # an explicit choice wins
        assert c.one_hop is True
    monkeypatch.setenv(client_mod.ENV_ONE_HOP, "maybe")
    with pytest.raises(ValueError, match="NODEAGENT_ONE_HOP must be 1, 0 or auto, got 'maybe'"):
        Client("bad", endpoint=patient_daemon.endpoint)


def test_usable_cpus_counts_the_affinity_mask_capped_by_a_cgroup_quota(tmp_path):
    from client_lib.client import usable_cpus

    mask = len(os.sched_getaffinity(0))
    assert 1 <= usable_cpus() <= mask
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu:/old-v1-line\n0::/jobs/trainer\n")
    quota = tmp_path / "root" / "jobs" / "trainer" / "cpu.max"
    quota.parent.mkdir(parents=True)
    for text, expected in (("150000 100000\n", min(mask, 2)), ("50000 100000\n", 1), ("max 100000\n", mask),
                           ("garbage\n", mask)):
        quota.write_text(text)
        assert usable_cpus(str(proc), str(tmp_path / "root")) == expected, text
    quota.unlink()  # no quota file (cgroup v1, or no cpu controller): the mask
    assert usable_cpus(str(proc), str(tmp_path / "root")) == mask


def test_a_successor_suspended_while_promised_never_holds_beside_the_next(patient_daemon):
    """Issue 21, break 1: root suspends the promised successor, then the holder releases
    having written its word. The suspended client stopped listening and said so; the
    daemon, which waited for that answer, grants the next waiter a new grant id."""
    from client_lib import resume_session, suspend_session
    h = Client("h", endpoint=patient_daemon.endpoint, one_hop=True)
    s = Client("s", endpoint=patient_daemon.endpoint, one_hop=True)
    x = Client("x", endpoint=patient_daemon.endpoint, one_hop=True)
    grant = h.acquire()
    s_thread, s_out = _waiter(s)
    wait_for(lambda: _hinted(h))
    x_thread, x_out = _waiter(x)
    wait_for(lambda: patient_daemon.status().devices[0].queue == [s.session_id, x.session_id])
    hint = h._wake.hint
    suspended: dict = {}
    suspender = threading.Thread(target=lambda: suspended.update(
        result=suspend_session(s.session_id, 5000, endpoint=patient_daemon.endpoint)), daemon=True)
    suspender.start()
    _await_answer(patient_daemon)  # s answered the withdrawal: it had not woken
    # The holder had not read its withdrawal: the word anyway (None: s closed its channel when
    # it was suspended, so there is no reader to write to: as good).
    assert h._wake.hand_on(hint) in (None, hint[1])
    h._send_quiet(p.Release(id=h._take_id(), grant=grant, quiet=True, handed=hint[1]))
    h._grant = None
    x_thread.join(5)
    assert x_out.get("grant") is not None and x_out["grant"] != hint[1]
    time.sleep(0.3)
    assert s._grant is None and s.woken == 0 and "grant" not in s_out  # one holder: x
    suspender.join(5)
    assert suspended["result"].outcome == "suspended"
    x.release()
    resume_session(s.session_id, endpoint=patient_daemon.endpoint)
    s_thread.join(5)
    assert s_out.get("grant") not in (None, hint[1], x_out["grant"])
    for client in (h, s, x):
        client.close()
