"""The pace board: a 128-byte file per device, written by the daemon (:class:`PaceBoardWriter`)
and mapped read-only by clients (:class:`PaceBoardReader`, :class:`PacePoint`), that tells a lower
class within nanoseconds whether to slow down. Its layout and seqlock are specified in
docs/protocol.md; how a board is replaced without SIGBUS, in docs/internals.md.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass
from typing import Callable

MAGIC = 0x4E415043
VERSION = 1
CLASSES = 3
SIZE = 128
LEGACY_SIZE = 64  # a board of a daemon before protocol 2.7: no flags words
_WORDS = struct.Struct("<32I")
_LEGACY_WORDS = struct.Struct("<16I")
_FLAGS = 16  # the first flags word
ARMED = 1  # flags bit 0
_SEQ = struct.Struct("<I")
_SLOT = 4  # words per class
_READ_TRIES = 64
RECHECK_S = 0.05  # how often at most a reader asks whether its path names another board (one stat)
RECHECK_READS = 64  # ... on every this many reads (a clock read costs more than a board read on some VMs)
_POLL_S = 0.0001  # how often a held PacePoint reads the board


class PaceBoardError(OSError):
    """A pace board that cannot be opened or does not hold the expected layout."""


@dataclass(frozen=True, slots=True)
class Pace:
    """One class's slot as read: see docs/internals.md."""

    present: int
    active: bool
    duty_permille: int
    period_us: int
    armed: bool = False  # 2.7: a pause may come before the board changes again (bound the run-ahead)

    @property
    def throttled(self) -> bool:
        """True while a higher class holds the device and this class may not run freely."""
        return self.active and self.duty_permille < 1000


FREE = Pace(0, False, 1000, 10_000)


class PaceBoardWriter:
    """The daemon's side: one device's board at ``path``, reused in place when a valid one of
    this user's is there (its sequence carried on), else written anew and renamed over the path;
    never truncated under a reader (see docs/internals.md)."""

    def __init__(self, path: str, mode: int = 0o600, gid: int | None = None) -> None:
        self.path = path
        self._words = [0] * (SIZE // 4)
        self._words[0], self._words[1], self._words[3] = MAGIC, VERSION, os.getpid() & 0xFFFFFFFF
        for k in range(CLASSES):
            self._words[4 + _SLOT * k: 8 + _SLOT * k] = [0, 0, 1000, FREE.period_us]
        reused = _reuse_board(path, mode, gid)
        if reused is not None:
            self._map, seq = reused
            self._words[2] = (seq + (seq & 1)) & 0xFFFFFFFF  # even, past any sequence a reader cached
            self._publish()
            return
        spare = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".new")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spare)  # left by a daemon killed while replacing (the directory is ours)
        fd = os.open(spare, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)
            os.ftruncate(fd, SIZE)  # a new file nobody maps yet
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._publish()  # complete before any reader can open it
            os.rename(spare, path)  # readers of the old file keep it whole, and find this one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(spare)
            raise
        finally:
            os.close(fd)

    def set(self, workload: int, pace: Pace) -> bool:
        """Write class ``workload``'s slot; False (nothing written) when it already says that."""
        base = 4 + _SLOT * workload
        new = [min(pace.present, 0xFFFFFFFF), 1 if pace.active else 0, pace.duty_permille, pace.period_us]
        flags = ARMED if pace.armed else 0
        if self._words[base:base + _SLOT] == new and self._words[_FLAGS + workload] == flags:
            return False
        self._words[base:base + _SLOT] = new
        self._words[_FLAGS + workload] = flags
        self._publish()
        return True

    def _publish(self) -> None:
        seq = (self._words[2] + 1) & 0xFFFFFFFF  # odd: being written
        self._map[8:12] = struct.pack("<I", seq)
        self._words[2] = seq
        packed = _WORDS.pack(*self._words)
        self._map[0:8] = packed[0:8]
        self._map[12:SIZE] = packed[12:]
        self._words[2] = (seq + 1) & 0xFFFFFFFF
        self._map[8:12] = struct.pack("<I", self._words[2])

    def clear(self) -> None:
        """Nobody is paced: what the board says once the daemon stops."""
        for k in range(CLASSES):
            self.set(k, FREE)

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self.clear()
            self._map.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class PaceBoardReader:
    """A client's side: the board mapped read-only; the file its path names is remapped when
    that changes (a restarted daemon's board: see :meth:`read`)."""

    def __init__(self, path: str, *, recheck_s: float = RECHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._map, self._identity, self._layout = _map_board(path)
        self.path = path
        self._recheck_s = recheck_s
        self._clock = clock
        self._next_check = clock() + recheck_s
        self._reads = 0
        self._seq = -1  # the sequence the cache below was read at
        self._cache: tuple[Pace, ...] = ()
        self._pid = 0
        self._closed = False

    @property
    def daemon_pid(self) -> int:
        """The pid of the daemon that wrote the board as last read (0 before the first read)."""
        return self._pid

    def refresh(self) -> bool:
        """Map the board the path names now if it is another file than the one mapped (a
        restarted daemon's); True if it was. A path gone, or not (yet) a board, keeps the old."""
        self._next_check = self._clock() + self._recheck_s
        if self._closed:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) == self._identity:
            return False
        try:
            self._map, self._identity, self._layout = _map_board(self.path)
        except OSError:
            return False
        self._seq = -1  # the old map is closed when the last read of it ends (never under a reader)
        return True

    def read(self, workload: int) -> Pace:
        """Class ``workload``'s slot; :data:`FREE` if the board stays mid-write (a daemon killed while
        writing leaves it so: pacing fails open). One 4-byte load while the board's sequence is unchanged
        (the slots read last time are kept); a :meth:`refresh` as :data:`RECHECK_READS` says."""
        self._reads += 1
        if not self._reads % RECHECK_READS and self._clock() >= self._next_check:
            self.refresh()
        try:
            if _SEQ.unpack_from(self._map, 8)[0] == self._seq:
                return self._cache[workload]
        except (ValueError, TypeError):
            return FREE
        m, layout = self._map, self._layout
        try:
            for _ in range(_READ_TRIES):
                words = layout.unpack_from(m, 0)
                seq = words[2]
                if seq & 1 or _SEQ.unpack_from(m, 8)[0] != seq:  # being written, or written meanwhile
                    continue
                self._cache = tuple(_slot(words, k) for k in range(CLASSES))
                self._pid = words[3]
                self._seq = seq
                return self._cache[workload]
        except (ValueError, TypeError):  # closed meanwhile (the session ended): nothing to wait for
            pass
        return FREE

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(ValueError, OSError, BufferError):
            self._map.close()


class PacePoint:
    """Where a lower-class process may be held while a higher class uses the device. ``alive`` is
    asked every ``check_s`` while held: once the daemon is gone the wait ends (a board left behind
    by a dead daemon must not stop anyone for good)."""

    def __init__(self, reader: PaceBoardReader, workload: int, *, alive: Callable[[], bool] = lambda: True,
                 check_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.reader = reader
        self.workload = workload
        self._alive = alive
        self._check_s = check_s
        self._clock = clock
        self._sleep = sleep

    def pace(self) -> Pace:
        return self.reader.read(self.workload)

    def wait(self) -> float:
        """Seconds held: none unless the board says this class is throttled, then through the off part
        of each period (all of it at duty 0) until the higher class releases."""
        pace = self.reader.read(self.workload)
        if not pace.throttled or in_on_phase(pace, self._clock()):
            return 0.0
        start = self._clock()
        next_check = start + self._check_s
        while True:
            now = self._clock()
            if now >= next_check:
                next_check = now + self._check_s
                if not self._alive():
                    break
            pace = self.reader.read(self.workload)
            if not pace.throttled or in_on_phase(pace, now):
                break
            self._sleep(_POLL_S)
        return self._clock() - start


def in_on_phase(pace: Pace, now: float) -> bool:
    """Whether ``now`` falls in the part of the period a throttled class may run (duty > 0):
    periods are aligned to the clock, so processes paced alike run and pause together."""
    if pace.duty_permille <= 0:
        return False
    period_us = pace.period_us
    return (int(now * 1e6) % period_us) * 1000 < pace.duty_permille * period_us


def _slot(words: tuple[int, ...], k: int) -> Pace:
    b = 4 + _SLOT * k
    present, active, duty = words[b], words[b + 1] != 0, min(words[b + 2], 1000)
    armed = bool(words[_FLAGS + k] & ARMED) if len(words) > _FLAGS else (present > 0 and duty < 1000)
    return Pace(present, active, duty, max(words[b + 3], 1), armed)


def _map_board(path: str) -> tuple[mmap.mmap, tuple[int, int], struct.Struct]:
    """Map the board at ``path`` read-only: (the map, the file's (device, inode), its layout:
    a 64-byte board of a daemon before protocol 2.7 has no flags words)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PaceBoardError(exc.errno, f"cannot open the pace board {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < LEGACY_SIZE:
            raise PaceBoardError(f"{path} is not a pace board (not a regular file of {LEGACY_SIZE} or {SIZE} bytes)")
        size = SIZE if st.st_size >= SIZE else LEGACY_SIZE
        board = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    layout = _WORDS if size == SIZE else _LEGACY_WORDS
    words = layout.unpack_from(board, 0)
    if words[0] != MAGIC or words[1] != VERSION:
        board.close()
        raise PaceBoardError(f"{path} is not a version-{VERSION} pace board")
    return board, (st.st_dev, st.st_ino), layout


def _reuse_board(path: str, mode: int, gid: int | None) -> tuple[mmap.mmap, int] | None:
    """A valid board of this user's already at ``path``, mapped for writing, and its sequence;
    None where there is none (or it is anything else: the caller replaces it)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_size != SIZE or st.st_uid != os.geteuid()
                or st.st_nlink != 1):
            return None
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
        board = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None
    finally:
        os.close(fd)
    words = _WORDS.unpack_from(board, 0)
    if words[0] != MAGIC or words[1] != VERSION:
        board.close()
        return None
    return board, words[2]
