"""The daemon's durable state (:class:`Journal`): sessions, scheduler policies, device states and
a little metadata in SQLite, one transaction a write, so a daemon killed with SIGKILL restores
them. Damage on disk is :mod:`nodeagent.journal_repair`'s. Detail: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Iterator

from client_lib.protocol import WORKLOADS
from ctxpool.messages import PeerIdentity
from nodeagent import journal_repair as repair

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
    # 4: who registered a model (JSON: uid, gid, groups), so that a restart reads its weights with
    # that user's rights; NULL in rows of older journals (see ModelRecord.registrant)
    ("ALTER TABLE models ADD COLUMN registrant TEXT",),
    # 5: a whole-device suspension in force or under way (JSON: sharing.suspension.Suspension.to_record),
    # written before the notice or signal it stands for, so a restarted daemon finishes it; NULL: none
    ("ALTER TABLE sessions ADD COLUMN suspension TEXT",),
    # 6: GPU-seconds each training job (hello.borrower) attained, over its sessions and restarts
    ("CREATE TABLE attained (job TEXT PRIMARY KEY, gpu_s REAL NOT NULL, updated_unix REAL NOT NULL)",),
]
SCHEMA_VERSION = len(_MIGRATIONS)


class JournalError(Exception):
    """The journal cannot be opened or written; the message names the file and what to do.
    ``damage``: SQLite said the file is corrupt or not a database (not full, read-only, locked)."""

    damage = False


class _BootUsedUp(JournalError):
    """The boot counter reached repair.MAX_BOOT (grant ids would overflow)."""


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
    suspension: dict | None = None  # sharing.suspension.Suspension.to_record(); None: not suspended


_SESSION_COLUMNS = [f.name for f in fields(SessionRecord)]


@dataclass(frozen=True, slots=True)
class BadSessionRow:
    """A journaled session row with a value no daemon could have written (hand edits, bit rot)."""

    seq: int
    problem: str
    values: dict  # the raw column values, for whatever can still be trusted (a stopped process)


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
    # Who registered it, as the daemon verified them (SO_PEERCRED, groups from /proc): a restarted
    # daemon reads the weights file with these rights. None: journalled before schema 4 recorded it.
    registrant: PeerIdentity | None = None


class Journal:
    """An open ``state.db``. Use from one thread at a time; the lock only makes
    a stray call from another thread wait instead of corrupting a transaction."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.boot_path = path + ".boot"  # the boot counter's side file (nodeagent.journal_repair)
        self.moved_aside: str | None = None  # where a damaged file went, when this open repaired one
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        _create_private_file(path)
        try:
            repair.set_aside_bad_wal(path)
            damage = self._connect()
            if damage is not None:
                self._repair(damage)
        except BaseException as exc:
            self.close()
            if isinstance(exc, repair.RepairError):
                raise JournalError(str(exc)) from None
            raise

    def _connect(self) -> str | None:
        """Open, migrate and check the file. Returns why it is damaged, or None; refusals and
        faults that are not damage (full, read-only, locked) raise JournalError."""
        try:
            self._open()
            problems = [row[0] for row in self._db.execute("PRAGMA quick_check(5)")]
        except sqlite3.Error as e:
            if repair.is_damage(e):
                return str(e)
            raise JournalError(_cannot_use(self.path, e)) from None
        except JournalError as e:
            if e.damage:
                return str(e)
            raise
        return None if problems == ["ok"] else "; ".join(str(p) for p in problems)

    def _repair(self, damage: str) -> None:
        """Salvage the rows that still read, move the damaged file aside, and start a
        fresh journal holding them (the boot counter's side file keeps boots going up)."""
        found = repair.salvage(self._db) if self._db is not None else {}
        self.close()
        try:
            self.moved_aside = repair.move_aside(self.path)
        except OSError as exc:
            raise JournalError(f"journal {self.path} is damaged ({damage}) and cannot be moved aside: "
                               f"{exc.strerror}; move it away by hand and start again") from None
        _create_private_file(self.path)
        try:
            self._open()
            with self._write() as db:
                kept = repair.write_back(db, found)
        except sqlite3.Error as e:
            raise JournalError(_cannot_use(self.path, e)) from None
        read = sum(len(rows) for _, rows in found.values())
        log.error("[journal] DAMAGED journal %s (%s): moved it to %s and started a fresh one with %d of the "
                  "%d rows that could still be read; sessions and settings not among them are lost",
                  self.path, damage, self.moved_aside, kept, read)

    def _open(self) -> None:
        """Connect; refuse files that are not ours or too new, then set durability and migrate."""
        # isolation_level=None: no implicit transactions; each write opens its own below.
        self._db = db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                        check_same_thread=False)
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
            log.debug("[journal] migrated path=%s from=%d to=%d", self.path, step, step + 1)
        # One line at INFO: a new journal is made in every step from 0 and that is not news.
        if version == 0:
            log.info("[journal] created path=%s schema=%d journal_mode=%s", self.path, SCHEMA_VERSION, journal_mode)
        else:
            log.info("[journal] open path=%s schema=%d%s journal_mode=%s", self.path, SCHEMA_VERSION,
                     f" migrated_from={version}" if version < SCHEMA_VERSION else "", journal_mode)

    # ------------------------------------------------------------ sessions

    def put_session(self, rec: SessionRecord) -> None:
        """Insert or replace by id; a replaced session keeps its place in creation order."""
        if not isinstance(rec.workload, str):  # a sharing.Workload (an IntEnum) would be stored as a bare int
            raise TypeError(f"workload must be the wire name (str), not {type(rec.workload).__name__}")
        values = tuple(_to_json(rec.suspension, f"suspension of session {rec.id}") if c == "suspension"
                       and rec.suspension is not None else getattr(rec, c) for c in _SESSION_COLUMNS)
        updates = ", ".join(f"{c}=excluded.{c}" for c in _SESSION_COLUMNS[1:])
        self._write_one(f"INSERT INTO sessions ({', '.join(_SESSION_COLUMNS)}) "
                        f"VALUES ({', '.join('?' * len(values))}) ON CONFLICT(id) DO UPDATE SET {updates}", values)
        log.debug("[journal] put session=%s", rec.id)

    def delete_session(self, session_id: str) -> None:
        """Forget a session; no error if it is absent."""
        self._write_one("DELETE FROM sessions WHERE id=?", (session_id,))
        log.debug("[journal] delete session=%s", session_id)

    def delete_session_row(self, seq: int) -> None:
        """Forget a session row by its place in creation order (a bad row, whose id may be garbage)."""
        self._write_one("DELETE FROM sessions WHERE seq=?", (seq,))
        log.debug("[journal] delete session row seq=%d", seq)

    def set_stopped(self, session_id: str, stopped: bool) -> None:
        """Record that the daemon SIGSTOPped (or continued) a session; KeyError if it is not journaled."""
        self._update_session(session_id, "stopped", int(stopped))
        log.debug("[journal] stopped session=%s stopped=%s", session_id, stopped)

    def set_suspension(self, session_id: str, record: dict | None) -> None:
        """Record a session's suspension (None: none any more); KeyError if it is not journaled."""
        text = None if record is None else _to_json(record, f"suspension of session {session_id}")
        self._update_session(session_id, "suspension", text)
        log.debug("[journal] suspension session=%s state=%s", session_id, record and record.get("state"))

    def set_weight(self, session_id: str, weight: float) -> None:
        """Record a session's new weight; KeyError if it is not journaled."""
        self._update_session(session_id, "weight", float(weight))
        log.debug("[journal] weight session=%s weight=%g", session_id, weight)

    def _update_session(self, session_id: str, column: str, value: object) -> None:
        changed = self._write_one(f"UPDATE sessions SET {column}=? WHERE id=?", (value, session_id))
        if not changed:
            raise KeyError(f"no session {session_id!r} in the journal {self.path}")

    def read_sessions(self) -> tuple[list[SessionRecord], list[BadSessionRow]]:
        """(good records in creation order, rows with a bad value). A bad row is logged
        and kept out of the records; its raw values still say which process it stopped."""
        rows = self._read(f"SELECT seq, {', '.join(_SESSION_COLUMNS)} FROM sessions ORDER BY seq")
        records, bad = [], []
        for seq, *row in rows:
            values = dict(zip(_SESSION_COLUMNS, row))
            problem = _session_problem(values)
            if problem is not None:
                log.error("[journal] skip session row seq=%s id=%s: %s", seq, _short(values["id"]), problem)
                bad.append(BadSessionRow(seq, problem, values))
                continue
            values["stopped"] = bool(values["stopped"])  # stored as 0/1
            values["suspension"] = _json_object(values["suspension"])  # checked above: a JSON object or None
            values["weight"] = float(values["weight"])
            values["created_unix"] = float(values["created_unix"])
            records.append(SessionRecord(**values))
        return records, bad

    # ------------------------------------------------------ policies, devices

    def put_policy(self, device: int, policy: dict) -> None:
        """Journal a device's scheduler policy; TypeError unless it round-trips through JSON."""
        text = _to_json(policy, f"policy for device {device}")
        self._write_one("INSERT OR REPLACE INTO policies (device, policy) VALUES (?, ?)", (device, text))
        log.debug("[journal] put policy device=%d", device)

    def policies(self) -> dict[int, dict]:
        """Each device's journaled policy; a row that is not a JSON object is skipped and logged."""
        found = {}
        for device, text in self._read("SELECT device, policy FROM policies"):
            doc = _json_object(text)
            if not _is_int(device) or doc is None:
                log.error("[journal] skip policy row device=%s: not a device index and a JSON object (%s)",
                          _short(device), _short(text))
                continue
            found[device] = doc
        return found

    def put_device_state(self, device: int, state: str, detail: dict | None = None) -> None:
        """Journal a device's lifecycle state with JSON-able details (None means none)."""
        text = _to_json({} if detail is None else detail, f"detail for device {device}")
        self._write_one("INSERT OR REPLACE INTO device_states (device, state, detail) VALUES (?, ?, ?)",
                        (device, state, text))
        log.debug("[journal] put device state device=%d state=%s", device, state)

    def device_states(self) -> dict[int, tuple[str, dict]]:
        """Each device's journaled lifecycle state; a row with a bad value is skipped and logged."""
        found = {}
        for device, state, detail in self._read("SELECT device, state, detail FROM device_states"):
            doc = _json_object(detail)
            if not _is_int(device) or not isinstance(state, str) or doc is None:
                log.error("[journal] skip device state row device=%s state=%s: bad value (detail %s)",
                          _short(device), _short(state), _short(detail))
                continue
            found[device] = (state, doc)
        return found

    # ------------------------------------------------------------ attained

    def put_attained(self, gpu_s: dict[str, float], forget: tuple[str, ...] = ()) -> None:
        """Journal jobs' attained GPU-seconds (replacing what each had) and forget ``forget``'s,
        in one transaction; TypeError for a value that is not a finite number >= 0."""
        for job, value in gpu_s.items():
            if not (isinstance(job, str) and _is_number(value) and value >= 0):
                raise TypeError(f"attained service of {_short(job)} must be a number >= 0, got {_short(value)}")
        wall = time.time()
        with self._write() as db:
            db.executemany("INSERT OR REPLACE INTO attained (job, gpu_s, updated_unix) VALUES (?, ?, ?)",
                           [(job, float(value), wall) for job, value in gpu_s.items()])
            db.executemany("DELETE FROM attained WHERE job=?", [(job,) for job in forget])
        log.debug("[journal] put attained jobs=%d forget=%d", len(gpu_s), len(forget))

    def attained(self) -> dict[str, tuple[float, float]]:
        """Each job's journalled (GPU-seconds, unix time of the write); a bad row is skipped and logged."""
        found = {}
        for job, gpu_s, updated in self._read("SELECT job, gpu_s, updated_unix FROM attained"):
            if not (isinstance(job, str) and job and _is_number(gpu_s) and gpu_s >= 0 and _is_number(updated)):
                log.error("[journal] skip attained row job=%s gpu_s=%s: bad value", _short(job), _short(gpu_s))
                continue
            found[job] = (float(gpu_s), float(updated))
        return found

    # -------------------------------------------------------------- models

    def put_model(self, rec: ModelRecord) -> None:
        """Journal a registered model (replacing one of the same name)."""
        refs = _to_json({"refs": rec.example_refs}, f"example input of model {rec.name}")
        registrant = None if rec.registrant is None else _to_json(
            {"uid": rec.registrant.uid, "gid": rec.registrant.gid, "groups": list(rec.registrant.groups)},
            f"registrant of model {rec.name}")
        self._write_one("INSERT OR REPLACE INTO models (name, factory, weights, device, example_refs, example_bytes, "
                        "created_unix, registrant) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (rec.name, rec.factory, rec.weights, rec.device, refs, rec.example_bytes, rec.created_unix,
                         registrant))
        log.debug("[journal] put model name=%s", rec.name)

    def delete_model(self, name: str) -> None:
        self._write_one("DELETE FROM models WHERE name=?", (name,))
        log.debug("[journal] delete model name=%s", name)

    def models(self) -> list[ModelRecord]:
        """All readable journalled models, oldest first (a row with a bad value is skipped and logged)."""
        rows = self._read("SELECT name, factory, weights, device, example_refs, example_bytes, created_unix, "
                          "registrant FROM models ORDER BY created_unix")
        records = []
        for name, factory, weights, device, refs, blob, created, registrant_text in rows:
            example_refs = (_json_object(refs) or {}).get("refs")
            registrant = None if registrant_text is None else _registrant(registrant_text)
            if not (isinstance(name, str) and isinstance(factory, str) and isinstance(weights, (str, type(None)))
                    and (device is None or _is_int(device)) and isinstance(example_refs, list)
                    and all(isinstance(r, dict) for r in example_refs) and isinstance(blob, bytes)
                    and _is_number(created) and (registrant_text is None or registrant is not None)):
                log.error("[journal] skip model row name=%s: bad value", _short(name))
                continue
            records.append(ModelRecord(name, factory, weights, device, example_refs, bytes(blob), float(created),
                                       registrant))
        return records

    # ---------------------------------------------------------------- meta

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0][0] if rows else default

    def put_meta(self, key: str, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"meta value for {key!r} must be str, not {type(value).__name__}")
        self._write_one("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def next_boot(self) -> int:
        """Increment and return the boot counter (1 on a fresh journal). It never goes back: the
        larger of the journal's value and the side file's is taken, and both are written before
        it is returned (read and write in the journal are one transaction)."""
        try:
            kept = repair.read_boot_file(self.boot_path)
        except repair.RepairError as exc:
            raise JournalError(str(exc)) from None
        try:
            with self._write() as db:
                row = db.execute("SELECT value FROM meta WHERE key='boot'").fetchone()
                stored = repair.parse_boot(row[0]) if row else 0
                if stored is None:
                    log.error("[journal] boot counter %s in %s is not a boot number; going on from the boot "
                              "file's %s", _short(row[0]), self.path, kept)
                    stored = 0
                boot = max(stored, kept or 0) + 1
                if boot > repair.MAX_BOOT:
                    raise _BootUsedUp(f"boot counter of {self.path} is used up ({boot - 1}); "
                                      "move the state dir aside to start again")
                db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('boot', ?)", (str(boot),))
        except _BootUsedUp:
            raise
        except JournalError as exc:  # the daemon cannot start: say why
            advice = _what_to_do(self.path)
            raise JournalError(f"cannot record the boot in the state journal: {exc}; {advice}") from None
        if kept is not None and kept > stored:
            log.error("[journal] journal %s lost writes: its boot counter is %d, the boot file says %d; "
                      "going on from %d so that grant ids never repeat", self.path, stored, kept, boot)
        try:
            repair.write_boot_file(self.boot_path, boot)
        except repair.RepairError as exc:
            raise JournalError(f"{exc}; free space or fix permissions there") from None
        log.log(logging.DEBUG if boot == 1 else logging.INFO, "[journal] boot=%d path=%s", boot, self.path)
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

    def _write_one(self, sql: str, params: tuple) -> int:
        """One statement in a write transaction of its own; returns the rows it changed."""
        with self._write() as db:
            return db.execute(sql, params).rowcount

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
                err = JournalError(f"journal {self.path}: {e}")
                err.damage = repair.is_damage(e)
                raise err from None


_MAX_PID = 2**22  # the kernel's PID_MAX_LIMIT


def _session_problem(v: dict) -> str | None:
    """What makes a journaled session row unusable, or None."""
    for name in ("id", "key", "name"):
        if not isinstance(v[name], str) or not v[name]:
            return f"{name} is not a non-empty string"
    if v["workload"] not in WORKLOADS:
        return f"workload {_short(v['workload'])} is not one of {', '.join(WORKLOADS)}"
    if not (_is_number(v["weight"]) and v["weight"] > 0):
        return f"weight {_short(v['weight'])} is not a positive number"
    if not _is_number(v["created_unix"]):
        return f"created_unix {_short(v['created_unix'])} is not a number"
    for name, low, high, optional in (
            ("claimed_pid", 0, 2**63 - 1, False), ("verified_pid", 1, _MAX_PID, True),
            ("start_ticks", 0, 2**62, True), ("uid", 0, 2**32 - 1, True), ("device", 0, 2**31 - 1, False),
            ("memory_mb", 0, 2**62, False), ("managed_pgid", 1, _MAX_PID, True)):
        value = v[name]
        if not ((optional and value is None) or (_is_int(value) and low <= value <= high)):
            return f"{name} {_short(value)} is not an integer in [{low}, {high}]"
    if v["stopped"] not in (0, 1) or isinstance(v["stopped"], float):
        return f"stopped {_short(v['stopped'])} is not 0 or 1"
    if not (v["borrower"] is None or isinstance(v["borrower"], str)):
        return f"borrower {_short(v['borrower'])} is not a string"
    if v["suspension"] is not None and _json_object(v["suspension"]) is None:
        return f"suspension {_short(v['suspension'])} is not a JSON object"
    return None


_MAX_ID = 2**32 - 2  # uids and gids: (uid_t)-1 means "no change" to the kernel, never a user
_MAX_GROUPS = 65536  # the kernel's NGROUPS_MAX


def _registrant(text: object) -> PeerIdentity | None:
    """A model row's registrant column read back, or None if it is not one a daemon wrote."""
    doc = _json_object(text)
    if doc is None or set(doc) != {"uid", "gid", "groups"}:
        return None
    uid, gid, groups = doc["uid"], doc["gid"], doc["groups"]
    if not (_is_int(uid) and 0 <= uid <= _MAX_ID and _is_int(gid) and 0 <= gid <= _MAX_ID
            and isinstance(groups, list) and len(groups) <= _MAX_GROUPS
            and all(_is_int(g) and 0 <= g <= _MAX_ID for g in groups)):
        return None
    return PeerIdentity(uid=uid, gid=gid, groups=groups)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json_object(text: object) -> dict | None:
    """``text`` parsed as a JSON object, or None if it is not one."""
    if not isinstance(text, str):
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the stack
        return None
    return doc if isinstance(doc, dict) else None


def _short(value: object, limit: int = 60) -> str:
    """A bounded repr for log lines: a journal row may hold anything."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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


def _cannot_use(path: str, exc: sqlite3.Error) -> str:
    """One line: why the journal cannot be used, and what to do about it."""
    where = os.path.dirname(os.path.abspath(path))
    try:
        full = os.statvfs(where).f_bavail == 0  # SQLite says "disk I/O error" when it cannot grow its index
    except OSError:
        full = False
    return f"cannot use the state journal {path}: {exc}{' (the disk is full)' if full else ''}; {_what_to_do(path)}"


def _what_to_do(path: str) -> str:
    """The advice of every error that the journal's directory cannot be written."""
    return f"free space or fix permissions in {os.path.dirname(os.path.abspath(path))}, or point --state-dir elsewhere"


def _create_private_file(path: str) -> None:
    """Create the parent directory (0700) and the file (0600) if missing; tighten a looser file to 0600."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode != 0o600:
                log.warning("[journal] mode was %o, setting 0600 path=%s", mode, path)
                os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
    except OSError as e:
        raise JournalError(f"cannot open the state journal {path}: {e.strerror}; {_what_to_do(path)}") from None
