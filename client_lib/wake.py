"""The client's end of one-hop handoffs: its own wake channel and its successors'.

With one-hop handoffs (protocol 2.1, :mod:`nodeagent.daemon.one_hop`) a holder that
releases writes the next holder's wake word into that one's FIFO before telling the
daemon, so the next holder starts one hop sooner. A :class:`WakeChannel` holds, for one
client: its FIFO while it waits for the token (read-write, so it never reports a
hang-up), the promise the daemon made it meanwhile (``standby``: grant, secret), the
successor it wakes at its release (``hint``: its grant, the next grant, that one's
channel, secret), the successors' channels kept open, and the last unmatched bytes read
(a word may straddle two reads). It decides nothing about the token: a word it matches
is returned as a grant, and the client takes it.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Callable

from client_lib import protocol as p

log = logging.getLogger("client_lib.client")

WAKE_TAIL_MAX = 1024  # unmatched wake-channel bytes kept (the newest)
WAKE_OUT_MAX = 4  # successors' wake channels a client keeps open (each a descriptor)


class WakeChannel:
    """One client's wake channels; ``watch(fd)`` tells its transport to wake on ``fd`` (None: none)."""

    def __init__(self, watch: Callable[[int | None], None]) -> None:
        self._watch = watch
        self.fd: int | None = None  # our channel, open while waiting for the token (see listen)
        self._out: dict[str, int] = {}  # successors' wake channels, kept open for the next handoff
        self._warned = False
        self.standby: tuple[int, bytes] | None = None  # the promise the daemon made us while we wait
        self.woken_grant: int | None = None  # the last grant taken from our channel: the daemon's grants up to it are copies
        self.hint: tuple[int, int, str, bytes] | None = None  # whom we wake at our release
        self.tail = b""
        self.handed_on = 0  # releases that woke the next holder directly
        self.woken = 0  # grants taken from the wake channel, ahead of the daemon's notice

    # ------------------------------------------------------------ promises

    def is_copy(self, grant: int) -> bool:
        """Whether the daemon's grant ``grant`` is its copy of one our channel gave us (perhaps
        already given back, and waiting again on a new promise: copies lag). Grant ids only grow
        on a device."""
        return self.woken_grant is not None and grant <= self.woken_grant

    def granted(self) -> None:
        """The daemon granted us the token: no promise is pending, and no successor known yet."""
        self.standby = None
        self.hint = None

    def on_successor(self, msg: p.Successor) -> None:
        self.hint = (msg.grant, msg.next, msg.wake, msg.secret) if msg.next is not None else None

    def on_standby(self, msg: p.Standby) -> None:
        self.standby = (msg.grant, msg.secret)

    def take_hint(self) -> tuple[int, int, str, bytes] | None:
        hint, self.hint = self.hint, None
        return hint

    def give_up_promise(self) -> None:
        """Not waiting any more: a late wake word is not ours to take."""
        self.standby = None
        self.unlisten()

    def withdraw(self, grant: int) -> bool:
        """The daemon took back its promise of ``grant``: stop listening for its word (what the
        channel holds unread is dropped, never taken). Whether we had taken it already."""
        woken = self.woken_grant == grant
        if self.standby is not None and self.standby[0] == grant:
            self.standby = None
            self._drain()
        return woken

    def clear_promises(self) -> None:
        self.standby = self.hint = self.woken_grant = None

    def forget(self) -> None:
        """A new connection (or the end): the old one's promises and channels go."""
        self.unlisten()
        self.close_out()
        self.clear_promises()

    # ----------------------------------------------------------- our channel

    def listen(self, path: str) -> None:
        """Open our wake channel ``path`` while we wait for the token (read-write, so that it never
        reports a hang-up). Only while waiting: a holder that finds no reader hands off in
        two hops, and what was written to a channel nobody holds open is gone."""
        if self.fd is not None or not path:
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("[client] cannot open the wake channel %s (%s); handoffs to this session take two "
                            "hops", path, exc.strerror)
            return
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            return
        self.fd = fd
        self._watch(fd)

    def unlisten(self) -> None:
        fd, self.fd = self.fd, None
        self.tail = b""
        if fd is None:
            return
        self._watch(None)
        try:
            os.close(fd)
        except OSError:
            pass

    def read(self, holding: bool) -> int | None:
        """Drain our channel; the grant of the promise we wait on if it held its word (then we
        hold it), else None. Anything else (late, forged, replayed) is dropped."""
        fd = self.fd
        if fd is None:
            return None
        data = b""
        try:
            while True:
                chunk = os.read(fd, 4096)
                data += chunk
                if len(chunk) < 4096 or len(data) >= 65536:
                    break
        except BlockingIOError:
            pass
        except OSError:
            return None
        return self.match(data, holding)

    def match(self, data: bytes, holding: bool) -> int | None:
        """Look for our promise's word in ``data`` (and the bytes kept); its grant if found."""
        if holding:
            self.tail = b""
            return None
        buf = (self.tail + data)[-WAKE_TAIL_MAX:]
        standby = self.standby
        if standby is None or p.wake_word(standby[1], standby[0]) not in buf:
            self.tail = buf  # kept: the standby it matches may be in a frame not handled yet
            return None
        self.tail = b""
        self.standby = None
        self.woken_grant = standby[0]
        self.woken += 1
        return standby[0]  # the channel stays open until our release: closing it is not on the way to our work

    def _drain(self) -> None:
        """Read and drop whatever our channel holds (no standby: nothing in it is ours)."""
        fd = self.fd
        if fd is not None:
            try:
                while len(os.read(fd, 4096)) == 4096:
                    pass
            except OSError:
                pass
        self.tail = b""

    # ---------------------------------------------------- successors' channels

    def hand_on(self, hint: tuple[int, int, str, bytes]) -> int | None:
        """Wake the promised successor: one write of its wake word to its FIFO. Its grant id
        if the word went whole, else None (no reader: it left; full: the daemon's grant wakes it)."""
        _, next_grant, wake, secret = hint
        fd = self._out.get(wake)
        if fd is None:
            try:
                fd = os.open(wake, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return None  # ENXIO: it is not listening (it left, or stopped waiting)
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
                return None
            if len(self._out) >= WAKE_OUT_MAX:  # the oldest goes
                old_path = next(iter(self._out))
                os.close(self._out.pop(old_path))
            self._out[wake] = fd
        word = p.wake_word(secret, next_grant)
        try:
            if os.write(fd, word) != len(word):
                return None
        except OSError:  # EPIPE: its session ended since; EAGAIN: full (the daemon's grant wakes it)
            os.close(self._out.pop(wake))
            return None
        self.handed_on += 1
        return next_grant

    def close_out(self) -> None:
        for fd in self._out.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._out.clear()
