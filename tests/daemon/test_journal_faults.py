"""The state journal under faults: a full disk while serving (no unjournalled stop,
a health event, a metric, clients told), a journal the daemon cannot use at start
(one line, exit status 74), and every kind of bad row or damaged file (the daemon
starts, keeps what is good, logs the rest, and boots never go back).

A full or read-only disk is a real tmpfs mounted for the test (tests run as root
here); where mounting is not allowed those tests skip and say why."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest

from client_lib import Client
from nodeagent import procwatch
from nodeagent.cli import EXIT_STATE_UNUSABLE
from nodeagent.journal import SCHEMA_VERSION, Journal
from tests.conftest import REPO, Daemon, wait_for, free_port
from tests.proc_tools import proc_state


# ------------------------------------------------------------------ a real full or read-only disk


def _mount_tmpfs(path: str, size: str) -> None:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0750", "tmpfs", path],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {done.stderr.strip()}")


def _umount(path: str) -> None:
    if subprocess.run(["umount", path], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", path], capture_output=True)  # a straggler still holds a file


@pytest.fixture
def state_tmpfs(workdir):
    """``workdir/state`` (the daemon's state dir in these tests) on a 2 MiB tmpfs of its own.
    Requested before the daemon fixtures, so it is unmounted after their daemons stopped."""
    path = os.path.join(workdir, "state")
    _mount_tmpfs(path, "2m")
    try:
        yield path
    finally:
        _umount(path)


def fill(directory: str) -> str:
    """Fill the filesystem of ``directory`` to the last byte; returns the filler file."""
    filler = os.path.join(directory, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


# ------------------------------------------------------------------ defect 7: full disk while serving


def test_a_stop_that_cannot_be_journalled_is_a_revoke_and_a_restart_leaves_nothing_stopped(
        state_tmpfs, cluster_node, spawn, start_daemon):  # noqa: F811
    mport = free_port()
    node = cluster_node("--grace-ms", "100", "--metrics-port", str(mport), health_interval_s=0.2)
    d = node.daemon
    events = node.subscriber(topics=(b"health",))
    events.wait_for(lambda e: e.kind == "health")  # subscribed: our event cannot be missed
    hog = spawn(d.endpoint, "stubborn", "--name", "hog")
    hog.expect("TICK", count=3)
    assert metric(mport, "nodeagent_journal_ok") == 1
    fill(state_tmpfs)

    with Client("infer", workload="inference", endpoint=d.endpoint) as infer:
        assert infer.durable is False  # its session could not be journalled, and it was told
        infer.acquire(timeout=5)  # the hog overran its yield: revoked, since a stop could not be journalled
        for _ in range(10):  # a SIGSTOP shows as T within a scheduling tick; it must never come
            assert proc_state(hog.proc.pid) != "T", "an unjournalled stop was sent"
            time.sleep(0.03)
        ticks = len(hog.events("TICK"))
        hog.expect("TICK", count=ticks + 3)  # it runs (without the token)
    assert "not stopping session" in d.log() and "action=revoke" in d.log()
    failed = events.wait_for(lambda e: e.data.get("journal") == "failed")
    assert "full" in str(failed.data.get("error"))
    assert metric(mport, "nodeagent_journal_ok") == 0, d.log()[-6000:]
    assert metric(mport, "nodeagent_journal_write_failures_total") >= 2  # the put of infer, the stop
    events.close()

    d.kill()  # SIGKILL while the disk is full; then space comes back and the daemon with it
    os.unlink(os.path.join(state_tmpfs, "filler"))
    d2 = start_daemon("--grace-ms", "100")
    assert d2.status().boot == 2
    assert proc_state(hog.proc.pid) != "T"
    ticks = len(hog.events("TICK"))
    hog.expect("TICK", count=ticks + 3)


def test_a_journal_that_recovers_makes_sessions_durable_again(state_tmpfs, start_daemon):
    d = start_daemon("--heartbeat-ms", "100")
    filler = fill(state_tmpfs)
    with Client("c", endpoint=d.endpoint) as c:
        assert c.durable is False
        os.unlink(filler)
        wait_for(lambda: c.durable, timeout=10)  # the daemon wrote it again; a heartbeat ack said so
    assert "writes succeed again" in d.log()


# ------------------------------------------------------------------ defect 7: a journal unusable at start


def _serve_once(workdir: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    config = os.path.join(workdir, "nodeagent.toml")
    if not os.path.exists(config):
        open(config, "w").close()
    return subprocess.run(
        [sys.executable, "-m", "nodeagent", "serve", "--config", config, "--backend", "cpu", "--ctxpool", "off",
         "--endpoint", f"ipc://{workdir}/agent.sock", "--state-dir", os.path.join(workdir, "state"),
         "--log-level", "error"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _make_full(workdir: str) -> None:
    fill(os.path.join(workdir, "state"))


def _make_read_only(workdir: str) -> None:
    subprocess.run(["mount", "-o", "remount,ro", os.path.join(workdir, "state")], check=True)


def _make_foreign(workdir: str) -> None:
    path = os.path.join(workdir, "state", "state.db")
    for suffix in ("", ".boot", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE accounts (id INTEGER)")
    raw.commit()
    raw.close()


def _make_newer(workdir: str) -> None:
    raw = sqlite3.connect(os.path.join(workdir, "state", "state.db"))
    raw.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()


@pytest.mark.parametrize("crash, spoil, says", [
    (False, _make_full, "free space"),
    (True, _make_full, "cannot record the boot"),  # the WAL and its index are there: the first write fails
    (False, _make_read_only, "read-only"),
    (False, _make_foreign, "not a nodeagent journal"),
    (False, _make_newer, "upgrade nodeagent"),
], ids=["full-disk", "full-disk-after-a-crash", "read-only", "not-a-journal", "newer-schema"])
def test_a_journal_it_cannot_use_ends_the_start_with_one_line_and_status_74(state_tmpfs, workdir, crash, spoil,
                                                                            says):
    _serve_once_until_ready(workdir, crash)
    spoil(workdir)
    done = _serve_once(workdir)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == EXIT_STATE_UNUSABLE == 74, done.stderr
    assert len(lines) == 1 and lines[0].startswith("nodeagent: error: "), done.stderr
    assert "Traceback" not in done.stderr and says in lines[0].lower(), lines[0]
    if spoil is _make_foreign:  # someone else's file is left alone
        raw = sqlite3.connect(os.path.join(workdir, "state", "state.db"))
        assert [r[0] for r in raw.execute("SELECT name FROM sqlite_master")] == ["accounts"]
        raw.close()


def _serve_once_until_ready(workdir: str, crash: bool) -> None:
    """Start the daemon on ``workdir`` (so that its state dir holds a journal), then SIGTERM (or SIGKILL) it."""
    d = Daemon(workdir, []).start()
    if crash:
        d.kill()
    else:
        assert d.stop() == 0


# ------------------------------------------------------------------ defect 8: bad rows, damaged files


def _good_rows(raw: sqlite3.Connection) -> None:
    """A policy and a restorable session (this test process) that must survive any bad neighbour."""
    raw.execute("INSERT OR REPLACE INTO policies (device, policy) VALUES (0, '{\"grace_ms\": 150.0}')")
    _insert_session(raw, "s-good", "good-row")


def _insert_session(raw: sqlite3.Connection, sid: str, name: str, **changes) -> None:
    values = dict(id=sid, key="k", name=name, claimed_pid=os.getpid(), verified_pid=os.getpid(),
                  start_ticks=procwatch.process_start_ticks(os.getpid()), uid=os.getuid(), workload="training",
                  weight=1.0, device=0, memory_mb=0, created_unix=time.time(), managed_pgid=None, stopped=0,
                  borrower=None)
    values.update(changes)
    raw.execute(f"INSERT INTO sessions ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                tuple(values.values()))


def _edit(db: str, *statements, good: bool = True, **session) -> None:
    """Hand edits, as an operator's sqlite3 shell would make them (closing checkpoints the WAL)."""
    raw = sqlite3.connect(db, isolation_level=None)
    try:
        if good:
            _good_rows(raw)
        if session:
            _insert_session(raw, "s-bad", "bad-row", **session)
        for statement in statements:
            raw.execute(statement)
    finally:
        raw.close()


def _corrupt_sessions_page(db: str) -> None:
    _edit(db)
    raw = sqlite3.connect(db)
    root = raw.execute("SELECT rootpage FROM sqlite_master WHERE name='sessions'").fetchone()[0]
    page = raw.execute("PRAGMA page_size").fetchone()[0]
    raw.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xde\xad\xbe\xef" * (page // 4))


def _garbage_wal(db: str) -> None:
    size = os.path.getsize(db + "-wal")
    assert size > 0  # the SIGKILLed daemon's last writes (its boot counter among them) are only there
    with open(db + "-wal", "r+b") as f:
        f.write(os.urandom(size))


def _zero_length(db: str) -> None:
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(db + suffix)
    os.truncate(db, 0)


BAD = {  # kind: (spoil the journal of a SIGKILLed daemon, what the log says, good rows kept)
    "bad-workload": (lambda db: _edit(db, workload="gpu-miner"), "workload 'gpu-miner'", True),
    "bad-weight": (lambda db: _edit(db, weight="heavy"), "weight 'heavy'", True),
    "non-json-policy": (lambda db: _edit(db, "INSERT INTO policies (device, policy) VALUES (1, '{oops')"),
                        "skip policy row device=1", True),
    "non-integer-boot": (lambda db: _edit(db, "UPDATE meta SET value='one' WHERE key='boot'"),
                         "boot counter 'one'", True),
    "corrupted-page": (_corrupt_sessions_page, "DAMAGED journal", "policy"),
    "garbage-wal": (_garbage_wal, "is not a valid SQLite WAL", False),
    "zero-length-db": (_zero_length, "lost writes", False),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_rows_and_damaged_files_never_stop_the_start_nor_send_boots_back(start_daemon, workdir, kind):
    spoil, logged, kept = BAD[kind]
    args = ("--heartbeat-ms", "100")
    d = start_daemon(*args)
    with Client("first", endpoint=d.endpoint) as c:
        first_grant = c.acquire(timeout=5)
    assert d.status().boot == 1
    d.kill()  # SIGKILL: the WAL keeps the last writes
    spoil(os.path.join(workdir, "state", "state.db"))

    d2 = start_daemon(*args)  # starts: no traceback, no refusal
    assert logged in d2.log(), d2.log()
    assert "Traceback" not in d2.log()
    assert d2.status().boot == 2
    assert f"[restore] boot=2 restored={1 if kept is True else 0} " in d2.log()  # the good session row
    with Client("second", endpoint=d2.endpoint) as c:
        assert c.acquire(timeout=5) > first_grant  # grant ids are never reused
        assert (c.welcome.grace_ms == 150.0) == bool(kept)  # the good policy row survived


def test_a_stopped_process_of_a_bad_row_is_continued(start_daemon, workdir):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        d = start_daemon()
        d.kill()
        os.kill(sleeper.pid, signal.SIGSTOP)
        wait_for(lambda: proc_state(sleeper.pid) == "T")
        _edit(os.path.join(workdir, "state", "state.db"), good=False, weight=-1.0, stopped=1,
              verified_pid=sleeper.pid, start_ticks=procwatch.process_start_ticks(sleeper.pid))
        d2 = start_daemon()
        wait_for(lambda: proc_state(sleeper.pid) != "T")
        assert "continued pid=%d" % sleeper.pid in d2.log()
    finally:
        sleeper.kill()
        sleeper.wait()


# ------------------------------------------------------------------ the journal alone (no daemon)


def test_bad_rows_are_skipped_and_the_rest_kept(tmp_path, caplog):
    path = str(tmp_path / "state.db")
    with Journal(path) as j:
        j.next_boot()
    raw = sqlite3.connect(path, isolation_level=None)
    _insert_session(raw, "s-ok", "ok")
    for i, change in enumerate([dict(workload=7), dict(weight=0), dict(weight=b"\x00"),
                                dict(device=-1), dict(verified_pid=2**40), dict(stopped=2), dict(key="")]):
        _insert_session(raw, f"s-bad{i}", "bad", **change)
    raw.execute("INSERT INTO policies VALUES (0, '{\"grace_ms\": 10}'), (1, '[1, 2]'), (2, 'nope')")
    raw.execute("INSERT INTO device_states VALUES (0, 'FREE', '{}'), (1, 'LENT', 'nope')")
    raw.execute("INSERT INTO models VALUES ('m', 'a:b', NULL, NULL, 'nope', x'00', 1.0, NULL)")
    raw.close()
    with Journal(path) as j:
        good, bad = j.read_sessions()
        assert [r.id for r in good] == ["s-ok"] and len(bad) == 7
        assert caplog.text.count("skip session row") == 7  # each logged, with what is wrong
        assert "workload '7'" in caplog.text and "verified_pid 1099511627776" in caplog.text
        assert j.policies() == {0: {"grace_ms": 10}}
        assert j.device_states() == {0: ("FREE", {})}
        assert j.models() == []
        j.delete_session_row(bad[0].seq)
        assert len(j.read_sessions()[1]) == 6


def test_the_boot_counter_never_goes_back(tmp_path):
    path = str(tmp_path / "state.db")
    with Journal(path) as j:
        assert [j.next_boot() for _ in range(3)] == [1, 2, 3]
    assert open(path + ".boot").read() == "3\n"
    raw = sqlite3.connect(path)
    raw.execute("UPDATE meta SET value='1' WHERE key='boot'")  # an older copy of the journal put back
    raw.commit()
    raw.close()
    with Journal(path) as j:
        assert j.next_boot() == 4
    with open(path + ".boot", "w") as f:
        f.write("garbage")  # a side file that is no use: the journal's own counter still holds
    with Journal(path) as j:
        assert j.next_boot() == 5


def test_a_boot_counter_that_cannot_be_saved_refuses_the_boot(tmp_path):
    path = str(tmp_path / "state.db")
    os.makedirs(path + ".boot")  # the side file's name is taken by a directory: it cannot be written
    with Journal(path) as j:
        with pytest.raises(Exception, match="boot counter file"):
            j.next_boot()


@pytest.mark.parametrize("stored", ["²", "١٢", " 3x", "-1"])
def test_a_boot_counter_of_digits_int_cannot_read_is_not_a_boot_number(tmp_path, stored):
    # "²".isdigit() holds but int("²") raises: such a hand-edited row must be logged, not crash the start
    path = str(tmp_path / "state.db")
    with Journal(path) as j:
        assert j.next_boot() == 1
        j.put_meta("boot", stored)
    os.unlink(path + ".boot")
    with Journal(path) as j:
        assert j.next_boot() == 1
