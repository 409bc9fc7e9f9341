"""``nodeagent run`` holds a program that tries to escape: forks, double forks,
setsid and threads. In its own cgroup v2 (frozen, killed as one) none escapes;
in the process-group fallback the group is still stopped and ended.

The cgroup tests skip, saying why, where no cgroup v2 can be made here (cgroup
v1 only, no permission to create one or move a process into it, no freezer).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from client_lib import Client
from nodeagent import cgroup
from nodeagent.launcher import Hold, choose_hold
from tests.conftest import wait_for
from tests.proc_tools import gone


def _probe() -> str | None:
    """Why no cgroup can be made for a launched program here, or None if one can
    (made, a process moved in and out, and removed again)."""
    try:
        cg = cgroup.create_child(f"nodeagent-probe.{os.getpid()}")
    except cgroup.Unavailable as exc:
        return str(exc)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process to move in and back: the moves the launcher needs
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        cg.adopt(pid)
        cg.eject(pid)  # and back to the parent: it must not stay
    except OSError as exc:
        return f"cannot move a process into {cg.path}: {exc.strerror}"
    finally:
        os.close(w)
        os.waitpid(pid, 0)
        cg.remove()
    return None


NO_CGROUP = _probe()
needs_cgroup = pytest.mark.skipif(NO_CGROUP is not None, reason=f"no cgroup v2 for a launched program here: "
                                                                 f"{NO_CGROUP}")

ROLES = ("main", "thread", "fork", "double", "setsid")
IN_GROUP = ("main", "thread", "fork", "double")  # a double fork keeps the process group; setsid leaves it

# CMD that tries every way out: a forked child, a grandchild orphaned by a double
# fork, a child in a session of its own, a thread, and itself. Each writes its
# pid once and a counter about every 1 ms to DIR/ROLE (atomically).
ESCAPER = r"""
import os, sys, threading, time
d = sys.argv[1]
def count(role):
    open(os.path.join(d, role + ".pid"), "w").write(str(os.getpid()))
    path, n, next_write = os.path.join(d, role), 0, 0.0
    while True:
        n += 1
        now = time.monotonic()
        if now >= next_write:
            with open(path + ".tmp", "w") as f:
                f.write(str(n))
            os.replace(path + ".tmp", path)
            next_write = now + 0.001
def child(body, role):
    pid = os.fork()
    if pid == 0:
        try:
            body(role)
        finally:
            os._exit(0)
    return pid
def double(role):
    if os.fork() == 0:
        count(role)
def leave(role):
    os.setsid()
    count(role)
child(count, "fork")
child(leave, "setsid")
os.waitpid(child(double, "double"), 0)
threading.Thread(target=count, args=("thread",), daemon=True).start()
count("main")
"""


class Escaper:
    """Reads what ESCAPER writes under ``workdir``; kills every writer at the end."""

    def __init__(self, workdir: str) -> None:
        self.dir = os.path.join(workdir, "escaper")
        os.mkdir(self.dir)
        self.cmd = [sys.executable, "-c", ESCAPER, self.dir]

    def value(self, role: str) -> int:
        try:
            with open(os.path.join(self.dir, role)) as f:
                return int(f.read() or 0)
        except FileNotFoundError:
            return 0

    def values(self, roles=ROLES) -> dict[str, int]:
        return {role: self.value(role) for role in roles}

    def pid(self, role: str) -> int:
        path = os.path.join(self.dir, role + ".pid")
        return int(wait_for(lambda: os.path.exists(path) and open(path).read()))

    def pids(self, roles=ROLES) -> dict[str, int]:
        return {role: self.pid(role) for role in roles}

    def wait_advancing(self, roles=ROLES, timeout: float = 10.0) -> None:
        start = self.values(roles)
        wait_for(lambda: all(self.value(r) > start[r] + 10 for r in roles), timeout)

    def assert_frozen(self, seconds: float, roles=ROLES, settle_s: float = 0.05) -> None:
        time.sleep(settle_s)  # a write in flight lands
        before = self.values(roles)
        time.sleep(seconds)
        after = self.values(roles)
        assert after == before, f"ran while it should be stopped: {before} -> {after}"

    def kill_all(self) -> None:
        for name in os.listdir(self.dir):
            if name.endswith(".pid"):
                try:
                    os.kill(int(open(os.path.join(self.dir, name)).read()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass


@pytest.fixture
def escaper(workdir):
    e = Escaper(workdir)
    yield e
    e.kill_all()


def cgroup_dir(pid: int) -> str:
    path = cgroup.v2_hierarchy().fs_path(cgroup.cgroup_of(pid))
    assert path is not None
    return path


def wait_frozen(where: str) -> None:
    """The cue that the kernel has frozen every task in the cgroup at ``where``."""
    wait_for(lambda: "frozen 1" in open(os.path.join(where, "cgroup.events")).read(), timeout=5)


def launched_session(d):
    (s,) = [s for s in d.status().devices[0].sessions if s.managed_pgid is not None]
    return s


# ------------------------------------------------------------- pure parts

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PURE = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_ONLY = "37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer\n"
BIND = ("50 40 0:26 /kubepods/pod1 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n"
        "51 40 0:26 / /host/cgroup\\040v2 rw - cgroup2 cgroup2 rw\n")


def test_the_v2_mount_is_found_from_mountinfo_wherever_it_is(tmp_path):
    def read(text):
        (tmp_path / "mountinfo").write_text(text)
        return cgroup.v2_hierarchy(str(tmp_path / "mountinfo"))

    assert read(HYBRID) == cgroup.Hierarchy("/sys/fs/cgroup/unified", "/")
    assert read(PURE) == cgroup.Hierarchy("/sys/fs/cgroup", "/")
    assert read(V1_ONLY) is None
    assert read(BIND) == cgroup.Hierarchy("/host/cgroup v2", "/")  # the whole tree before a part of it


def test_a_cgroup_path_maps_through_the_mount_root_and_never_outside_it():
    whole = cgroup.Hierarchy("/sys/fs/cgroup", "/")
    assert whole.fs_path("/") == "/sys/fs/cgroup"
    assert whole.fs_path("/user.slice/run.1") == "/sys/fs/cgroup/user.slice/run.1"
    assert whole.fs_path("/../../elsewhere") is None  # outside our cgroup namespace
    part = cgroup.Hierarchy("/sys/fs/cgroup", "/kubepods/pod1")
    assert part.fs_path("/kubepods/pod1/c/nodeagent-run.7") == "/sys/fs/cgroup/c/nodeagent-run.7"
    assert part.fs_path("/kubepods/pod2") is None
    assert part.fs_path("/kubepods/pod10") is None


def test_without_a_cgroup_auto_falls_back_to_the_group_and_require_refuses(monkeypatch):
    def unavailable(name, hierarchy=None):
        raise cgroup.Unavailable("no cgroup v2 hierarchy is mounted (cgroup v1 only)")

    monkeypatch.setattr(cgroup, "create_child", unavailable)
    hold = choose_hold(4321, "auto")
    assert type(hold) is Hold and hold.pgid == 4321 and "cgroup v1 only" in hold.describe()
    assert choose_hold(4321, "require") is None
    assert "--cgroup off" in choose_hold(4321, "off").describe()


def test_a_cgroup_that_cannot_freeze_gives_cmd_back_and_falls_back_to_the_group(monkeypatch, tmp_path):
    """CMD adopted, then the freeze refused: the launcher moves CMD back to its own cgroup (the
    real Cgroup.eject, writing the parent's cgroup.procs), closes and removes what it made, and
    holds CMD by its process group (auto) or refuses (require), with no traceback."""
    parent = tmp_path / "launcher"
    (parent / "nodeagent-run").mkdir(parents=True)
    (parent / "cgroup.procs").write_text("")
    done = []

    class Outer(cgroup.Cgroup):
        def __init__(self) -> None:  # no files opened: only eject's write is real
            self.path, self.name = str(parent / "nodeagent-run"), "/launcher/nodeagent-run"

        def sub(self, name):
            return Inner()

        def remove(self):
            done.append("outer removed")
            return True

    class Inner:
        path = str(parent / "nodeagent-run" / "cmd")

        def adopt(self, pid):
            done.append(f"adopted {pid}")

        def stop(self, timeout_s):
            raise OSError(errno.EBUSY, "Device or resource busy")

        def close(self):
            done.append("inner closed")

    monkeypatch.setattr(cgroup, "create_child", lambda name, hierarchy=None: Outer())
    hold = choose_hold(4321, "auto")
    assert type(hold) is Hold and hold.pgid == 4321 and "cannot freeze" in hold.describe()
    assert (parent / "cgroup.procs").read_text() == "4321"  # given back before the directory goes
    assert done == ["adopted 4321", "inner closed", "outer removed"]
    assert choose_hold(4321, "require") is None


# ------------------------------------------------------------- the daemon's check

@needs_cgroup
def test_the_daemon_accepts_only_a_cgroup_the_launcher_made_for_its_child(workdir):
    """open_verified against real cgroups: this process plays the launcher. The daemon holds
    the launcher's child cgroup by its own freezer, with the child in one below it (the
    launcher's freezer): never the one the child is in itself, which the launcher freezes."""
    h = cgroup.v2_hierarchy()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    own = cgroup.create_child(f"nodeagent-test.{os.getpid()}")
    inner = deeper = None
    try:
        same, why = cgroup.open_verified(child.pid, os.getpid(), os.getuid(), h)
        assert same is None and "shares its launcher's cgroup" in why
        own.adopt(child.pid)
        flat, why = cgroup.open_verified(child.pid, os.getpid(), os.getuid(), h)
        assert flat is None and "not in a cgroup of its launcher's below it" in why
        inner = own.sub("cmd")
        inner.adopt(child.pid)
        cg, why = cgroup.open_verified(child.pid, os.getpid(), os.getuid(), h)
        assert cg is not None, why
        assert cg.name == own.name == os.path.dirname(cgroup.cgroup_of(child.pid))
        cg.close()
        other, why = cgroup.open_verified(child.pid, os.getpid(), os.getuid() + 1, h)
        assert other is None and "owned by uid" in why
        deeper = inner.sub("deeper")  # one the program made itself: still held by the same outer one
        deeper.adopt(child.pid)
        deep, why = cgroup.open_verified(child.pid, os.getpid(), os.getuid(), h)
        assert deep is not None and deep.name == own.name, why
        deep.close()
        assert cgroup.open_verified(child.pid, os.getpid(), os.getuid(), None)[0] is None
    finally:
        child.kill()
        child.wait()
        for cg in (deeper, inner):
            if cg is not None:
                cg.close()
        wait_for(lambda: not own.populated())
        assert own.remove()  # and every cgroup below it
        assert not os.path.exists(own.path)


# ------------------------------------------------------------- in its own cgroup

@needs_cgroup
def test_nothing_cmd_starts_runs_while_another_session_holds(start_daemon, launch, escaper):
    d = start_daemon("--quantum-ms", "training=50")
    proc = launch(d.endpoint, "--name", "escaper", "-v", cmd=escaper.cmd)
    escaper.wait_advancing()
    pids = escaper.pids()
    where = cgroup_dir(pids["main"])
    assert {cgroup_dir(pid) for pid in pids.values()} == {where}  # setsid and double forks stayed in
    s = launched_session(d)
    # The daemon holds the launcher's outer cgroup; CMD is in the launcher's own, below it.
    assert s.managed_pgid == pids["main"] and s.managed_cgroup == os.path.dirname(cgroup.cgroup_of(pids["main"]))
    assert f"hold=cgroup:{s.managed_cgroup}" in d.log()
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        for _ in range(2):  # stopped, continued, stopped again
            with client.slice(timeout=5):
                assert open(os.path.join(where, "cgroup.freeze")).read().strip() == "1"
                escaper.assert_frozen(0.5)
            escaper.wait_advancing()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    assert f"runs in cgroup {where}, stopped by cgroup.freeze" in err
    assert "ending them" in err  # what CMD left behind (setsid, double) was killed with the cgroup
    wait_for(lambda: all(gone(pid) for pid in pids.values()), timeout=3)
    assert not os.path.exists(where)


@needs_cgroup
def test_under_corun_pacing_nothing_cmd_starts_runs_while_inference_holds(start_daemon, launch, escaper):
    d = start_daemon("--sharing", "corun", "--corun-duty", "pause")
    proc = launch(d.endpoint, "--name", "trainer", cmd=escaper.cmd)
    escaper.wait_advancing()
    where = cgroup_dir(escaper.pid("main"))
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        with client.slice(timeout=1) as grant:  # granted at once, beside the trainer, which is paced
            assert grant
            wait_frozen(where)  # the launcher read the board and froze CMD
            escaper.assert_frozen(0.5)
    escaper.wait_advancing()
    assert proc.poll() is None


@needs_cgroup
def test_launcher_killed_ends_everything_cmd_started_and_leaves_no_cgroup(start_daemon, launch, escaper):
    d = start_daemon("--quantum-ms", "training=50")
    proc = launch(d.endpoint, cmd=escaper.cmd)
    escaper.wait_advancing()
    pids = escaper.pids()
    where = cgroup_dir(pids["main"])
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        with client.slice(timeout=5):  # killed while frozen: nothing may stay frozen either
            escaper.assert_frozen(0.1)
            proc.kill()
            proc.wait()
            wait_for(lambda: all(gone(pid) for pid in pids.values()), timeout=3)
    wait_for(lambda: not os.path.exists(os.path.dirname(where)), timeout=3)  # both levels
    assert "CMD's cgroup was killed" in proc.stderr.read()


@needs_cgroup
def test_with_its_keeper_gone_too_the_daemon_kills_the_cgroup_it_verified(start_daemon, launch, escaper):
    d = start_daemon("--quantum-ms", "training=50")
    proc = launch(d.endpoint, cmd=escaper.cmd)
    escaper.wait_advancing()
    pids = escaper.pids()
    where = cgroup_dir(pids["main"])
    children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    (keeper,) = [int(c) for c in children if int(c) != pids["main"]]
    os.kill(keeper, signal.SIGKILL)
    try:
        proc.kill()
        proc.wait()
        wait_for(lambda: all(gone(pid) for pid in pids.values()), timeout=3)
        assert "killed its program (cgroup:" in d.log()
    finally:
        escaper.kill_all()
        wait_for(lambda: "populated 0" in open(os.path.join(where, "cgroup.events")).read())
        os.rmdir(where)  # left empty: removing them was the keeper's part
        os.rmdir(os.path.dirname(where))


@needs_cgroup
def test_daemon_enforcement_freezes_the_cgroup_of_a_launcher_that_does_not_comply(start_daemon, launch, escaper):
    d = start_daemon("--quantum-ms", "training=50", "--grace-ms", "50")
    proc = launch(d.endpoint, cmd=escaper.cmd)
    escaper.wait_advancing()
    where = cgroup_dir(escaper.pid("main"))
    os.kill(proc.pid, signal.SIGSTOP)  # the launcher can no longer stop CMD itself
    try:
        with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
            with client.slice(timeout=5):  # granted past the grace period, CMD's cgroup frozen by the daemon
                assert launched_session(d).stopped
                wait_frozen(where)  # the daemon does not wait for the kernel; we do
                escaper.assert_frozen(0.3)
            escaper.wait_advancing()  # thawed by the daemon before the launcher's next grant
        assert "action=stop" in d.log()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert proc.poll() is None


@needs_cgroup
def test_a_restarted_daemon_finds_the_cgroup_again_from_the_kernel(start_daemon, launch, escaper):
    d = start_daemon("--quantum-ms", "training=50")
    proc = launch(d.endpoint, cmd=escaper.cmd)
    escaper.wait_advancing()
    name = launched_session(d).managed_cgroup
    assert name is not None
    d.kill()
    d2 = start_daemon("--quantum-ms", "training=50")
    s = wait_for(lambda: [s for s in d2.status().devices[0].sessions if s.attached], timeout=5)[0]
    assert s.managed_cgroup == name
    with Client("infer", workload="inference", endpoint=d2.endpoint, reconnect=False) as client:
        with client.slice(timeout=5):
            escaper.assert_frozen(0.3)
    assert proc.poll() is None


@needs_cgroup
def test_cmd_exit_ends_what_it_left_in_its_cgroup(daemon, launch, workdir):
    pid_file = os.path.join(workdir, "left")
    leave = ("import os, sys, time\n"
             "if os.fork() == 0:\n"
             "    os.setsid()\n"
             "    if os.fork() == 0:\n"
             f"        open({pid_file!r}, 'w').write(str(os.getpid())); time.sleep(60)\n"
             "    os._exit(0)\n"
             f"while not os.path.exists({pid_file!r}): time.sleep(0.01)\n"
             "sys.exit(3)\n")
    proc = launch(daemon.endpoint, "--cgroup", "require", cmd=[sys.executable, "-c", leave])
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 3, err
    left = int(open(pid_file).read())
    wait_for(lambda: gone(left), timeout=3)
    assert "ending them" in err
    assert not os.path.exists(os.path.join(cgroup_dir(os.getpid()), f"nodeagent-run.{proc.pid}"))


# ------------------------------------------------------------- the fallback

def test_the_fallback_stops_and_ends_the_process_group(start_daemon, launch, escaper):
    d = start_daemon("--quantum-ms", "training=50")
    proc = launch(d.endpoint, "--cgroup", "off", cmd=escaper.cmd)
    escaper.wait_advancing()
    pids = escaper.pids()
    s = launched_session(d)
    assert s.managed_pgid == pids["main"] and s.managed_cgroup is None
    assert "hold=pgroup" in d.log()
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        with client.slice(timeout=5):
            escaper.assert_frozen(0.5, roles=IN_GROUP)  # the setsid child is out of its reach
            proc.kill()
            proc.wait()
            wait_for(lambda: all(gone(pids[r]) for r in IN_GROUP), timeout=3)
    escaper.kill_all()  # the setsid child: it escaped the group, and holds the launcher's stderr open
    assert "CMD's process group was killed" in proc.stderr.read()


# ------------------------------------------------------------- one authority over whether CMD runs
#
# Issue 32, item 3: what the launcher holds stopped (it has no token: inference holds the device)
# stays stopped whatever path the daemon resumes by. The cgroup hold has two freezers (the
# daemon's above the launcher's); the process group has one stop, which the daemon never undoes.

HOLDS = [pytest.param("cgroup", marks=needs_cgroup), "pgroup"]


def _launched_and_held_by_its_launcher(d, launch, escaper, hold, *flags):
    cgroup_flag = ["--cgroup", "require" if hold == "cgroup" else "off"]
    proc = launch(d.endpoint, "--name", "trainer", *cgroup_flag, *flags, cmd=escaper.cmd)
    roles = ROLES if hold == "cgroup" else IN_GROUP  # the setsid child leaves a process group
    escaper.wait_advancing(roles)
    return proc, launched_session(d).id, roles


@pytest.mark.parametrize("hold", HOLDS)
def test_a_resume_after_a_missed_suspend_deadline_never_runs_what_the_launcher_stopped(
        start_daemon, launch, escaper, hold):
    from client_lib import resume_session, suspend_session

    d = start_daemon("--quantum-ms", "training=50")
    proc, sid, roles = _launched_and_held_by_its_launcher(d, launch, escaper, hold)
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        with client.slice(timeout=5):
            escaper.assert_frozen(0.2, roles)  # its launcher stopped it: inference holds the device
            assert suspend_session(sid, deadline_ms=200, endpoint=d.endpoint).outcome == "stopped"
            resume_session(sid, endpoint=d.endpoint)  # the daemon lets go of its own stop only
            escaper.assert_frozen(0.5, roles)
        escaper.wait_advancing(roles)  # its turn: its launcher continues it
    assert proc.poll() is None


@needs_cgroup
def test_a_reclaim_and_a_resume_never_run_what_the_launcher_stopped(start_daemon, launch, escaper, monkeypatch):
    from client_lib import resume_session
    from client_lib import protocol as p
    from tests.rawpeer import RawPeer

    d = start_daemon("--quantum-ms", "training=50")
    root = RawPeer(d.endpoint)
    assert root.call(p.Lend(id=root.take_id(), device=0, borrower="jobX")).state == "LENT"
    monkeypatch.setenv("NODEAGENT_BORROWER", "jobX")  # the launcher's session is the borrower's
    proc, sid, roles = _launched_and_held_by_its_launcher(d, launch, escaper, "cgroup")
    with Client("infer", workload="inference", endpoint=d.endpoint, reconnect=False) as client:
        with client.slice(timeout=5):
            escaper.assert_frozen(0.2, roles)
            reclaimed = root.call(p.Reclaim(id=root.take_id(), device=0, deadline_ms=200), timeout=10)
            assert isinstance(reclaimed, p.ReclaimReply), reclaimed
            assert next(s for s in d.status().devices[0].sessions if s.id == sid).suspended == "stopped"
            resume_session(sid, endpoint=d.endpoint)
            escaper.assert_frozen(0.5, roles)
        escaper.wait_advancing(roles)
    root.close()
    assert proc.poll() is None


@pytest.mark.parametrize("hold", HOLDS)
@pytest.mark.parametrize("how", ["restart", "shutdown"])
def test_a_daemon_that_stops_continues_only_what_it_stopped_not_what_the_launcher_did(
        start_daemon, launch, escaper, hold, how):
    """The daemon stopped CMD (a missed suspend deadline) while its launcher (fail-closed) held it
    stopped too. SIGKILLed, its successor continues what it finds stopped; shut down, it continues
    what it stopped: its own freezer only (a process group: not at all), never the launcher's."""
    from client_lib import suspend_session

    d = start_daemon("--quantum-ms", "training=50")
    proc, sid, roles = _launched_and_held_by_its_launcher(d, launch, escaper, hold, "--fail-closed")
    with Client("infer", workload="inference", endpoint=d.endpoint) as client:  # reattaches across a restart
        with client.slice(timeout=5):
            escaper.assert_frozen(0.2, roles)
            assert suspend_session(sid, deadline_ms=200, endpoint=d.endpoint).outcome == "stopped"
            if how == "shutdown":
                assert d.stop() == 0
                assert "step=continue stopped=1" in d.log()
            else:
                d.kill()
                d2 = start_daemon("--quantum-ms", "training=50")
                wait_for(lambda: len(d2.status().devices[0].sessions) == 2
                         and all(s.attached for s in d2.status().devices[0].sessions), timeout=10)
            escaper.assert_frozen(0.5, roles)  # the launcher's stop stands: it has no token
    assert proc.poll() is None


# ------------------------------------------------------------- a program that undoes its own hold
#
# Issue 32, item 4: the launcher's cgroups are its user's, so CMD (the same user) may write their
# cgroup.freeze and its ancestors' cgroup.procs: the launcher says so at start, naming the files;
# and whatever cgroups CMD makes inside its own are removed with it.

MAKES_ITS_OWN_CGROUP = r"""
import os, sys, time
d = sys.argv[1]
mine = open("/proc/self/cgroup").read().split("0::", 1)[1].strip()
mount = [l.split()[4] for l in open("/proc/self/mountinfo") if " - cgroup2 " in l][0]
sub = os.path.join(mount + mine, "made-by-cmd")
os.mkdir(sub)
os.mkdir(os.path.join(sub, "deeper"))
pid = os.fork()
if pid == 0:
    open(os.path.join(sub, "deeper", "cgroup.procs"), "w").write(str(os.getpid()))
    open(os.path.join(d, "child.pid"), "w").write(str(os.getpid()))
    time.sleep(60)
    os._exit(0)
while not os.path.exists(os.path.join(d, "child.pid")):
    time.sleep(0.01)
open(os.path.join(d, "made"), "w").write(sub)
if sys.argv[2] == "exit":
    sys.exit(3)
time.sleep(60)
"""


@needs_cgroup
def test_the_launcher_says_at_start_how_cmd_could_undo_its_hold(daemon, launch, escaper):
    proc = launch(daemon.endpoint, "--cgroup", "require", cmd=escaper.cmd)
    escaper.wait_advancing()
    inner = cgroup_dir(escaper.pid("main"))
    outer, launchers = os.path.dirname(inner), cgroup_dir(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    said = next(line for line in err.splitlines() if "runs in cgroup" in line)
    assert "the hold is not trusted" in said and f"uid {os.geteuid()}" in said, said
    # CMD's user owns them (the launcher made them): a thaw, and a move out to its launcher's cgroup.
    for path in (f"{inner}/cgroup.freeze", f"{outer}/cgroup.freeze", f"{outer}/cgroup.procs"):
        assert path in said, (path, said)
    assert f"{launchers}/cgroup.procs" in said or "more" in said, said


TRIES_EVERY_WAY_OUT = r"""
cg=$(sed -n 's/^0:://p' /proc/self/cgroup)
mount=$(grep ' - cgroup2 ' /proc/self/mountinfo | head -n 1 | cut -d ' ' -f 5)
mine="$mount$cg"; outer=$(dirname "$mine"); above=$(dirname "$outer")
for f in "$mine/cgroup.freeze" "$outer/cgroup.freeze" "$outer/cgroup.procs" "$above/cgroup.freeze" "$above/cgroup.procs"
do
    [ -e "$f" ] || continue
    if (echo 0 > "$f") 2>/dev/null; then echo "wrote $f"; else echo "refused $f"; fi
done
"""


@needs_cgroup
def test_the_launcher_names_a_trusted_hold_and_cmd_run_so_cannot_undo_it(daemon, launch):
    """Issue 32 item 4: the start-up line said the hold is not trusted, not how to get one that is.
    It names setpriv(1): CMD run as another user by a root launcher (here outside any cgroup
    delegated to that user) may write none of the files that would thaw it or move it out, and
    its cgroups are gone when it exits."""
    import re
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to run CMD as another user")
    proc = launch(daemon.endpoint, "--cgroup", "require",
                  cmd=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "sh", "-c",
                       TRIES_EVERY_WAY_OUT])
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    said = next(line for line in err.splitlines() if "runs in cgroup" in line)
    assert "the hold is not trusted" in said and "for a trusted hold run CMD as a user who may write none" in said
    assert "nodeagent run -- setpriv --reuid=USER --regid=GROUP --init-groups CMD" in said, said
    tried = out.split("\n")[:-1]
    assert len(tried) >= 4 and all(line.startswith("refused ") for line in tried), out  # thaw, move out: none
    outer = re.search(r"cgroup (\S+)/cmd,", said).group(1)
    wait_for(lambda: not os.path.exists(outer), timeout=5)  # no directory left behind


@needs_cgroup
@pytest.mark.parametrize("how", ["exit", "launcher killed"])
def test_cgroups_cmd_makes_inside_its_own_go_with_it(daemon, launch, workdir, how):
    proc = launch(daemon.endpoint, "--cgroup", "require",
                  cmd=[sys.executable, "-c", MAKES_ITS_OWN_CGROUP, workdir, "exit" if how == "exit" else "stay"])
    made = wait_for(lambda: os.path.exists(os.path.join(workdir, "made")) and open(os.path.join(workdir, "made")).read(),
                    timeout=20)
    child = int(open(os.path.join(workdir, "child.pid")).read())
    outer = os.path.dirname(os.path.dirname(made))
    assert os.path.basename(outer) == f"nodeagent-run.{proc.pid}"
    if how == "exit":
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 3, err
    else:
        proc.kill()
        proc.wait()
        err = proc.stderr.read()
    wait_for(lambda: gone(child), timeout=5)
    wait_for(lambda: not os.path.exists(outer), timeout=5)  # every level, what CMD made included
    assert "cannot remove" not in err, err
