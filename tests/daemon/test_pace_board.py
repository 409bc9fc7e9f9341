"""The pace board across a daemon's restarts (issue 32, items 1 and 9): a board a client maps is
never truncated under it, a restarted daemon's board is the one readers read, and readers mapping
it at full speed in other processes live through 50 SIGKILLed restarts of a real daemon."""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct
import subprocess
import sys

import pytest

from client_lib import Client
from client_lib import pace as pb
from tests.conftest import REPO, Daemon, wait_for

_REPORT = struct.Struct("<14Q")  # a reader's report: reads done, the board's pid, 4 words per class

# A reader in its own process, at full speed: reads every class's slot, and writes what it sees
# (and how many reads it made) into its report file whenever that changes, and every 4096 reads.
_READER = r"""
import mmap, os, struct, sys
from client_lib import pace as pb
board, report = sys.argv[1], sys.argv[2]
fd = os.open(report, os.O_RDWR)
out = mmap.mmap(fd, 112)
os.close(fd)
reader = pb.PaceBoardReader(board)
pack = struct.Struct("<14Q").pack_into
last, n = None, 0
print("READING", flush=True)
while True:
    view = (reader.read(0), reader.read(1), reader.read(2))
    n += 1
    if view != last or not n & 4095:
        last = view
        words = [w for p in view for w in (p.present, int(p.active), p.duty_permille, p.period_us)]
        pack(out, 0, n, reader.daemon_pid, *words)
        if os.path.exists(report + ".stop"):
            print(n, *[w for p in view for w in (p.present, int(p.active), p.duty_permille)], flush=True)
            break
"""


def _view(pace_by_class: tuple[pb.Pace, ...]) -> tuple[int, ...]:
    return tuple(w for p in pace_by_class for w in (p.present, int(p.active), p.duty_permille, p.period_us))


class _Reader:
    """A ``_READER`` process and its report."""

    def __init__(self, board: str, report: str) -> None:
        with open(report, "wb") as f:
            f.write(b"\0" * 112)
        self.report_path = report
        self.proc = subprocess.Popen([sys.executable, "-c", _READER, board, report], cwd=REPO,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert self.proc.stdout.readline().startswith("READING")
        fd = os.open(report, os.O_RDONLY)
        self._report = mmap.mmap(fd, 112, prot=mmap.PROT_READ)
        os.close(fd)

    def seen(self) -> tuple[int, int, tuple[int, ...]]:
        """(reads done, the pid it read on the board, its view): two equal reads of the report."""
        while True:
            first = _REPORT.unpack_from(self._report, 0)
            if _REPORT.unpack_from(self._report, 0) == first:
                return first[0], first[1], first[2:]

    def stop(self) -> str:
        open(self.report_path + ".stop", "w").close()
        out, _ = self.proc.communicate(timeout=10)
        return out


def _fresh(board: str) -> tuple[int, tuple[int, ...]] | None:
    """What the board at ``board`` says now, read through a new map: (pid, view); None if unreadable."""
    try:
        reader = pb.PaceBoardReader(board)
    except OSError:
        return None
    try:
        view = _view(tuple(reader.read(k) for k in range(pb.CLASSES)))
        return reader.daemon_pid, view
    finally:
        reader.close()


# ------------------------------------------------------------------- the board itself


def test_a_restarted_writer_reuses_the_board_in_place_and_carries_its_sequence_on(tmp_path):
    path = str(tmp_path / "dev0")
    first = pb.PaceBoardWriter(path)  # the daemon that will be SIGKILLed: never closed
    first.set(1, pb.Pace(1, True, 0, 10_000))
    reader = pb.PaceBoardReader(path)
    assert reader.read(1) == pb.Pace(1, True, 0, 10_000)
    inode = os.stat(path).st_ino
    second = pb.PaceBoardWriter(path)  # the restarted daemon
    second.set(1, pb.Pace(2, True, 250, 4000))
    assert os.stat(path).st_ino == inode and os.stat(path).st_size == pb.SIZE  # in place, never shrunk
    # A sequence started over would match the one this reader cached, and it would keep the old slot.
    assert reader.read(1) == pb.Pace(2, True, 250, 4000)
    assert reader.daemon_pid == os.getpid()
    second.close()
    assert reader.read(1) == pb.FREE


def test_a_file_that_is_not_a_board_is_replaced_by_rename_and_left_whole(tmp_path):
    path = str(tmp_path / "dev0")
    with open(path, "wb") as f:
        f.write(b"\xff" * 4096)  # not a board: replaced, never truncated under whoever maps it
    held = os.open(path, os.O_RDONLY)
    try:
        writer = pb.PaceBoardWriter(path)
        assert os.fstat(held).st_size == 4096 and os.stat(path).st_ino != os.fstat(held).st_ino
        assert os.stat(path).st_size == pb.SIZE and pb.PaceBoardReader(path).read(1) == pb.FREE
        assert sorted(os.listdir(tmp_path)) == ["dev0"]  # the new file was renamed, nothing left beside
        writer.close()
    finally:
        os.close(held)


def test_a_reader_maps_the_board_a_clean_restart_put_at_its_path_within_its_recheck(tmp_path):
    path = str(tmp_path / "dev0")
    now = [0.0]
    first = pb.PaceBoardWriter(path)
    reader = pb.PaceBoardReader(path, recheck_s=0.05, clock=lambda: now[0])
    assert reader.read(1) == pb.FREE
    first.close()  # a clean stop: cleared and unlinked
    second = pb.PaceBoardWriter(path)  # the next daemon's board: another file at the same path
    second.set(1, pb.Pace(1, True, 0, 10_000))

    def reads() -> set[pb.Pace]:  # the clock is looked at every RECHECK_READS reads
        return {reader.read(1) for _ in range(pb.RECHECK_READS)}

    now[0] = 0.04
    assert reads() == {pb.FREE}  # not yet rechecked: at most one stat per recheck_s
    now[0] = 0.05
    assert reads() == {pb.FREE, pb.Pace(1, True, 0, 10_000)}
    assert reader.read(1) == pb.Pace(1, True, 0, 10_000) and reader.daemon_pid == os.getpid()
    os.unlink(path)  # no board at the path (between two daemons): the one mapped stays
    now[0] = 0.2
    assert reads() == {pb.Pace(1, True, 0, 10_000)}
    second.close()


# A board recreated in place (the daemon's restart path) from another process, as fast as it goes,
# while this child reads it at full speed: a truncation, however brief, is a SIGBUS here.
_RECREATE_READER = r"""
import os, sys
from client_lib import pace as pb
path, stop = sys.argv[1], sys.argv[2]
reader = pb.PaceBoardReader(path)
print("READING", flush=True)
n = 0
while True:
    pace = reader.read(1)
    n += 1
    if not n & 1023 and os.path.exists(stop):
        break
print(n, pace.present, int(pace.active), pace.duty_permille, flush=True)
"""


def test_recreating_a_board_500_times_under_a_reader_at_full_speed_never_faults_it(tmp_path):
    path, stop = str(tmp_path / "dev0"), str(tmp_path / "stop")
    pb.PaceBoardWriter(path)
    child = subprocess.Popen([sys.executable, "-c", _RECREATE_READER, path, stop], cwd=REPO,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().startswith("READING")
        for n in range(500):
            writer = pb.PaceBoardWriter(path)  # a restart: the last one left its board as it was
            writer.set(1, pb.Pace(1 + n % 3, True, 0, 10_000))
            if child.poll() is not None:
                break
        writer.set(1, pb.Pace(7, True, 125, 10_000))
        open(stop, "w").close()
        out, _ = child.communicate(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, f"the reader died ({child.returncode}: -7 is SIGBUS) after {n + 1} recreations"
    reads, present, active, duty = map(int, out.split())
    assert reads > 0 and (present, active, duty) == (7, 1, 125)


# ------------------------------------------------------------------- a real daemon restarted

# An inference service holding its slice: the board tells the trainers' class that a higher class
# is on the device (restored from the journal after each restart, and reattached in the background).
_HOLDER = r"""
import os, time
from client_lib import Client
c = Client("ranker", workload="inference", endpoint=os.environ["NODEAGENT_ENDPOINT"])
with c.slice():
    print("HOLDING", flush=True)
    while True:
        time.sleep(1)
"""


def _holder(endpoint: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "NODEAGENT_ENDPOINT": endpoint, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().startswith("HOLDING")
    return proc


# Daemons forked from one process that has done `nodeagent serve`'s imports (a zygote): each restart
# is a new process running the real `nodeagent serve` (nodeagent.cli.main) from the start of its
# main, so that a restart costs the daemon's own start (socket, journal, restore, boards) and not
# seconds of Python imports on a loaded machine. A line on its stdin forks one; it answers the pid.
_ZYGOTE = r"""
import os, signal, sys, threading, traceback
import nodeagent.cli, nodeagent.daemon.server, nodeagent.daemon.cluster, nodeagent.journal
log, argv = sys.argv[1], sys.argv[2:]
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the daemons it forks are reaped as they die
print("READY", flush=True)
for line in sys.stdin:
    assert threading.active_count() == 1  # a fork copies no thread: nothing half-done in the child
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        code = 1
        try:
            code = nodeagent.cli.main(argv) or 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    print(pid, flush=True)
"""


class _Daemons:
    """Start ``nodeagent serve`` again and again on one workdir (see ``_ZYGOTE``)."""

    def __init__(self, workdir: str, extra: list[str]) -> None:
        self.spec = Daemon(workdir, extra)  # its endpoint, paths and status()
        config = os.path.join(workdir, "nodeagent.toml")
        open(config, "a").close()
        self.zygote = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, self.spec.log_path, "serve", "--config", config, "--backend", "cpu",
             "--endpoint", self.spec.endpoint, "--state-dir", os.path.join(workdir, "state"), "--ctxpool", "off",
             *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self.zygote.stdout.readline() == "READY\n"
        self.pid = 0

    def start(self, timeout: float = 30.0) -> int:
        """A new daemon, once it answers status: its pid."""
        self.zygote.stdin.write("\n")
        self.zygote.stdin.flush()
        line = self.zygote.stdout.readline()
        assert line, f"the process that forks the daemons died ({self.zygote.poll()})"
        self.pid = int(line)
        wait_for(lambda: not self._alive() or self._up(), timeout=timeout)
        assert self._alive(), f"daemon did not start:\n{self.spec.log()}"
        return self.pid

    def kill(self) -> None:
        """SIGKILL the daemon; returns once it is gone."""
        pidfd = os.pidfd_open(self.pid)
        try:
            os.kill(self.pid, signal.SIGKILL)
            assert select.select([pidfd], [], [], 10)[0], f"daemon {self.pid} outlived SIGKILL"
        finally:
            os.close(pidfd)

    def close(self) -> None:
        if self.pid and self._alive():
            self.kill()
        self.zygote.kill()
        self.zygote.wait()

    def _alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def _up(self) -> bool:
        try:
            self.spec.status()
            return True
        except Exception:
            return False


def _live(board: str, pid: int):
    """The board, read anew, once the daemon ``pid`` wrote it with the service restored on it."""
    fresh = _fresh(board)
    return fresh if fresh and fresh[0] == pid and fresh[1][4] == 1 else None


RESTARTS = 50


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_50_sigkilled_restarts_under_readers_at_full_speed_leave_them_alive_on_the_live_board(workdir):
    daemons = _Daemons(workdir, ["--sharing", "corun", "--corun-duty", "pause"])
    board = os.path.join(workdir, "pace", "dev0")
    readers: list[_Reader] = []
    holder = None
    try:
        pid = daemons.start()
        holder = _holder(daemons.spec.endpoint)
        wait_for(lambda: _live(board, pid))
        readers = [_Reader(board, os.path.join(workdir, f"report{k}")) for k in range(2)]
        for restart in range(RESTARTS):
            reads_before = [r.seen()[0] for r in readers]
            daemons.kill()  # SIGKILL: the board is left as it was, mapped by every reader
            pid = daemons.start()
            for k, r in enumerate(readers):
                # What the restarted daemon's board says (read anew each time) is what the reader sees.
                wait_for(lambda: r.proc.poll() is not None or (
                    r.seen()[0] > reads_before[k] and r.seen()[1:] == _live(board, pid)), timeout=10)
                assert r.proc.poll() is None, f"reader {k} died ({r.proc.returncode}) at restart {restart + 1}"
        for k, r in enumerate(readers):
            out = r.stop().split()
            assert r.proc.returncode == 0 and int(out[0]) > 0, (k, r.proc.returncode, out)
    finally:
        for r in readers:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        if holder is not None:
            holder.kill()
            holder.wait()
        daemons.close()


def test_after_a_clean_restart_a_resumed_trainer_reads_the_new_board_not_the_unlinked_one(start_daemon):
    d = start_daemon("--sharing", "corun", "--corun-duty", "pause")
    with Client("trainer", workload="training", endpoint=d.endpoint) as trainer:
        path = trainer.welcome.pace
        old = os.stat(path).st_ino
        welcome = trainer.welcome
        assert trainer.pacing.pace().present == 0
        assert d.stop(signal.SIGTERM) == 0  # a clean stop: the board cleared and unlinked
        d = start_daemon("--sharing", "corun", "--corun-duty", "pause")
        wait_for(lambda: trainer.welcome is not welcome, timeout=10)  # reattached in the background
        assert trainer.durable is not None  # (waits for the client's lock: the reattach has finished)
        assert trainer.welcome.resumed and trainer.welcome.pace == path and os.stat(path).st_ino != old
        holder = _holder(d.endpoint)
        try:
            wait_for(lambda: (_fresh(path) or (0, ()))[1][4:6] == (1, 1), timeout=5)  # the new board: it holds
            # One read, well before the reader's own recheck: the reattach mapped the new board
            # (the old one, unlinked, still says nobody is there).
            pace = trainer.pacing.pace()
            assert pace.present == 1 and pace.throttled and trainer.pacing.reader.daemon_pid == d.proc.pid
        finally:
            holder.kill()
            holder.wait()


def test_boards_that_cannot_all_be_made_are_all_removed_and_none_is_named(tmp_path):
    """A board that cannot be made (here a directory stands at dev1's path) leaves no co-run
    device paced by a board: the one made before it is closed and unlinked, and none is named."""
    from sharing.corun import PaceController

    from nodeagent.daemon.tokens import Pacing

    (tmp_path / "pace" / "dev1").mkdir(parents=True)
    pacing = Pacing(sessions={}, devices=(0, 1), new_controller=PaceController, clock=lambda: 0.0)
    pacing.start(None, str(tmp_path))
    assert pacing.board_path(0) == "" and pacing.board_path(1) == ""
    assert sorted(os.listdir(tmp_path / "pace")) == ["dev1"]
    pacing.refresh_all([])  # nothing to write
