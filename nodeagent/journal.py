"""The daemon's durable state: sessions, scheduler policies, device states and
a little metadata, journaled in SQLite so a daemon killed with SIGKILL and
started again restores them (clients then reattach by session id + key).

Writes come on session open/close/changes and policy changes, never per token
grant. One writer: the daemon's loop thread. Every write is one transaction,
so a reader after a crash sees each change whole or not at all.

Durability: WAL with ``synchronous=FULL``. A commit appends to the WAL and
fsyncs it once, so a committed change survives SIGKILL of the daemon (and a
power cut); DELETE mode with FULL is as safe but costs about three fsyncs per
commit (rollback journal, database, journal removal) and blocks readers such
as an operator's ``sqlite3 state.db`` while a write is under way. SQLite gives
the ``-wal`` and ``-shm`` files the database file's mode, so 0600 covers them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import stat
import threading
from dataclasses import dataclass, fields
from typing import Any, Iterator

log = logging.getLogger("nodeagent.journal")

APPLICATION_ID = 0x6E614A31  # "naJ1": marks the file as ours, so a stray SQLite file is refused
_BUSY_TIMEOUT_S = 5.0  # an operator's sqlite3 shell may hold a lock briefly

# _MIGRATIONS[n]: the statements taking a journal from schema version n to n + 1,
# run in the transaction that also sets user_version. Append; never edit a shipped step.
_MIGRATIONS: list[tuple[str, ...]] = [
    ("""CREATE TABLE sessions (
        seq INTEGER PRIMARY KEY,            -- creation order, kept when a session is replaced
        id TEXT NOT NULL UNIQUE, key TEXT NOT NULL, name TEXT NOT NULL,
        claimed_pid INTEGER NOT NULL, verified_pid INTEGER, start_ticks INTEGER, uid INTEGER,
        workload TEXT NOT NULL, weight REAL NOT NULL, device INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL, created_unix REAL NOT NULL,
        managed_pgid INTEGER, stopped INTEGER NOT NULL)""",
     "CREATE TABLE policies (device INTEGER PRIMARY KEY, policy TEXT NOT NULL)",
     "CREATE TABLE device_states (device INTEGER PRIMARY KEY, state TEXT NOT NULL, detail TEXT NOT NULL)",
     "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"),
    # 2: models registered for server-side inference (ctxpool)
    ("""CREATE TABLE models (
        name TEXT PRIMARY KEY, factory TEXT NOT NULL, weights TEXT, device INTEGER,
        example_refs TEXT NOT NULL,         -- JSON: the example input's dtypes, shapes, offsets
        example_bytes BLOB NOT NULL,        -- its bytes, laid out as the refs say
        created_unix REAL NOT NULL)""",),
    # 3: the training job (cluster borrower) a session belongs to
    ("ALTER TABLE sessions ADD COLUMN borrower TEXT",),
]
SCHEMA_VERSION = len(_MIGRATIONS)


class JournalError(Exception):
    """The journal cannot be opened or written; the message names the file and what to do."""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """What a restarted daemon needs to restore one session."""

    id: str
    key: str
    name: str
    claimed_pid: int
    verified_pid: int | None
    start_ticks: int | None
    uid: int | None
    workload: str  # wire name: "inference" | "training" | "best-effort"
    weight: float
    device: int
    memory_mb: int
    created_unix: float  # wall-clock time.time() at creation
    managed_pgid: int | None = None  # process group the daemon may signal (nodeagent run), verified
    stopped: bool = False  # the daemon SIGSTOPped it and has not yet continued it
    borrower: str | None = None  # hello.borrower: the training job it belongs to (cluster lending)


_SESSION_COLUMNS = [f.name for f in fields(SessionRecord)]


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """A model registered for server-side inference, as a restarted daemon re-registers it."""

    name: str
    factory: str  # "package.module:callable"
    weights: str | None  # absolute path, or None for the factory's own initialisation
    device: int | None  # None: every device with workers
    example_refs: list[dict]  # [{"dtype", "shape", "offset", "nbytes"}] into example_bytes
    example_bytes: bytes
    created_unix: float


class Journal:
    """An open ``state.db``. Use from one thread at a time; the lock only makes
    a stray call from another thread wait instead of corrupting a transaction."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        _create_private_file(path)
        try:
            # isolation_level=None: no implicit transactions; each write opens its own below.
            self._db = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=False)
            self._open()
        except sqlite3.Error as e:
            self.close()
            raise JournalError(f"{path} cannot be opened as a nodeagent journal ({e}); "
                               "if it is damaged, move it aside to start with empty state") from None
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        """Refuse files that are not ours or too new, then set durability and migrate."""
        db = self._db
        app_id = db.execute("PRAGMA application_id").fetchone()[0]  # first read: garbage fails here
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if app_id not in (0, APPLICATION_ID) or (
                app_id == 0 and db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]):
            raise JournalError(f"{self.path} is an SQLite database but not a nodeagent journal; "
                               "point --state-dir elsewhere or move the file aside")
        if version > SCHEMA_VERSION:
            raise JournalError(f"state.db has schema version {version}; this nodeagent understands up to "
                               f"{SCHEMA_VERSION} — upgrade nodeagent or move the state dir ({self.path})")
        journal_mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if journal_mode != "wal":  # e.g. a filesystem without shared memory; FULL below keeps it durable
            log.warning("[journal] WAL unavailable path=%s journal_mode=%s", self.path, journal_mode)
        db.execute("PRAGMA synchronous=FULL")
        for step in range(version, SCHEMA_VERSION):
            with self._write():
                for statement in _MIGRATIONS[step]:
                    db.execute(statement)
                db.execute(f"PRAGMA application_id={APPLICATION_ID}")
                db.execute(f"PRAGMA user_version={step + 1}")
            log.info("[journal] migrated path=%s from=%d to=%d", self.path, step, step + 1)
        log.info("[journal] open path=%s schema=%d journal_mode=%s", self.path, SCHEMA_VERSION, journal_mode)

    # ------------------------------------------------------------ sessions

    def put_session(self, rec: SessionRecord) -> None:
        """Insert or replace by id; a replaced session keeps its place in creation order."""
        if not isinstance(rec.workload, str):  # a sharing.Workload (an IntEnum) would be stored as a bare int
            raise TypeError(f"workload must be the wire name (str), not {type(rec.workload).__name__}")
        values = tuple(getattr(rec, c) for c in _SESSION_COLUMNS)
        updates = ", ".join(f"{c}=excluded.{c}" for c in _SESSION_COLUMNS[1:])
        with self._write() as db:
            db.execute(f"INSERT INTO sessions ({', '.join(_SESSION_COLUMNS)}) "
                       f"VALUES ({', '.join('?' * len(values))}) ON CONFLICT(id) DO UPDATE SET {updates}", values)
        log.debug("[journal] put session=%s", rec.id)

    def delete_session(self, session_id: str) -> None:
        """Forget a session; no error if it is absent."""
        with self._write() as db:
            db.execute("DELETE FROM sessions WHERE id=?", (session_id,))
        log.debug("[journal] delete session=%s", session_id)

    def set_stopped(self, session_id: str, stopped: bool) -> None:
        """Record that the daemon SIGSTOPped (or continued) a session; KeyError if it is not journaled."""
        with self._write() as db:
            changed = db.execute("UPDATE sessions SET stopped=? WHERE id=?", (int(stopped), session_id)).rowcount
        if not changed:
            raise KeyError(f"no session {session_id!r} in the journal {self.path}")
        log.debug("[journal] stopped session=%s stopped=%s", session_id, stopped)

    def sessions(self) -> list[SessionRecord]:
        """All journaled sessions, in creation order."""
        rows = self._read(f"SELECT {', '.join(_SESSION_COLUMNS)} FROM sessions ORDER BY seq")
        records = []
        for row in rows:
            values = dict(zip(_SESSION_COLUMNS, row))
            values["stopped"] = bool(values["stopped"])  # stored as 0/1
            records.append(SessionRecord(**values))
        return records

    # ------------------------------------------------------ policies, devices

    def put_policy(self, device: int, policy: dict) -> None:
        """Journal a device's scheduler policy; TypeError unless it round-trips through JSON."""
        text = _to_json(policy, f"policy for device {device}")
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO policies (device, policy) VALUES (?, ?)", (device, text))
        log.debug("[journal] put policy device=%d", device)

    def policies(self) -> dict[int, dict]:
        return {device: json.loads(text) for device, text in self._read("SELECT device, policy FROM policies")}

    def put_device_state(self, device: int, state: str, detail: dict | None = None) -> None:
        """Journal a device's lifecycle state with JSON-able details (None means none)."""
        text = _to_json({} if detail is None else detail, f"detail for device {device}")
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO device_states (device, state, detail) VALUES (?, ?, ?)",
                       (device, state, text))
        log.debug("[journal] put device state device=%d state=%s", device, state)

    def device_states(self) -> dict[int, tuple[str, dict]]:
        rows = self._read("SELECT device, state, detail FROM device_states")
        return {device: (state, json.loads(detail)) for device, state, detail in rows}

    # -------------------------------------------------------------- models

    def put_model(self, rec: ModelRecord) -> None:
        """Journal a registered model (replacing one of the same name)."""
        refs = _to_json({"refs": rec.example_refs}, f"example input of model {rec.name}")
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO models (name, factory, weights, device, example_refs, example_bytes, "
                       "created_unix) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (rec.name, rec.factory, rec.weights, rec.device, refs, rec.example_bytes, rec.created_unix))
        log.debug("[journal] put model name=%s", rec.name)

    def delete_model(self, name: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM models WHERE name=?", (name,))
        log.debug("[journal] delete model name=%s", name)

    def models(self) -> list[ModelRecord]:
        rows = self._read("SELECT name, factory, weights, device, example_refs, example_bytes, created_unix "
                          "FROM models ORDER BY created_unix")
        return [ModelRecord(name, factory, weights, device, json.loads(refs)["refs"], bytes(blob), created)
                for name, factory, weights, device, refs, blob, created in rows]

    # ---------------------------------------------------------------- meta

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0][0] if rows else default

    def put_meta(self, key: str, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"meta value for {key!r} must be str, not {type(value).__name__}")
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def next_boot(self) -> int:
        """Increment and return the boot counter (1 on a fresh journal); read and write are one transaction."""
        with self._write() as db:
            row = db.execute("SELECT value FROM meta WHERE key='boot'").fetchone()
            try:
                boot = (int(row[0]) if row else 0) + 1
            except ValueError:
                raise JournalError(f"boot counter in {self.path} is not an integer: {row[0]!r}") from None
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('boot', ?)", (str(boot),))
        log.info("[journal] boot=%d path=%s", boot, self.path)
        return boot

    # ------------------------------------------------------------ plumbing

    def close(self) -> None:
        """Close the file; further calls raise JournalError. Safe to call twice."""
        db, self._db = self._db, None
        if db is not None:
            db.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._locked() as db:
            return db.execute(sql, params).fetchall()

    def _write(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One write transaction. BEGIN IMMEDIATE takes the write lock up front, so a
        read-then-write (next_boot) cannot interleave; COMMIT on success, ROLLBACK on error."""
        return self._locked(begin=True)

    @contextlib.contextmanager
    def _locked(self, begin: bool = False) -> Iterator[sqlite3.Connection]:
        """Holds the lock; turns sqlite3 errors (disk full, locked, corrupt page) into a JournalError naming the file."""
        with self._lock:
            db = self._db
            if db is None:
                raise JournalError(f"journal {self.path} is closed")
            try:
                if begin:
                    db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                    if begin:
                        db.execute("COMMIT")
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise JournalError(f"journal {self.path}: {e}") from None


def _to_json(value: Any, what: str) -> str:
    """``value`` as JSON text; TypeError if it is not a dict that reads back equal."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a dict, not {type(value).__name__}")
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} is not JSON-serialisable: {e}") from None
    if json.loads(text) != value:  # int keys become strings, tuples lists: refuse rather than change it
        raise TypeError(f"{what} does not survive a JSON round trip (non-str keys or tuples?)")
    return text


def _create_private_file(path: str) -> None:
    """Create the parent directory (0700) and the file (0600) if missing; tighten a looser file to 0600."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode != 0o600:
                log.warning("[journal] mode was %o, setting 0600 path=%s", mode, path)
                os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
    except OSError as e:
        raise JournalError(f"cannot open journal {path}: {e.strerror}") from None
