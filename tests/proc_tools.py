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
