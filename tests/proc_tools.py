"""Reading /proc for the tests: a process's state letter, its resident memory, whether it is gone."""

from __future__ import annotations

from tests.conftest import wait_for


def proc_state(pid: int) -> str:
    """The one-letter state of /proc/PID/stat: T means stopped."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2:].split()[0].decode()


def assert_stopped(pid: int) -> None:
    """SIGSTOP takes effect when the target next runs: a runnable process shows R
    until it is scheduled, then T. Wait for it (it cannot run user code meanwhile)."""
    wait_for(lambda: proc_state(pid) == "T", timeout=2)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie (an orphan's reaper may be slow, or never reap)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(b")") + 2:].split()[0] in (b"Z", b"X")


def cpu_ticks() -> dict[int, tuple[str, int]]:
    """Every process's (command line, user+system clock ticks) now: two of these, taken around a
    timed stretch, say which processes took the machine's time while it ran (``busiest``)."""
    import os

    seen: dict[int, tuple[str, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        cmd = cmd or stat[stat.find(b"(") + 1:stat.rfind(b")")].decode(errors="replace")
        seen[int(name)] = (cmd[:90], int(fields[11]) + int(fields[12]))
    return seen


def busiest(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], top: int = 6) -> str:
    """The processes that took the most CPU between two ``cpu_ticks``, in milliseconds."""
    import os

    hz = os.sysconf("SC_CLK_TCK")
    used = sorted(((ticks - before.get(pid, (cmd, 0))[1], pid, cmd) for pid, (cmd, ticks) in after.items()),
                  reverse=True)
    return "; ".join(f"{pid} {1000 * t // hz} ms {cmd!r}" for t, pid, cmd in used[:top] if t > 0)
