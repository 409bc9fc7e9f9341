"""``nodeagent top``: a live terminal view of the daemon, as nvitop and htop show a machine; what
it shows is its ``--help`` (``nodeagent.cli``). Everything comes from one ``status`` request per
refresh (``status_reply.devices[].activity``, protocol 2.1; who else held the token: 2.7).

:func:`render` turns a status into plain lines (no escape codes); ``--once``
prints them, the live view (curses, stdlib only) draws them every interval,
redraws on resize, quits on ``q``, and keeps retrying while the daemon is away.
"""

from __future__ import annotations

import contextlib
import curses
import math
import os
import sys
import time

from client_lib import NodeAgentError, query_status
from client_lib import protocol as p
from client_lib.endpoint import client_endpoint

IDLE_CHAR = "."
MANY_CHAR = "*"  # more sessions shared the bucket than the daemon tracks per bucket
UNKNOWN_CHAR = "?"  # letters ran out (more than 52 sessions in view on one device)
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
MIB = 1024 * 1024
GIB = 1024 ** 3


class Letters:
    """Session id -> letter per device, stable across frames: a session keeps its letter
    while it is listed or in the strip, and a letter freed by one that left goes to the next newcomer."""

    def __init__(self) -> None:
        self._by_device: dict[int, dict[str, str]] = {}

    def assign(self, device: int, ids: list[str]) -> dict[str, str]:
        """Letters for ``ids`` (in order of first sight); forgets ids no longer in ``ids``."""
        old = self._by_device.get(device, {})
        book = {sid: old[sid] for sid in ids if sid in old}
        free = [c for c in LETTERS if c not in book.values()]
        for sid in ids:
            if sid not in book:
                book[sid] = free.pop(0) if free else UNKNOWN_CHAR
        self._by_device[device] = book
        return book


def fetch(endpoint: str, timeout: float) -> p.StatusReply:
    """One status; :class:`NodeAgentError` when the daemon cannot be asked or refuses."""
    try:
        return query_status(endpoint, timeout=timeout)
    except NodeAgentError:
        raise
    except Exception as exc:  # a garbled reply or an odd socket error must not be a traceback
        raise NodeAgentError(f"bad status reply from {endpoint}: {type(exc).__name__}: {exc}") from None


def strip(activity: p.TokenActivity, letters: dict[str, str], width: int | None) -> str:
    """One character a bucket, oldest first; the newest ``width`` buckets if given."""
    return _newest([IDLE_CHAR if sid == "" else _letter(sid, letters) for sid in activity.timeline], width)


def also_strip(activity: p.TokenActivity, letters: dict[str, str], width: int | None) -> str:
    """Under the strip: per bucket, who else held a token in it (the next longest; ``+`` when
    two or more others did), blank where nobody else did. Empty from a daemon before 2.7."""
    holders = activity.holders
    if len(holders) != len(activity.timeline) or not any(len(held) > 1 for held in holders):
        return ""
    chars = []
    for longest, held in zip(activity.timeline, holders):
        others = [sid for sid in held if sid != longest]  # an idle bucket ("") keeps whoever held it at all
        chars.append(" " if not others else "+" if len(others) > 1 else _letter(others[0], letters))
    return _newest(chars, width)


def _letter(sid: str, letters: dict[str, str]) -> str:
    return MANY_CHAR if sid == "*" else letters.get(sid, UNKNOWN_CHAR)


def _newest(chars: list[str], width: int | None) -> str:
    """The last ``width`` characters (all if ``width`` is None), joined."""
    return "".join(chars if width is None else chars[max(0, len(chars) - max(0, width)):])


def name_width(names) -> int:
    """The NAME column: as wide as the longest name shown (README's ``examples/inference_service``
    whole), between 4 and 40 characters."""
    return min(40, max([4, *(len(shown(name)) for name in names)]))


def shown(text: str) -> str:
    """A peer's string (a session name) as it may reach a terminal: no control characters,
    so that a name cannot move the cursor, retitle the window or clear the screen."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} ms" if value < 10 else f"{value:.0f} ms"


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.0f}"


def _state(s: p.SessionInfo) -> str:
    if s.suspended:
        return s.suspended  # requested | suspended | stopped
    if s.stopped:
        return "stopped"
    return s.state if s.attached else f"{s.state}*"


def render(status: p.StatusReply, endpoint: str, *, width: int | None = None, letters: Letters | None = None,
           interval_s: float | None = None, clock: str | None = None) -> list[str]:
    """The frame for ``status`` as plain lines. ``width`` bounds the strip (lines are
    clipped by the caller); ``letters`` keeps letters stable across frames."""
    letters = letters if letters is not None else Letters()
    every = f"  every {interval_s:g} s" if interval_s is not None else ""
    when = f"  {clock}" if clock else ""
    lines = [f"nodeagent top  {endpoint}  pid {status.daemon_pid}  backend {status.backend}  "
             f"up {_uptime(status.uptime_s)}  "
             f"protocol {status.protocol[0]}.{status.protocol[1]}{every}{when}"]
    for d in status.devices:
        lines.append("")
        lines.extend(_device_lines(d, letters, width))
    return lines


def _uptime(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _device_lines(d: p.DeviceInfo, letters: Letters, width: int | None) -> list[str]:
    activity = d.activity
    sessions = {s.id: s for s in d.sessions}
    in_strip = [] if activity is None else [sid for sid in activity.timeline if sid not in ("", "*")]
    ids = list(sessions) + [sid for sid in dict.fromkeys(in_strip) if sid not in sessions]
    book = letters.assign(d.index, ids)

    def who(sid: str) -> str:
        s = sessions.get(sid)
        name = s.name if s is not None else (activity.names.get(sid, "") if activity is not None else "")
        return f"{book.get(sid, UNKNOWN_CHAR)} {shown(name or sid)}"

    used = "?" if d.memory_used_bytes is None else f"{d.memory_used_bytes / GIB:.1f}"
    util = "" if d.utilization_percent is None else f"  util {d.utilization_percent:.0f}%"
    mps = "  mps" if d.mps else ""
    lines = [f"device {d.index}  {d.name}  memory {used}/{d.memory_total_bytes / GIB:.1f} GiB{util}{mps}  "
             f"declared {d.memory_declared_mb}/{d.memory_capacity_mb} MiB"
             + (f" (workers {d.memory_workers_mb})" if d.memory_workers_mb else "")]
    queue = ", ".join(who(sid) for sid in d.queue[:8]) + (f", +{len(d.queue) - 8} more" if len(d.queue) > 8 else "")
    lines.append(f"  holder  {who(d.holder) if d.holder else '-'}    queue  {queue or '-'}")
    if activity is None:
        lines.append("  token   no history from this daemon (it speaks a protocol older than 2.1)")
    else:
        span = len(activity.timeline) * activity.bucket_ms / 1000.0
        room = None if width is None else max(8, width - 24)  # "  token   -60s |" and "| now" fit beside it
        drawn = strip(activity, book, room)
        seconds = len(drawn) * activity.bucket_ms / 1000.0 if drawn else span
        line = f"  token   -{seconds:g}s |{drawn}| now"
        scale = f"   ({activity.bucket_ms / 1000.0:g} s a char)"
        lines.append(line + scale if width is None or len(line) + len(scale) < width else line)
        also = also_strip(activity, book, room)
        if also:  # the token moved within those seconds: who else held it
            lines.append(f"{'also':>{len(line) - len(drawn) - 7}} |{also}|")
        lines.append(f"  waits   p50 {_ms(activity.wait_p50_ms)}  p99 {_ms(activity.wait_p99_ms)}  "
                     f"(last {activity.waits} grants)")
        lines.append(f"  counts  grants {activity.grants}  preemptions {activity.preemptions}  "
                     f"quantum-yields {activity.quantum_yields}  enforcements {activity.enforcements}  "
                     f"suspensions {activity.suspensions}")
    if d.sessions:
        wide = name_width(s.name for s in d.sessions)
        lines.append(f"     {'SESSION':<15}{'NAME':<{wide + 1}}{'CLASS':<12}{'STATE':<10}{'GRANTS':>7}{'GPU-TIME':>10}"
                     f"{'MEM-USED':>10}{'MEM-DECL':>10}{'PID':>9}")
        for s in d.sessions:
            pid = f"{s.pid}" + ("" if s.pid_verified else "?")
            lines.append(f"  {book.get(s.id, UNKNOWN_CHAR)}  {shown(s.id):<15}{shown(s.name)[:wide]:<{wide + 1}}"
                         f"{s.workload:<12}"
                         f"{_state(s):<10}{s.grants:>7}{s.gpu_time_s:>9.2f}s{_mib(s.memory_used_bytes):>10}"
                         f"{s.memory_mb:>10}{pid:>9}")
    else:
        lines.append("  no sessions")
    gone = [sid for sid in ids if sid not in sessions]
    if gone:
        lines.append("  left    " + "  ".join(who(sid) for sid in gone))
    return lines


# ---------------------------------------------------------------- entry points


def run_once(endpoint: str | None, timeout: float) -> int:
    """Print one frame to stdout; 0, or 1 with one line on stderr if the daemon cannot be asked."""
    endpoint = endpoint or client_endpoint()
    try:
        status = fetch(endpoint, timeout)
    except NodeAgentError as exc:
        print(f"nodeagent: error: {exc}", file=sys.stderr)  # names the endpoint and what to check
        return 1
    print("\n".join(render(status, endpoint)))
    return 0


def run_live(endpoint: str | None, interval_s: float, timeout: float) -> int:
    """The live view until ``q`` (or Ctrl-C); 0. 2 with one line if stdout is not a terminal."""
    endpoint = endpoint or client_endpoint()
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("nodeagent: error: top needs a terminal; use `nodeagent top --once` in scripts", file=sys.stderr)
        return 2
    # ncurses takes LINES and COLUMNS from the environment over the terminal's size, and then
    # never follows a resize; a shell may have left stale ones there.
    os.environ.pop("LINES", None)
    os.environ.pop("COLUMNS", None)
    try:
        curses.wrapper(_Live(endpoint, interval_s, timeout).run)
    except KeyboardInterrupt:
        pass
    except curses.error as exc:
        print(f"nodeagent: error: cannot draw on this terminal ({exc}); use `nodeagent top --once`", file=sys.stderr)
        return 2
    return 0


class _Live:
    """The curses loop: fetch every interval, draw (again on resize), wait for a key or the next fetch."""

    def __init__(self, endpoint: str, interval_s: float, timeout: float) -> None:
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.timeout = min(timeout, max(0.5, interval_s))  # a hung daemon must not freeze the keys for long
        self.letters = Letters()
        self.status: p.StatusReply | None = None
        self.problem: str | None = None  # why the last fetch failed
        self.fetched_at = ""

    def run(self, screen) -> None:
        with contextlib.suppress(curses.error):  # a terminal without an invisible cursor
            curses.curs_set(0)
        next_fetch = 0.0
        while True:
            if time.monotonic() >= next_fetch:
                self._fetch()
                next_fetch = time.monotonic() + self.interval_s
            self._draw(screen)
            screen.timeout(max(10, math.ceil((next_fetch - time.monotonic()) * 1000)))
            key = screen.getch()
            if key in (ord("q"), ord("Q")):
                return
            if key == curses.KEY_RESIZE:
                curses.update_lines_cols()  # the next _draw reads the new size

    def _fetch(self) -> None:
        self.fetched_at = time.strftime("%H:%M:%S")
        try:
            self.status = fetch(self.endpoint, self.timeout)
            self.problem = None
        except NodeAgentError as exc:
            self.status = None
            self.problem = str(exc)

    def _lines(self, width: int) -> list[str]:
        if self.status is None:
            return [f"nodeagent top  {self.endpoint}  {self.fetched_at}", "",
                    f"daemon not reachable at {self.endpoint}, retrying every {self.interval_s:g} s",
                    f"  ({self.problem})", "", "q quits"]
        return render(self.status, self.endpoint, width=width, letters=self.letters, interval_s=self.interval_s,
                      clock=self.fetched_at) + ["", "q quits"]

    def _draw(self, screen) -> None:
        height, width = screen.getmaxyx()
        lines = self._lines(width)
        screen.erase()
        for y, line in enumerate(lines[:height]):
            _put(screen, y, line, width, curses.A_REVERSE if y == 0 else curses.A_NORMAL)
        if len(lines) > height > 0:
            _put(screen, height - 1, f"... {len(lines) - height + 1} more lines (enlarge the window)", width)
        screen.refresh()


def _put(screen, y: int, line: str, width: int, attribute: int = curses.A_NORMAL) -> None:
    with contextlib.suppress(curses.error):  # the terminal shrank between getmaxyx and here
        screen.addnstr(y, 0, line, max(0, width - 1), attribute)
