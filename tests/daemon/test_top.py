"""``nodeagent top`` (issue 14): the daemon's per-device token history (DeviceStats, the
``activity`` of a status reply) and the view, as one frame (``--once``) against a real
daemon with real clients taking turns, and live in a real terminal (tmux)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from client_lib import Client, resume_session, suspend_session
from client_lib import protocol as p
from nodeagent import top
from nodeagent.daemon.history import MANY, MAX_HOLDERS_PER_BUCKET, DeviceStats, percentile
from tests.conftest import REPO, wait_for

# --------------------------------------------------------------------- DeviceStats


def test_waits_are_a_bounded_ring_of_the_latest_grants():
    stats = DeviceStats(wait_window=8)
    for i in range(100):
        stats.granted("s-a", "a", float(i), waited_s=i / 1000.0)
    report = stats.report(100.0, holders=("s-a",))
    assert report.grants == 100 and report.waits == 8  # the ring holds the last 8 only
    assert len(stats._waits) == 8
    # The last 8 waits are 92..99 ms: nearest-rank p50 is the 4th, p99 the 8th.
    assert report.wait_p50_ms == pytest.approx(95.0) and report.wait_p99_ms == pytest.approx(99.0)


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([7.0], 50) == 7.0 and percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.0 and percentile([1.0, 2.0], 99) == 2.0
    empty = DeviceStats().report(5.0, holders=())
    assert empty.waits == 0 and empty.wait_p50_ms is None and empty.wait_p99_ms is None


def test_the_timeline_names_who_held_each_bucket_longest():
    stats = DeviceStats(bucket_s=1.0, buckets=8)
    stats.granted("s-a", "trainer-a", 100.0, 0.0)
    stats.slice_ended("s-a", 102.5)  # a: 100..102.5
    stats.granted("s-b", "trainer-b", 102.7, 0.0)
    stats.slice_ended("s-b", 103.2)  # b: 102.7..103.2 (half of bucket 102 is a's, 0.3 b's)
    stats.granted("s-a", "trainer-a", 104.6, 0.0)  # still holding at the report: counts up to now
    report = stats.report(106.5, holders=("s-a",))
    # buckets 99..106, oldest first: 99 before anything, 100-101 a, 102 a (0.5 > 0.3 b, 0.2 idle),
    # 103 idle (0.2 b), 104 idle (0.4 a < 0.6 free), 105 a, 106 a (0.5 of the 0.5 so far)
    assert report.timeline == ["", "s-a", "s-a", "s-a", "", "", "s-a", "s-a"]
    assert report.bucket_ms == 1000.0
    # (2.7) and everyone who held it in each bucket, longest first: b's two short turns too
    assert report.holders == [[], ["s-a"], ["s-a"], ["s-a", "s-b"], ["s-b"], ["s-a"], ["s-a"], ["s-a"]]
    assert report.names == {"s-a": "trainer-a", "s-b": "trainer-b"}
    # A wider view of the same: b wins its bucket when it held it longest.
    stats.slice_ended("s-a", 107.0)
    stats.granted("s-b", "trainer-b", 107.0, 0.0)
    report = stats.report(108.0, holders=("s-b",))
    assert report.timeline[-2:] == ["s-b", ""]  # 107 was b's; 108 has only just begun
    assert report.names == {"s-a": "trainer-a", "s-b": "trainer-b"}


def test_the_timeline_is_bounded_in_time_and_in_sessions():
    stats = DeviceStats(bucket_s=1.0, buckets=10)
    stats.granted("s-long", "long", 0.0, 0.0)
    stats.slice_ended("s-long", 1e6)  # a slice far longer than the timeline touches its buckets only
    assert sorted(tag for tag in stats._tags if tag >= 0) == list(range(999_991, 1_000_000))
    assert stats.report(1e6 + 0.5, holders=()).timeline == ["s-long"] * 9 + [""]
    assert stats.report(1e6 + 20.0, holders=()).timeline == [""] * 10  # wrapped: the old buckets are gone

    t = 2e6
    for i in range(50):  # 50 sessions in one bucket, each 10 ms
        stats.granted(f"s-{i:03d}", f"n{i}", t, 0.0)
        t += 0.01
        stats.slice_ended(f"s-{i:03d}", t)
    slot = stats._held[int(2e6) % 10]
    assert len(slot) == MAX_HOLDERS_PER_BUCKET + 1 and MANY in slot  # the rest pooled
    report = stats.report(2e6 + 0.6, holders=())
    assert report.timeline[-1] == MANY  # 0.42 s pooled beats 0.1 s idle and any single session


def test_a_status_closes_a_slice_whose_end_was_not_reported():
    """Serving sub-sessions release inside the serving component; the scheduler's holder,
    read with every status, ends a slice the stats were not told about."""
    stats = DeviceStats(bucket_s=1.0, buckets=4)
    stats.granted("s-x:serve", "x (server-side)", 10.0, 0.0)
    assert stats.report(11.5, holders=("s-x:serve",)).timeline[-2:] == ["s-x:serve", "s-x:serve"]
    report = stats.report(13.9, holders=())  # it released at some point, not after this status
    assert report.timeline == ["s-x:serve"] * 4 and not stats._open
    assert stats.report(15.5, holders=()).timeline == ["s-x:serve", "s-x:serve", "", ""]  # closed for good


def test_counters():
    stats = DeviceStats()
    stats.yield_asked("preempted")
    stats.yield_asked("quantum")
    stats.yield_asked("quantum")
    stats.enforced()
    report = stats.report(1.0, holders=())
    assert (report.preemptions, report.quantum_yields, report.enforcements) == (1, 2, 1)


def test_a_serving_queue_counts_in_its_devices_history():
    """Actions for a serving sub-session go to the serving component; the tokens
    component still counts them in the device's history, under the owner's name."""
    from nodeagent.daemon.sessions import Session, SessionTable
    from sharing import Workload
    from tests.daemon_parts import make_tokens

    from nodeagent.daemon.bus import Bus, DelegatedAction

    delegated = []
    sessions = SessionTable()
    bus = Bus()
    bus.subscribe(DelegatedAction, lambda event: delegated.append(event.action))
    tokens = make_tokens(sessions=sessions, bus=bus)
    try:
        owner = Session(id="s-owner", key="k", route="r", name="ranker", claimed_pid=1, verified_pid=None,
                        start_ticks=None, uid=0, workload=Workload.INFERENCE, weight=1.0, device=0, memory_mb=0,
                        last_seen=0.0)
        sessions.add(owner)
        scheduler = tokens.schedulers[0]
        tokens.add(0, "s-owner:serve", Workload.INFERENCE, 1.0, 0.0, delegated=True)
        tokens.apply(scheduler.request("s-owner:serve", 10.0), 10.0)
        assert [type(a).__name__ for a in delegated] == ["Grant"]  # still the serving component's to carry out
        grant = delegated[0].grant
        tokens.apply(scheduler.release("s-owner:serve", grant, 12.5), 12.5)  # as serving releases: no hook
        report = tokens.stats[0].report(13.0, holders=scheduler.holders())
        assert report.grants == 1 and report.names == {"s-owner:serve": "ranker (server-side)"}
        assert report.timeline[-4:] == ["s-owner:serve", "s-owner:serve", "s-owner:serve", ""]
    finally:
        sessions.close()


def test_letters_stay_with_their_sessions_across_frames():
    letters = top.Letters()
    assert letters.assign(0, ["s-a", "s-b"]) == {"s-a": "A", "s-b": "B"}
    assert letters.assign(0, ["s-b", "s-c"]) == {"s-b": "B", "s-c": "A"}  # b keeps B; a's A goes to c
    assert letters.assign(1, ["s-z"]) == {"s-z": "A"}  # per device
    many = letters.assign(2, [f"s-{i}" for i in range(60)])
    assert len(set(many.values()) - {top.UNKNOWN_CHAR}) == 52 and many["s-59"] == top.UNKNOWN_CHAR


def test_top_help_says_what_it_shows():
    done = subprocess.run([sys.executable, "-m", "nodeagent", "top", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=20)
    assert done.returncode == 0
    for fragment in ("--once", "--interval", "q quits", "p50/p99", "preemptions", "enforcements", "suspensions"):
        assert fragment in done.stdout, fragment


def test_a_frame_from_an_older_daemon_says_it_has_no_history():
    status = p.StatusReply(id=1, protocol=(2, 0), daemon_pid=1, backend="cpu", uptime_s=3.0, devices=[
        p.DeviceInfo(index=0, backend="cpu", uuid="CPU-0", name="cpu:0", memory_total_bytes=1 << 30,
                     memory_used_bytes=None, utilization_percent=None, holder=None, queue=[], sessions=[])])
    frame = "\n".join(top.render(status, "ipc:///x"))
    assert "no history from this daemon" in frame and "no sessions" in frame


def test_a_session_name_cannot_write_escape_codes_to_the_terminal():
    hostile = "x\x1b]0;owned\x07\x1b[2J\rname"  # retitle the window, clear the screen
    row = p.SessionInfo(id="s-1", name=hostile, pid=5, pid_verified=True, workload="training", weight=1.0,
                        state="holding", gpu_time_s=1.0, grants=1, memory_mb=0)
    activity = p.TokenActivity(grants=1, timeline=["s-gone", "s-1"], names={"s-gone": "\x1b[31mred"})
    status = p.StatusReply(id=1, protocol=(2, 1), daemon_pid=1, backend="cpu", uptime_s=3.0, devices=[
        p.DeviceInfo(index=0, backend="cpu", uuid="CPU-0", name="cpu:0", memory_total_bytes=1 << 30,
                     memory_used_bytes=None, utilization_percent=None, holder="s-1", queue=[], sessions=[row],
                     activity=activity)])
    frame = "\n".join(top.render(status, "ipc:///x"))
    assert "\x1b" not in frame and "\x07" not in frame and "\r" not in frame
    assert "holder  A x?]0;owned??[2J?name" in frame and "left    B ?[31mred" in frame and "|BA| now" in frame


def test_the_strip_shows_the_token_moving_not_only_who_held_longest():
    """A trainer holds most of every second and a service takes short slices in some (the
    README's walkthrough): the strip alone says only the trainer; the row under it shows the
    service's turns, and its name is shown whole."""
    trainer = p.SessionInfo(id="s-t", name="examples/train_loop", pid=5, pid_verified=True, workload="training",
                            weight=1.0, state="holding", gpu_time_s=9.0, grants=40, memory_mb=0)
    service = p.SessionInfo(id="s-i", name="examples/inference_service", pid=6, pid_verified=True,
                            workload="inference", weight=1.0, state="idle", gpu_time_s=0.4, grants=40, memory_mb=0)
    activity = p.TokenActivity(grants=80, timeline=["s-t", "s-t", "s-t", "", "s-t"],
                               holders=[["s-t", "s-i"], ["s-t"], ["s-t", "s-i", "s-x"], ["s-i"], ["s-t", "s-i"]],
                               names={"s-t": "examples/train_loop", "s-i": "examples/inference_service",
                                      "s-x": "other"})
    status = p.StatusReply(id=1, protocol=(2, 7), daemon_pid=1, backend="cpu", uptime_s=3.0, devices=[
        p.DeviceInfo(index=0, backend="cpu", uuid="CPU-0", name="cpu:0", memory_total_bytes=1 << 30,
                     memory_used_bytes=None, utilization_percent=None, holder="s-t", queue=[],
                     sessions=[trainer, service], activity=activity)])
    frame = "\n".join(top.render(status, "ipc:///x"))
    assert "|AAA.A| now" in frame, frame
    [also] = [line for line in frame.splitlines() if line.strip().startswith("also |")]
    assert also.strip() == "also |B +BB|", frame  # B's turns; "+": two others; the idle second: B held some
    assert also.index("|") == frame.splitlines()[[i for i, line in enumerate(frame.splitlines())
                                                  if "| now" in line][0]].index("|")  # under the strip
    assert "examples/inference_service " in frame  # whole, not examples/inference_
    from nodeagent.cli import format_status
    assert "examples/inference_service " in format_status(status)
    # a daemon before 2.7 sends no holders: no second row
    older = p.TokenActivity(grants=80, timeline=activity.timeline, names=activity.names)
    status.devices[0].activity = older
    assert "also |" not in "\n".join(top.render(status, "ipc:///x"))


def test_a_narrow_frame_keeps_the_newest_buckets_of_both_rows():
    activity = p.TokenActivity(timeline=["a", "", "*", "b", "z"],
                               holders=[["a"], [], ["*"], ["b", "*"], ["z", "b", "c"]])
    letters = {"a": "A", "b": "B"}
    assert top.strip(activity, letters, None) == top.strip(activity, letters, 9) == "A.*B?"
    assert top.strip(activity, letters, 3) == "*B?"
    assert top.strip(activity, letters, 0) == top.strip(activity, letters, -1) == ""
    assert top.also_strip(activity, letters, None) == "   *+"
    assert top.also_strip(activity, letters, 2) == "*+"


# --------------------------------------------------------------------- --once, real daemon


def run_top(endpoint: str, *args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodeagent", "top", "--endpoint", endpoint, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def strip_of(frame: str) -> str:
    match = re.search(r"token   -\d+s \|([^|]*)\| now", frame)
    assert match, frame
    return match.group(1)


@pytest.mark.slow
def test_once_shows_holder_queue_strip_and_counters(start_daemon):
    daemon = start_daemon("--quantum-ms", "training=20000", "--grace-ms", "100", "--enforce", "revoke")
    ep = daemon.endpoint
    a = Client("trainer-a", device=0, memory_mb=256, endpoint=ep)
    b = Client("trainer-b", device=0, memory_mb=128, endpoint=ep)
    c = None
    try:
        a.acquire(timeout=5)
        time.sleep(1.2)  # a holds a bucket of the strip on its own
        b.request()
        wait_for(lambda: daemon.status().devices[0].queue == [b.session_id])
        first = run_top(ep, "--once")
        assert first.returncode == 0, first.stderr
        assert "\x1b" not in first.stdout  # plain text for scripts
        assert re.search(r"holder  A trainer-a\s+queue  B trainer-b", first.stdout), first.stdout
        assert re.search(rf"  A  {a.session_id} trainer-a .* holding .*\s256\s", first.stdout), first.stdout
        assert re.search(rf"  B  {b.session_id} trainer-b .* waiting .*\s128\s", first.stdout), first.stdout
        assert strip_of(first.stdout).endswith("A") and "B" not in strip_of(first.stdout)

        a.release()  # b's turn
        b.acquire(timeout=5)
        time.sleep(1.2)
        c = Client("ranker", workload="inference", device=0, endpoint=ep)
        c.acquire(timeout=5)  # b is asked to yield, never answers: revoked 100 ms later (enforcement)
        c.release()

        outcome = {}

        def operator() -> None:  # suspend a (it parks in a.yield_point below), then let it back
            try:
                outcome["suspend"] = suspend_session(a.session_id, deadline_ms=30_000, endpoint=ep)
            finally:  # whatever happened, a.yield_point() must not wait for a resume for ever
                resume_session(a.session_id, endpoint=ep)

        t = threading.Thread(target=operator)
        t.start()
        wait_for(lambda: a.yield_point(), timeout=10, interval=0.01)  # True once suspended and resumed
        t.join(timeout=10)
        assert outcome["suspend"].outcome == "suspended"

        second = run_top(ep, "--once")
        assert second.returncode == 0, second.stderr
        out = second.stdout
        assert re.search(r"A+B+", strip_of(out)), out  # a's turn, then b's, in order
        assert "holder  -    queue  -" in out, out
        assert re.search(r"counts  grants 3  preemptions 1  quantum-yields 0  enforcements 1  suspensions 1", out), out
        assert re.search(r"waits   p50 \d[\d.]* ms  p99 \d[\d.]* ms  \(last 3 grants\)", out), out
        assert re.search(r"  C  s-\w+ +ranker +inference", out), out
    finally:
        for client in (a, b, c):
            if client is not None:
                client.close()


def test_once_says_in_one_line_when_the_daemon_is_not_there(workdir):
    ep = f"ipc://{workdir}/nobody.sock"
    done = run_top(ep, "--once", "--timeout", "1")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and ep in done.stderr and "Traceback" not in done.stderr


def test_the_live_view_needs_a_terminal(workdir):
    done = subprocess.run([sys.executable, "-m", "nodeagent", "top", "--endpoint", f"ipc://{workdir}/x.sock"],
                          cwd=REPO, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "--once" in done.stderr and "Traceback" not in done.stderr


# --------------------------------------------------------------------- live, in tmux


class Tmux:
    """A private tmux server (its own socket) running one command in a 120x40 window."""

    def __init__(self, workdir: str) -> None:
        self.socket = os.path.join(workdir, "tmux.sock")
        self.session = "top"

    def tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, timeout=10,
                              check=check)

    def start(self, command: str) -> None:
        self.tmux("new-session", "-d", "-s", self.session, "-x", "120", "-y", "40", "-c", str(REPO), command)

    def screen(self) -> str:
        done = self.tmux("capture-pane", "-p", "-t", self.session, check=False)
        return done.stdout if done.returncode == 0 else ""

    def alive(self) -> bool:
        return self.tmux("has-session", "-t", self.session, check=False).returncode == 0

    def close(self) -> None:
        self.tmux("kill-server", check=False)


@pytest.fixture
def tmux(workdir):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    t = Tmux(workdir)
    yield t
    t.close()


@pytest.mark.slow
def test_live_view_in_a_real_terminal(start_daemon, workdir, tmux):
    daemon = start_daemon()
    ep = daemon.endpoint
    rc_file = os.path.join(workdir, "top.rc")
    # A shell may export stale LINES and COLUMNS; the view must follow the terminal itself.
    tmux.start(f"LINES=24 COLUMNS=80 {sys.executable} -m nodeagent top --endpoint {ep} --interval 0.2; "
               f"echo $? > {rc_file}")

    def showing(text: str, timeout: float = 15.0) -> str:
        return wait_for(lambda: (lambda screen: screen if text in screen else None)(tmux.screen()), timeout)

    a = Client("trainer-a", device=0, endpoint=ep)
    try:
        a.acquire(timeout=5)
        screen = showing("holder  A trainer-a")
        assert "nodeagent top" in screen and "q quits" in screen and "Traceback" not in screen
        # All 60 s of the strip fit the 120 columns (the terminal's size, not a stale $COLUMNS).
        # (The current second shows A once A has held it longest: wait for the frame that says so.)
        wait_for(lambda: re.search(r"token   -60s \|\.*A+\| now   \(1 s a char\)", tmux.screen()), 15)

        # The daemon goes away: the view says so and keeps trying; it comes back: the frame again.
        a.close()
        a = None
        assert daemon.stop() == 0
        gone = showing(f"daemon not reachable at {ep}, retrying")
        assert "Traceback" not in gone and tmux.alive()
        start_daemon()
        showing("holder  -")

        # A smaller window: the frame is drawn again to fit.
        tmux.tmux("resize-window", "-t", tmux.session, "-x", "60", "-y", "12")

        def redrawn(screen: str) -> str | None:  # the strip shortened to fit, "now" in view
            lines = screen.splitlines()
            fits = lines and len(lines) <= 12 and max(len(line) for line in lines) <= 60
            return screen if fits and re.search(r"token   -\d+s \|\.+\| now$", screen, re.M) else None

        try:
            narrow = wait_for(lambda: redrawn(tmux.screen()))
        except AssertionError:
            raise AssertionError(f"not redrawn to fit 60x12:\n{tmux.screen()}") from None
        assert "holder  -" in narrow and "Traceback" not in narrow

        tmux.tmux("send-keys", "-t", tmux.session, "q")
        wait_for(lambda: not tmux.alive(), timeout=10)
        assert open(rc_file).read().strip() == "0"
    finally:
        if a is not None:
            a.close()


def test_under_corun_slices_of_different_lanes_overlap_and_neither_ends_the_other():
    """A co-run device grants inference beside a training holder: each lane's slice is its own."""
    stats = DeviceStats(bucket_s=1.0, buckets=4)
    stats.granted("s-train", "trainer", 10.0, 0.0, lane=1)
    stats.granted("s-infer", "ranker", 10.2, 0.0, lane=0)  # beside it, not after it
    stats.slice_ended("s-infer", 10.4)
    stats.granted("s-infer", "ranker", 11.0, 0.0, lane=0)
    stats.slice_ended("s-infer", 11.9)
    report = stats.report(12.5, holders=("s-train",))
    assert report.timeline == ["", "s-train", "s-train", "s-train"]  # it held all along; inference beside it
    assert report.names["s-train"] == "trainer"
    assert set(stats._open) == {1}  # the trainer's slice still runs
    stats.granted("s-infer", "ranker", 12.6, 0.0, lane=0)
    report = stats.report(13.5, holders=("s-infer", "s-train"))
    assert set(stats._open) == {0, 1}
