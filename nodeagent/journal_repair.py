"""What the journal does about damage it finds on disk, so that a bad file never stops the
daemon with a traceback and never makes grant ids repeat. Detail: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import struct
import time

log = logging.getLogger("nodeagent.journal")

MAX_BOOT = 2**31 - 1  # grant ids are boot << 32 and must stay below 2**63 (a signed 64-bit integer)

# sqlite3 primary result codes that mean the file itself is damaged, not that it cannot be reached.
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26
# Tables a damaged journal's rows are salvaged from, in the order they are written back.
SALVAGED_TABLES = ("meta", "policies", "device_states", "sessions", "models", "attained")


class RepairError(Exception):
    """A file beside the journal (boot counter, WAL) cannot be read, written or moved aside; the message says which."""


def is_damage(exc: sqlite3.Error) -> bool:
    """True when SQLite says the file is not a database or is corrupt (as opposed to full, read-only, locked)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


# ------------------------------------------------------------------ boot counter side file


def parse_boot(value: object) -> int | None:
    """A stored boot counter as an int in [0, MAX_BOOT], or None if it is not one."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value.strip())  # ASCII only: "²".isdigit() holds, but int() refuses it
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value if 0 <= value <= MAX_BOOT else None


def read_boot_file(path: str) -> int | None:
    """The boot counter in the side file; None if there is none (or it is garbage, which is logged)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RepairError(f"cannot read the boot counter file {path}: {exc.strerror}") from None
    boot = parse_boot(raw)
    if boot is None:
        log.error("[journal] boot counter file %s holds %r, not a boot number; ignoring it", path, raw[:32])
    return boot


def write_boot_file(path: str, boot: int) -> None:
    """Replace the side file with ``boot``: write a temporary file, fsync, rename, fsync the directory."""
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, f"{boot}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise RepairError(f"cannot write the boot counter file {path}: {exc.strerror}") from None


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the WAL


_WAL_MAGIC = (0x377F0682, 0x377F0683)  # low bit: checksums over big-endian words
_WAL_VERSION = 3007000
_WAL_HEADER_BYTES = 32


def wal_header_ok(header: bytes) -> bool:
    """Whether ``header`` is a valid SQLite WAL header (magic, version and its checksum)."""
    if len(header) < _WAL_HEADER_BYTES:
        return False
    magic, version = struct.unpack(">II", header[:8])
    if magic not in _WAL_MAGIC or version != _WAL_VERSION:
        return False
    words = struct.unpack(">6I" if magic & 1 else "<6I", header[:24])
    s0 = s1 = 0
    for x0, x1 in zip(words[0::2], words[1::2]):
        s0 = (s0 + x0 + s1) & 0xFFFFFFFF
        s1 = (s1 + x1 + s0) & 0xFFFFFFFF
    return (s0, s1) == struct.unpack(">II", header[24:32])


def set_aside_bad_wal(db_path: str) -> str | None:
    """Move a WAL that SQLite would ignore out of the way (logged); returns where it went, or None.

    An empty WAL is normal (after a checkpoint). The ``-shm`` index is derived
    from the WAL, so it is removed with it; SQLite rebuilds it."""
    wal = db_path + "-wal"
    try:
        with open(wal, "rb") as f:
            header = f.read(_WAL_HEADER_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RepairError(f"cannot read the journal's WAL {wal}: {exc.strerror}") from None
    if not header or wal_header_ok(header):
        return None
    dest = _aside_name(wal, "bad")
    try:
        os.rename(wal, dest)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(db_path + "-shm")
    except OSError as exc:
        raise RepairError(f"the journal's WAL {wal} is damaged and cannot be moved aside: {exc.strerror}") from None
    log.error("[journal] WAL %s is not a valid SQLite WAL (header %s...); moved it to %s: the changes it held "
              "are lost (sessions of the last moments may not be restored)", wal, header[:8].hex(), dest)
    return dest


# ------------------------------------------------------------------ a damaged database


def salvage(db: sqlite3.Connection) -> dict[str, tuple[list[str], list[tuple]]]:
    """Rows that can still be read from a damaged journal: ``{table: (columns, rows)}``.

    A table is read in rowid order until the first error; the rows before it are kept."""
    found: dict[str, tuple[list[str], list[tuple]]] = {}
    for table in SALVAGED_TABLES:
        rows: list[tuple] = []
        columns: list[str] = []
        try:
            cursor = db.execute(f"SELECT * FROM {table}")
            columns = [d[0] for d in cursor.description]
            for row in cursor:
                rows.append(row)
        except sqlite3.Error as exc:
            log.error("[journal] salvage table=%s stopped after %d rows: %s", table, len(rows), exc)
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF == _SQLITE_NOTADB:
                break  # not a database at all: no table will read
        if rows:
            found[table] = (columns, rows)
    return found


def write_back(db: sqlite3.Connection, found: dict[str, tuple[list[str], list[tuple]]]) -> int:
    """Insert salvaged rows into a fresh journal (one transaction is the caller's); returns rows kept.

    Only columns the current schema has are copied; a row that breaks a
    constraint is skipped (the readers skip and log rows with bad values)."""
    kept = 0
    for table in SALVAGED_TABLES:
        if table not in found:
            continue
        columns, rows = found[table]
        known = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        index = [i for i, c in enumerate(columns) if c in known]
        if not index:
            continue
        names = ", ".join(columns[i] for i in index)
        sql = f"INSERT OR IGNORE INTO {table} ({names}) VALUES ({', '.join('?' * len(index))})"
        for row in rows:
            kept += db.execute(sql, tuple(row[i] for i in index)).rowcount
    return kept


def move_aside(db_path: str) -> str:
    """Rename the database and its ``-wal``/``-shm`` to ``<db>.damaged-<time>``; returns the new name."""
    dest = _aside_name(db_path, "damaged")
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.rename(db_path + suffix, dest + suffix)
    return dest


def _aside_name(path: str, what: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    dest, n = f"{path}.{what}-{stamp}", 1
    while os.path.exists(dest):
        n += 1
        dest = f"{path}.{what}-{stamp}.{n}"
    return dest
