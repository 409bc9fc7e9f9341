"""The SQLite journal: round trips, replace/delete semantics, the boot counter,
durability across SIGKILL, and the clear errors for files it must not use."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nodeagent import journal as journal_mod
from nodeagent.journal import SCHEMA_VERSION, Journal, JournalError, SessionRecord

REPO = Path(__file__).resolve().parent.parent.parent


def record(session_id: str = "s-1", **changes) -> SessionRecord:
    values = dict(id=session_id, key="k-" + session_id, name="svc " + session_id, claimed_pid=1234,
                  verified_pid=1234, start_ticks=998877, uid=1000, workload="inference", weight=2.5,
                  device=1, memory_mb=4096, created_unix=1_700_000_000.25)
    values.update(changes)
    return SessionRecord(**values)


@pytest.fixture
def db_path(tmp_path: Path) -> str:
    return str(tmp_path / "state" / "state.db")


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# --- round trips ---------------------------------------------------------------


def test_session_round_trip_every_field_survives_reopen(db_path: str) -> None:
    full = record("s-full", managed_pgid=4321, stopped=True)
    sparse = record("s-tcp", verified_pid=None, start_ticks=None, uid=None, workload="best-effort")
    with Journal(db_path) as j:
        j.put_session(full)
        j.put_session(sparse)
    with Journal(db_path) as j:
        got = j.read_sessions()[0]
    assert got == [full, sparse]
    assert got[0].stopped is True and got[1].stopped is False
    assert got[1].managed_pgid is None


def test_replace_keeps_creation_order_and_takes_new_values(db_path: str) -> None:
    with Journal(db_path) as j:
        for i, sid in enumerate(["s-a", "s-b", "s-c"]):
            j.put_session(record(sid, created_unix=1000.0 + i))
        j.put_session(record("s-b", created_unix=1001.0, name="renamed", weight=7.0))
        got = j.read_sessions()[0]
    assert [r.id for r in got] == ["s-a", "s-b", "s-c"]
    assert (got[1].name, got[1].weight) == ("renamed", 7.0)


def test_delete_session_and_deleting_an_absent_one_is_quiet(db_path: str) -> None:
    with Journal(db_path) as j:
        j.put_session(record("s-a"))
        j.put_session(record("s-b"))
        j.delete_session("s-a")
        j.delete_session("s-a")
        j.delete_session("s-never")
    with Journal(db_path) as j:
        assert [r.id for r in j.read_sessions()[0]] == ["s-b"]


def test_set_stopped_persists_and_unknown_session_is_a_key_error(db_path: str) -> None:
    with Journal(db_path) as j:
        j.put_session(record("s-a"))
        j.set_stopped("s-a", True)
    with Journal(db_path) as j:
        assert j.read_sessions()[0][0].stopped is True
        j.set_stopped("s-a", False)
        assert j.read_sessions()[0][0].stopped is False
        with pytest.raises(KeyError, match="s-gone"):
            j.set_stopped("s-gone", True)


def test_policies_round_trip_and_replace_per_device(db_path: str) -> None:
    with Journal(db_path) as j:
        j.put_policy(0, {"quantum_ms": 20, "classes": {"inference": [1, 2]}})
        j.put_policy(1, {"quantum_ms": 50})
        j.put_policy(0, {"quantum_ms": 10, "preempt": True})
    with Journal(db_path) as j:
        assert j.policies() == {0: {"quantum_ms": 10, "preempt": True}, 1: {"quantum_ms": 50}}


def test_device_states_round_trip_none_detail_reads_back_empty(db_path: str) -> None:
    with Journal(db_path) as j:
        j.put_device_state(0, "FREE")
        j.put_device_state(1, "LENT", {"to": "node-7", "until_unix": 1.5})
        j.put_device_state(0, "DRAINING", {"sessions": ["s-a"]})
    with Journal(db_path) as j:
        assert j.device_states() == {0: ("DRAINING", {"sessions": ["s-a"]}),
                                     1: ("LENT", {"to": "node-7", "until_unix": 1.5})}
        j.put_device_state(2, "RUN", None)
        assert j.device_states()[2] == ("RUN", {})


def test_meta_round_trip_default_and_replace(db_path: str) -> None:
    with Journal(db_path) as j:
        assert j.get_meta("owner") is None
        assert j.get_meta("owner", "nobody") == "nobody"
        j.put_meta("owner", "a")
        j.put_meta("owner", "b")
    with Journal(db_path) as j:
        assert j.get_meta("owner", "nobody") == "b"


def test_next_boot_starts_at_one_and_increments_across_reopen(db_path: str) -> None:
    with Journal(db_path) as j:
        assert j.next_boot() == 1
        assert j.next_boot() == 2
    with Journal(db_path) as j:
        assert j.next_boot() == 3


def test_a_failed_write_rolls_back_and_leaves_the_journal_usable(db_path: str) -> None:
    with Journal(db_path) as j:
        j.put_meta("boot", str(journal_mod.repair.MAX_BOOT))
        with pytest.raises(JournalError, match="used up"):
            j.next_boot()  # fails inside its transaction
        assert j.get_meta("boot") == str(journal_mod.repair.MAX_BOOT)
        j.put_meta("boot", "41")
        assert j.next_boot() == 42
    with Journal(db_path) as j:
        assert j.get_meta("boot") == "42"


# --- durability ----------------------------------------------------------------

_WRITER = textwrap.dedent("""
    import sys, time
    from nodeagent.journal import Journal, SessionRecord
    j = Journal(sys.argv[1])
    for i in range(int(sys.argv[2])):
        j.put_session(SessionRecord(id=f"s-{i}", key="k", name="n", claimed_pid=i, verified_pid=None,
                                    start_ticks=None, uid=None, workload="training", weight=1.0,
                                    device=0, memory_mb=0, created_unix=float(i)))
    j.put_policy(0, {"quantum_ms": 25})
    print("WRITTEN", flush=True)
    time.sleep(60)
""")


def test_committed_writes_survive_sigkill_of_the_writer(db_path: str) -> None:
    n = 40
    child = subprocess.Popen([sys.executable, "-c", _WRITER, db_path, str(n)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "WRITTEN"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL  # killed with the journal open, not a clean exit
    with Journal(db_path) as j:
        assert [r.id for r in j.read_sessions()[0]] == [f"s-{i}" for i in range(n)]
        assert j.policies() == {0: {"quantum_ms": 25}}


def test_wal_and_full_sync_are_in_force(db_path: str) -> None:
    """SIGKILL alone cannot tell FULL from OFF (the page cache survives); pin the choice."""
    with Journal(db_path) as j:
        assert j._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    other = sqlite3.connect(db_path)
    try:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
    finally:
        other.close()


# --- files it must refuse, and failures ----------------------------------------


def test_schema_from_a_newer_nodeagent_is_refused_naming_both_versions(db_path: str) -> None:
    Journal(db_path).close()
    raw = sqlite3.connect(db_path)
    raw.execute(f"PRAGMA user_version={SCHEMA_VERSION + 6}")
    raw.close()
    with pytest.raises(JournalError) as info:
        Journal(db_path)
    message = str(info.value)
    assert f"schema version {SCHEMA_VERSION + 6}" in message
    assert f"understands up to {SCHEMA_VERSION}" in message
    assert "upgrade nodeagent" in message


def test_garbage_file_is_moved_aside_and_a_fresh_journal_started(db_path: str, caplog) -> None:
    """Decision: damage is set aside, not refused (a daemon that will not start leaves every
    client unmanaged); the file is kept for the operator, and the log says where."""
    os.makedirs(os.path.dirname(db_path))
    garbage = b"this is not sqlite\x00" * 512
    with open(db_path, "wb") as f:
        f.write(garbage)
    with Journal(db_path) as j:
        assert j.read_sessions()[0] == [] and j.moved_aside is not None
        assert Path(j.moved_aside).read_bytes() == garbage
        assert os.path.dirname(j.moved_aside) == os.path.dirname(db_path)
    assert "DAMAGED journal" in caplog.text and j.moved_aside in caplog.text


def test_someone_elses_sqlite_file_is_refused_and_left_alone(db_path: str) -> None:
    os.makedirs(os.path.dirname(db_path))
    raw = sqlite3.connect(db_path)
    raw.execute("CREATE TABLE accounts (id INTEGER)")
    raw.commit()
    raw.close()
    with pytest.raises(JournalError, match="not a nodeagent journal") as info:
        Journal(db_path)
    assert db_path in str(info.value)
    raw = sqlite3.connect(db_path)
    assert [r[0] for r in raw.execute("SELECT name FROM sqlite_master")] == ["accounts"]
    raw.close()


def test_older_schema_is_migrated_and_a_failed_step_changes_nothing(db_path: str, monkeypatch) -> None:
    with Journal(db_path) as j:
        j.put_meta("owner", "a")
    steps = journal_mod._MIGRATIONS
    monkeypatch.setattr(journal_mod, "_MIGRATIONS", steps + [("ALTER TABLE meta ADD COLUMN x", "NOT SQL")])
    monkeypatch.setattr(journal_mod, "SCHEMA_VERSION", len(steps) + 1)
    with pytest.raises(JournalError, match=db_path):
        Journal(db_path)
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == len(steps)
    assert [r[1] for r in raw.execute("PRAGMA table_info(meta)")] == ["key", "value"]  # ALTER rolled back
    raw.close()

    monkeypatch.setattr(journal_mod, "_MIGRATIONS", steps + [("ALTER TABLE meta ADD COLUMN x",)])
    with Journal(db_path) as j:
        assert j.get_meta("owner") == "a"
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == len(steps) + 1
    raw.close()


def test_opening_logs_one_info_line_new_migrated_or_current(db_path: str, monkeypatch, caplog) -> None:
    """A brand-new journal is made by every migration from 0: one line says so, not one per step."""
    def info_lines() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.name == journal_mod.log.name and r.levelname == "INFO"]
        caplog.clear()
        return lines
    caplog.set_level("INFO", logger=journal_mod.log.name)
    with Journal(db_path):
        pass
    [created] = info_lines()
    assert created.startswith(f"[journal] created path={db_path} schema={SCHEMA_VERSION} ")
    with Journal(db_path):
        pass
    assert [line.split(" journal_mode")[0] for line in info_lines()] == \
        [f"[journal] open path={db_path} schema={SCHEMA_VERSION}"]
    monkeypatch.setattr(journal_mod, "_MIGRATIONS", journal_mod._MIGRATIONS + [("ALTER TABLE meta ADD COLUMN x",)])
    monkeypatch.setattr(journal_mod, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with Journal(db_path):
        pass
    [migrated] = info_lines()
    assert f"schema={SCHEMA_VERSION + 1} migrated_from={SCHEMA_VERSION} " in migrated


def test_a_locked_database_is_a_journal_error_and_the_journal_recovers(db_path: str, monkeypatch) -> None:
    monkeypatch.setattr(journal_mod, "_BUSY_TIMEOUT_S", 0.05)
    with Journal(db_path) as j:
        other = sqlite3.connect(db_path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(JournalError, match=db_path):
            j.put_meta("k", "v")
        other.execute("ROLLBACK")
        other.close()
        j.put_meta("k", "v2")  # no transaction or lock left behind by the failure
        assert j.get_meta("k") == "v2"


def test_closed_journal_raises_journal_error(db_path: str) -> None:
    j = Journal(db_path)
    j.close()
    j.close()
    with pytest.raises(JournalError, match="closed"):
        j.read_sessions()[0]


def test_file_and_its_wal_are_0600_even_with_a_permissive_umask(db_path: str) -> None:
    old = os.umask(0)
    try:
        with Journal(db_path) as j:
            j.put_meta("k", "v")
            for suffix in ("", "-wal", "-shm"):
                assert mode_of(db_path + suffix) == 0o600, suffix
    finally:
        os.umask(old)


def test_a_looser_existing_file_is_tightened_to_0600(db_path: str) -> None:
    Journal(db_path).close()
    os.chmod(db_path, 0o644)
    Journal(db_path).close()
    assert mode_of(db_path) == 0o600


def test_missing_parent_directories_are_created_private(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.db"
    with Journal(str(path)) as j:
        j.put_meta("k", "v")
    assert path.is_file()
    assert mode_of(str(path.parent)) & 0o077 == 0


@pytest.mark.parametrize("bad", [{"x": object()}, {1: "int key"}, {"t": (1, 2)}, {"q": math.nan}, ["not", "dict"]])
def test_non_json_policy_or_detail_is_a_type_error_and_writes_nothing(db_path: str, bad) -> None:
    with Journal(db_path) as j:
        j.put_policy(0, {"ok": 1})
        with pytest.raises(TypeError, match="policy for device 0"):
            j.put_policy(0, bad)
        with pytest.raises(TypeError, match="detail for device 3"):
            j.put_device_state(3, "RUN", bad)
        assert j.policies() == {0: {"ok": 1}}
        assert j.device_states() == {}


def test_workload_enum_instead_of_wire_name_is_refused(db_path: str) -> None:
    from sharing import Workload
    with Journal(db_path) as j:
        with pytest.raises(TypeError, match="wire name"):
            j.put_session(record(workload=Workload.TRAINING))
        assert j.read_sessions()[0] == []


def test_models_round_trip(tmp_path):
    from nodeagent.journal import ModelRecord

    rec = ModelRecord(name="m", factory="pkg.mod:make", weights="/w.pt", device=None,
                      example_refs=[{"dtype": "float32", "shape": [2, 3], "offset": 0, "nbytes": 24}],
                      example_bytes=bytes(range(24)), created_unix=1.5)
    with Journal(str(tmp_path / "state.db")) as j:
        j.put_model(rec)
        j.put_model(rec)  # replacing is idempotent
    with Journal(str(tmp_path / "state.db")) as j:
        assert j.models() == [rec]
        j.delete_model("m")
        assert j.models() == []


def test_a_models_registrant_round_trips(tmp_path):
    from ctxpool.messages import PeerIdentity
    from nodeagent.journal import ModelRecord

    rec = ModelRecord(name="m", factory="pkg.mod:make", weights="/w.pt", device=0, example_refs=[],
                      example_bytes=b"", created_unix=2.0,
                      registrant=PeerIdentity(uid=65534, gid=65534, groups=[61234, 65534]))
    with Journal(str(tmp_path / "state.db")) as j:
        j.put_model(rec)
    with Journal(str(tmp_path / "state.db")) as j:
        assert j.models() == [rec]


def _schema_3_journal_with_a_model(db_path: str, monkeypatch) -> None:
    """A journal as nodeagent wrote it before schema 4: a models row with no registrant column."""
    with monkeypatch.context() as m:
        m.setattr(journal_mod, "_MIGRATIONS", journal_mod._MIGRATIONS[:3])
        m.setattr(journal_mod, "SCHEMA_VERSION", 3)
        Journal(db_path).close()
    raw = sqlite3.connect(db_path)
    assert "registrant" not in [r[1] for r in raw.execute("PRAGMA table_info(models)")]
    raw.execute("INSERT INTO models (name, factory, weights, device, example_refs, example_bytes, created_unix) "
                "VALUES ('old', 'pkg.mod:make', '/srv/w.pt', NULL, '{\"refs\": []}', x'', 1.0)")
    raw.commit()
    raw.close()


def test_a_journal_from_before_registrants_is_migrated_and_its_models_read_with_no_registrant(db_path,
                                                                                             monkeypatch):
    _schema_3_journal_with_a_model(db_path, monkeypatch)
    with Journal(db_path) as j:
        [old] = j.models()
    assert (old.name, old.weights, old.registrant) == ("old", "/srv/w.pt", None)
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()


@pytest.mark.parametrize("registrant", [
    "not json", "[]", '{"uid": 0, "gid": 0}', '{"uid": -1, "gid": 0, "groups": []}',
    '{"uid": true, "gid": 0, "groups": []}', '{"uid": 0, "gid": 0, "groups": ["wheel"]}',
    '{"uid": 4294967295, "gid": 0, "groups": []}', '{"uid": 0, "gid": 0, "groups": [], "extra": 1}', "42"])
def test_a_models_row_with_a_bad_registrant_is_skipped_and_the_rest_kept(db_path, registrant, caplog):
    from nodeagent.journal import ModelRecord

    with Journal(db_path) as j:
        for name in ("bad", "good"):
            j.put_model(ModelRecord(name=name, factory="pkg.mod:make", weights=None, device=None, example_refs=[],
                                    example_bytes=b"", created_unix=1.0))
    raw = sqlite3.connect(db_path)
    raw.execute("UPDATE models SET registrant=? WHERE name='bad'", (registrant,))
    raw.commit()
    raw.close()
    with Journal(db_path) as j:
        assert [m.name for m in j.models()] == ["good"]
    assert "skip model row name='bad'" in caplog.text


class _FlakyJournal(Journal):
    """A journal whose model writes fail while ``failing`` (a full disk, say); the rest works."""

    failing = False

    def put_model(self, rec) -> None:
        if self.failing:
            raise JournalError(f"journal {self.path}: database or disk is full")
        super().put_model(rec)


class _IdlePool:
    """Stands in for the worker pool: nothing queued, no deadline."""

    def next_deadline(self):
        return None


def test_a_model_whose_journal_write_failed_is_not_taken_as_journalled_and_is_written_later(tmp_path):
    """Before: ``journalled`` was set whatever ``put_model`` did, so a model the journal never
    took was believed durable, and a restart forgot it without a word."""
    from prometheus_client import CollectorRegistry

    from client_lib.protocol import ModelInfo
    from ctxpool.messages import ModelReady
    from nodeagent.config import ServeConfig
    from nodeagent.devices import CpuBackend
    from nodeagent.journal import ModelRecord
    from nodeagent.metrics import Metrics
    from nodeagent.daemon.server import AgentServer
    from nodeagent.daemon.serving import _Model

    journal = _FlakyJournal(str(tmp_path / "state.db"))
    clock = [100.0]
    server = AgentServer(ServeConfig(backend="cpu", endpoint=f"ipc://{tmp_path}/na.sock", state_dir=str(tmp_path),
                                     ctxpool_enabled="off"),
                         CpuBackend(1), metrics=Metrics(CollectorRegistry()), journal=journal, clock=lambda: clock[0])
    serving = server._serving
    serving._pool = _IdlePool()
    rec = ModelRecord(name="m", factory="pkg.mod:make", weights=None, device=None, example_refs=[],
                      example_bytes=b"", created_unix=1.0)
    serving._models["m"] = _Model(record=rec, segment=None, example=[])
    info = ModelInfo(name="m", factory=rec.factory, weights=None, model_bytes=0, layers=1, groups=1, devices=[0])
    journal.failing = True
    serving._on_pool_event(ModelReady(name="m", info=info), clock[0])
    assert serving._models["m"].ready and not serving._models["m"].journalled
    assert journal.models() == []
    journal.failing = False
    for step_s in (0.0, 2.5, 0.1):  # the journal probe succeeds (every 2 s), then the model is written
        clock[0] += step_s
        server._on_timers(clock[0])
    assert serving._models["m"].journalled and [m.name for m in journal.models()] == ["m"]
    journal.close()
