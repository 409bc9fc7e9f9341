"""``nodeagent run``: time-slice an unmodified program as a session of the daemon.

The launcher holds CMD in a cgroup of its own (else its process group), lets it run only while
its session holds the token, and never leaves it running unmanaged or stopped behind it (a keeper
process ends CMD if the launcher dies). Its modes (MANAGED, AWAY, UNMANAGED) and its two
holds: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import json
import logging
import os
import select
import shutil
import signal
import socket
import time
import types
from typing import Callable, NoReturn, Sequence

from client_lib import Client, DaemonUnavailableError, NodeAgentError
from client_lib.pace import in_on_phase
from nodeagent import cgroup

log = logging.getLogger("nodeagent.launcher")

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_REFUSED = 1  # the daemon refused the session (bad device, protocol, ...)
EXIT_CANNOT_EXECUTE = 126  # as a shell: found but not executable
EXIT_NOT_FOUND = 127  # as a shell: command not found

_RETRY_OPEN_S = 1.0  # fail-open: how often to look for a lost daemon
_RETRY_CLOSED_S = 0.5  # fail-closed: CMD is waiting on it, so look more often
_REATTACH_HANDSHAKE_S = 0.3
_TICK_S = 0.25  # longest wait between looks at the daemon's health
_CHILD_POLL_S = 0.05  # without a pidfd: how often to look for CMD's exit
_PACE_TICK_S = 0.001  # co-run, while a higher class is on the device: how often to read the pace board
_PACE_IDLE_TICK_S = 0.01  # co-run, while none is
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_FREEZE_WAIT_S = 0.5  # longest wait for the kernel to say CMD's cgroup is frozen before going on
_EMPTY_WAIT_S = 5.0  # longest wait for a killed cgroup to empty before removing it
CGROUP_MODES = ("auto", "off", "require")
_KEEPER_DONE = b"d"  # launcher -> keeper: CMD is ended and cleaned up; exit without acting


class Mode(enum.Enum):
    """What the launcher's loop is doing::

        MANAGED --daemon lost--> AWAY --daemon back--> MANAGED
           |                      |
           +----------------------+--SIGINT/TERM/HUP forwarded, internal error--> UNMANAGED

    AWAY: fail-open (default) CMD runs, fail-closed it stays stopped; reattaching is tried every
    second (every half second fail-closed). UNMANAGED: CMD runs, the session is closed, the
    launcher only forwards signals and waits for CMD to exit.
    """

    MANAGED = "managed"
    AWAY = "away"
    UNMANAGED = "unmanaged"


class Launcher:
    """Runs ``argv`` (non-empty; :func:`main` checks it and ``cgroup_mode``) time-sliced by the daemon at
    ``endpoint``; :meth:`run` returns its exit code.

    It forks and installs signal handlers, so it must run in the main thread of
    a process that has no other threads yet (the client's heartbeat thread is
    started after the fork).
    """

    def __init__(self, argv: Sequence[str], *, name: str | None = None, workload: str = "training",
                 weight: float = 1.0, device: int | None = None, endpoint: str | None = None,
                 fail_closed: bool = False, cgroup_mode: str = "auto") -> None:
        self.argv = list(argv)
        self.name = name or os.path.basename(self.argv[0])
        self.workload = workload
        self.weight = weight
        self.device = device
        self.endpoint = endpoint
        self.fail_closed = fail_closed
        self.cgroup_mode = cgroup_mode
        self.hold: Hold | None = None  # how CMD is stopped, continued and ended (set once it is stopped)
        self.mode = Mode.MANAGED
        self.pid: int | None = None  # CMD's pid, which is also its process group id
        self.exit_code: int | None = None  # set once CMD has been reaped
        self.client: Client | None = None
        self._cmd_running = False  # False while the launcher holds CMD stopped
        self._continued_for: int | None = None  # the grant CMD was last continued for
        self._pidfd: int | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._saved_wakeup_fd = -1
        self._saved_handlers: dict[int, object] = {}
        self._next_attach = 0.0
        self._env_w: int | None = None  # write end of the pipe CMD reads its extra environment from
        self._was_paced = False  # co-run: CMD was last stopped for pacing (its continue is at debug too: frequent)
        self._keeper_pid: int | None = None
        self._keeper_w: int | None = None  # its end-of-file, without _KEEPER_DONE first, makes the keeper end CMD

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Launch CMD, manage it until it exits, and return its exit code."""
        problem = check_program(self.argv[0])
        if problem is not None:
            code, message = problem
            log.error("%s", message)
            return code
        try:
            self._install_signal_handlers()
            self._spawn_stopped()
            if self.exit_code is None:
                self._start_keeper()  # before the client's threads: it is forked
                self._open_session()
            self._hand_over_env()
            while self.exit_code is None:
                try:
                    self._loop()
                except Exception:
                    if self.mode is Mode.UNMANAGED:
                        raise
                    log.exception("internal error; CMD (pid %d) continues unmanaged", self.pid)
                    self._go_unmanaged()
            return self.exit_code
        except Exception:
            log.exception("internal error; exiting")
            return 1
        finally:
            self._clean_up()

    def _loop(self) -> None:
        """Wait for something to happen and react, until CMD has exited."""
        while self.exit_code is None:
            ready = self._wait()
            if self._pidfd is None or self._pidfd in ready:
                self._reap(block=False)
                if self.exit_code is not None:
                    return
            if self._wake_r.fileno() in ready:
                self._on_signals()
            if self.mode is Mode.MANAGED:
                self._step_managed()
            elif self.mode is Mode.AWAY:
                self._step_away()

    def _wait(self) -> list[int]:
        """Block until a daemon message, a signal, CMD's exit, or the next timer; the ready fds."""
        fds = [self._wake_r.fileno()]
        if self._pidfd is not None:
            fds.append(self._pidfd)
        timeout = _TICK_S if self._pidfd is not None else _CHILD_POLL_S
        if self.mode is Mode.MANAGED and self.client is not None and self.client.pacing is not None:
            # Co-run: the board is read, not heard. While a higher class is on the device it may
            # take its token at any moment; before one joins, a first request waits at most this.
            present = self.client.pacing.pace().present
            timeout = min(timeout, _PACE_TICK_S if present else _PACE_IDLE_TICK_S)
        if self.mode is Mode.MANAGED:
            try:
                return self.client.wait_event(timeout, fds)
            except NodeAgentError as exc:
                self._daemon_lost(str(exc))
                return []
        if self.mode is Mode.AWAY:
            timeout = max(0.0, min(timeout, self._next_attach - time.monotonic()))
        ready, _, _ = select.select(fds, [], [], timeout)
        return ready

    # ------------------------------------------------------------- managed

    def _open_session(self) -> None:
        """First hello. With no daemon there, CMD is handled as if one went away, but
        the message says there was none; a daemon that refuses the session ends the
        launch (CMD never ran)."""
        try:
            self.client = self._new_client(handshake_timeout_s=None)
        except DaemonUnavailableError as exc:
            self._no_daemon_yet(exc)
            return
        except NodeAgentError as exc:
            log.error("the daemon refused the session: %s; CMD was not started", exc)
            self.hold.kill()
            self._reap(block=True)
            self.exit_code = EXIT_REFUSED
            return
        log.info("session %s on device %d (pid %d, slice %.0f ms)", self.client.session_id,
                 self.client.device, self.pid, self.client.slice_ms)
        self.client.request()

    def _hand_over_env(self) -> None:
        """Give CMD the daemon's environment (or nothing, if there is no session);
        CMD reads it when first continued, before it execs."""
        if self._env_w is None:
            return
        env = self.client.welcome.env if self.client is not None and self.client.welcome else {}
        with contextlib.suppress(OSError):  # CMD is gone already
            os.write(self._env_w, json.dumps(env).encode())
        os.close(self._env_w)
        self._env_w = None

    def _new_client(self, handshake_timeout_s: float | None) -> Client:
        # reconnect=False: losing the daemon must surface here at once, so
        # that CMD is continued (fail-open) or held (fail-closed) by us.
        return Client(self.name, workload=self.workload, weight=self.weight, device=self.device,
                      endpoint=self.endpoint, handshake_timeout_s=handshake_timeout_s,
                      managed_pgid=self.pid, reconnect=False)

    def _step_managed(self) -> None:
        """Make CMD's state follow the token: running iff held and not asked to yield."""
        client = self.client
        try:
            if not client.daemon_healthy():
                self._daemon_lost("it stopped answering heartbeats, or restarted")
                return
            if client.holding:
                grant = client.grant_id
                if client.yield_requested:
                    self._stop_cmd("yield requested")  # before the token goes, never after
                    client.release(requeue=True)
                elif self._paced():
                    self._stop_cmd("paced: a higher class holds the device", quiet=True)
                elif not self._cmd_running or grant != self._continued_for:
                    # A new grant continues CMD even if we think it runs: the daemon stops a
                    # launcher that overran and leaves continuing it to us (nodeagent.enforce).
                    self._continue_cmd("granted", quiet=self._was_paced, force=grant != self._continued_for)
                    self._continued_for = grant
            elif self._cmd_running:
                self._stop_cmd("token revoked")
                client.request()
        except NodeAgentError as exc:
            self._daemon_lost(str(exc))

    # ---------------------------------------------------------------- away

    def _daemon_lost(self, reason: str) -> None:
        """Enter AWAY: continue CMD (fail-open) or keep it stopped (fail-closed)."""
        self.mode = Mode.AWAY
        self._next_attach = time.monotonic() + self._retry_s()
        if self.fail_closed:
            log.warning("daemon lost (%s); CMD stays stopped until it returns (--fail-closed)", reason)
            self._stop_cmd("daemon lost, fail-closed", force=True)
        else:
            log.warning("daemon lost (%s); CMD runs unmanaged until it returns (fail-open)", reason)
            self.hold.release_daemons_stop()  # a daemon that died holding it stopped is not there to continue it
            self._continue_cmd("daemon lost, fail-open", force=True)

    def _no_daemon_yet(self, exc: DaemonUnavailableError) -> None:
        """AWAY from the start: no daemon to attach to (there never was one, for this launcher)."""
        self.mode = Mode.AWAY
        self._next_attach = time.monotonic() + self._retry_s()
        found = f"no nodeagent daemon at {exc.endpoint}: {exc.detail}"
        if self.fail_closed:
            log.warning("%s; CMD waits, stopped, until one starts (--fail-closed)", found)
        else:
            log.warning("%s; CMD runs unmanaged until one starts (fail-open)", found)
            self._continue_cmd("no daemon, fail-open")

    def _step_away(self) -> None:
        """Try to reattach when due; once back, CMD waits for a grant again."""
        now = time.monotonic()
        if now < self._next_attach:
            return
        self._next_attach = now + self._retry_s()
        first = self.client is None  # no session yet: the daemon was never there
        try:
            if first:
                self.client = self._new_client(_REATTACH_HANDSHAKE_S)
            elif not self.client.try_resume(_REATTACH_HANDSHAKE_S):
                return
            holding = self.client.holding
        except NodeAgentError:
            return
        self.mode = Mode.MANAGED
        if first:
            log.warning("daemon found (session %s); CMD is managed from now on", self.client.session_id)
        else:
            log.warning("daemon is back (session %s); CMD is managed again", self.client.session_id)
        self._continued_for = None  # a grant held across the restart continues CMD again
        if not holding:
            self._stop_cmd("waiting for a grant", force=True)
            self.client.request()

    def _retry_s(self) -> float:
        return _RETRY_CLOSED_S if self.fail_closed else _RETRY_OPEN_S

    # ----------------------------------------------------------- unmanaged

    def _go_unmanaged(self) -> None:
        """CMD runs until it exits; the session is closed so the token passes on."""
        self.mode = Mode.UNMANAGED
        self._continue_cmd("unmanaged", force=True)
        self._close_client()

    def _on_signals(self) -> None:
        """Forward each signal the handlers noted to CMD's group, then continue CMD
        (a thaw, or SIGCONT) so that it acts on it; CMD then runs unmanaged until it
        exits, so that its shutdown never waits on another session's slice."""
        try:
            received = self._wake_r.recv(64)
        except BlockingIOError:
            return
        for signum in received:
            if signum not in self._saved_handlers:
                continue
            log.info("forwarding %s to CMD", signal.Signals(signum).name)
            _killpg(self.pid, signum)  # to CMD's process group, as a shell forwards them
            self.hold.cont()  # so that a stopped CMD acts on it (SIGCONT to the group, or a thaw)
            self._cmd_running = True
            if self.mode is not Mode.UNMANAGED:
                self._go_unmanaged()

    # --------------------------------------------------------------- child

    def _spawn_stopped(self) -> None:
        """Fork CMD into its own session, stopped before exec; wait until it is stopped,
        then hold it (its own cgroup, frozen, or its process group, stopped).

        Not subprocess: Popen waits for the exec to succeed, which a child that
        stops itself before exec never reports."""
        set_pdeathsig = _pdeathsig_setter()  # resolved before the fork
        parent = os.getpid()
        # CMD's extra environment (the daemon's welcome.env: MPS settings) comes
        # through this pipe after the hello, which needs CMD's pid: so after the fork.
        env_r, self._env_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(self._env_w)
            self._exec_child(parent, set_pdeathsig, env_r)
        os.close(env_r)
        self.pid = pid
        _, status = os.waitpid(pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):  # it died before it could stop
            self._record_exit(status)
            return
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # older kernel: _loop polls waitpid instead
            self._pidfd = None
        self.hold = choose_hold(pid, self.cgroup_mode)
        if self.hold is None:  # --cgroup require, and there is none
            os.killpg(pid, signal.SIGKILL)
            self._reap(block=True)
            self.exit_code = EXIT_REFUSED

    def _exec_child(self, parent: int, set_pdeathsig: Callable[[int], None], env_r: int) -> NoReturn:
        """In the child: new session, shell-like signal dispositions, stop, exec."""
        code = EXIT_NOT_FOUND
        try:
            os.setsid()
            signal.set_wakeup_fd(-1)
            for signum in (*self._saved_handlers, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_DFL)  # Python ignores PIPE and XFSZ; CMD must not
            # Should the launcher be killed outright, the kernel ends CMD (the keeper ends the rest).
            set_pdeathsig(signal.SIGKILL)
            if os.getppid() != parent:  # the launcher is already gone: nobody would manage us
                os._exit(1)
            os.kill(os.getpid(), signal.SIGSTOP)
            env = dict(os.environ)
            env.update(_read_env(env_r))
            os.execvpe(self.argv[0], self.argv, env)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                code = EXIT_CANNOT_EXECUTE
            os.write(2, f"nodeagent run: cannot run {self.argv[0]}: {exc.strerror}\n".encode())
        finally:
            os._exit(code)

    def _reap(self, block: bool) -> None:
        """Collect CMD's exit status if it has exited (exactly once)."""
        pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        if pid == self.pid:
            self._record_exit(status)

    def _record_exit(self, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        self.exit_code = 128 - code if code < 0 else code
        log.info("CMD exited with status %d", self.exit_code)

    def _paced(self) -> bool:
        """Co-run: whether the board says CMD must pause now (a higher class holds the device)."""
        pacing = self.client.pacing if self.client is not None else None
        if pacing is None:
            return False
        pace = pacing.pace()
        return pace.throttled and not in_on_phase(pace, time.monotonic())

    def _stop_cmd(self, why: str, quiet: bool = False, force: bool = False) -> None:
        """Stop CMD if it runs (``force``: whatever we last did: the daemon may have acted since)."""
        if (self._cmd_running or force) and self.exit_code is None:
            self.hold.stop()
            self._cmd_running = False
            self._was_paced = quiet  # only a pacing stop is quiet
            (log.debug if quiet else log.info)("CMD stopped (%s)", why)

    def _continue_cmd(self, why: str, quiet: bool = False, force: bool = False) -> None:
        """Continue CMD if stopped (``force``: as :meth:`_stop_cmd`'s). The daemon never continues a
        process group its launcher may have stopped (nodeagent.enforce): we do, at each new grant."""
        if (not self._cmd_running or force) and self.exit_code is None:
            self.hold.cont()
            self._cmd_running = True
            (log.debug if quiet else log.info)("CMD continued (%s)", why)

    # -------------------------------------------------------------- keeper

    def _start_keeper(self) -> None:
        """Fork the keeper: in a session of its own (so that a terminal's or a group's
        signals meant for the launcher miss it), it waits on a pipe from us and ends
        CMD if the pipe closes without our word (we died). See docs/internals.md."""
        r, w = os.pipe()
        keep = {r, 2, *self.hold.fds()}
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                signal.set_wakeup_fd(-1)
                for signum in (*self._saved_handlers, signal.SIGPIPE):
                    signal.signal(signum, signal.SIG_DFL)
                _close_all_but(keep)
                devnull = os.open(os.devnull, os.O_RDWR)
                os.dup2(devnull, 0)
                os.dup2(devnull, 1)  # never the launcher's stdout: a reader waits for its end-of-file
                os.close(devnull)
                if os.read(r, 1) != _KEEPER_DONE:
                    self.hold.end_orphaned()
                    os.write(2, f"nodeagent run: the launcher of CMD (pid {self.pid}) died; "
                                f"CMD's {self.hold.kind} was killed\n".encode())
            finally:
                os._exit(0)
        os.close(r)
        self._keeper_pid, self._keeper_w = pid, w

    def _dismiss_keeper(self) -> None:
        """Tell the keeper we are done with CMD (it exits without acting) and reap it."""
        if self._keeper_w is None:
            return
        with contextlib.suppress(OSError):  # it is gone already
            os.write(self._keeper_w, _KEEPER_DONE)
        os.close(self._keeper_w)
        self._keeper_w = None
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self._keeper_pid, 0)

    # ---------------------------------------------------- signals, clean-up

    def _install_signal_handlers(self) -> None:
        """Handlers that only wake the loop: the C-level handler writes the
        signal number to the wakeup socket, which the loop reads. A signal
        ignored when we started stays ignored, for CMD too (as in a shell)."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._saved_wakeup_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for signum in FORWARDED_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._saved_handlers[signum] = previous
            signal.signal(signum, _wake_only)

    def _clean_up(self) -> None:
        """Never leave CMD running unmanaged, nor anything stopped or frozen; end the session."""
        if self._env_w is not None:  # CMD must not wait on a pipe nobody will write
            os.close(self._env_w)
            self._env_w = None
        done = True
        if self.hold is not None:
            if self.exit_code is None:
                log.error("exiting while CMD (pid %d) still runs; ending it (the launcher's death ends CMD)",
                          self.pid)
                self.hold.kill()
                self._reap(block=True)
            try:
                self.hold.finish(self._cmd_running)
            except OSError as exc:
                log.error("cleaning up after CMD failed (%s); its keeper tries again once we exit", exc)
                done = False
        if done:
            self._dismiss_keeper()
        self._close_client()
        for signum, handler in self._saved_handlers.items():
            signal.signal(signum, handler)
        self._saved_handlers.clear()
        if self._wake_w is not None:
            signal.set_wakeup_fd(self._saved_wakeup_fd)
            self._wake_r.close()
            self._wake_w.close()
            self._wake_r = self._wake_w = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # the session dies with our connection anyway
                log.debug("closing the session failed", exc_info=True)


class Hold:
    """How CMD is stopped, continued and ended: its process group (this class, the
    fallback) or its cgroup (:class:`CgroupHold`)."""

    kind = "process group"

    def __init__(self, pgid: int, why: str = "") -> None:
        self.pgid = pgid
        self.why = why  # why there is no cgroup

    def describe(self) -> str:
        return (f"process group {self.pgid}, stopped by SIGSTOP (a child that calls setsid escapes it, and any "
                f"process of CMD's may SIGCONT the group: the hold is not trusted; no cgroup: {self.why})")

    def fds(self) -> tuple[int, ...]:
        return ()

    def stop(self) -> None:
        _killpg(self.pgid, signal.SIGSTOP)

    def cont(self) -> None:
        _killpg(self.pgid, signal.SIGCONT)

    def kill(self) -> None:
        _killpg(self.pgid, signal.SIGKILL)

    def release_daemons_stop(self) -> None:
        """The daemon is gone (fail-open): undo a stop it made (here the group's one stop: :meth:`cont`)."""

    def finish(self, cmd_running: bool) -> None:
        """CMD has exited: what it left in its group must not stay stopped."""
        if not cmd_running:
            self.cont()

    def end_orphaned(self) -> None:
        """In the keeper, the launcher dead: end what is left of CMD."""
        self.kill()


class CgroupHold(Hold):
    """CMD in a cgroup of its own (``cgroup``), inside the one the daemon holds (``outer``):
    frozen and thawed as one by the launcher, killed as one; both removed when CMD is gone."""

    kind = "cgroup"

    def __init__(self, pgid: int, cg: cgroup.Cgroup, outer: cgroup.Cgroup) -> None:
        super().__init__(pgid)
        self.cgroup = cg
        self.outer = outer

    def describe(self) -> str:
        held = f"cgroup {self.cgroup.path}, stopped by cgroup.freeze (the daemon's freeze is its parent's)"
        try:
            out = cgroup.ways_out(self.cgroup)
        except OSError:
            out = []
        if not out:
            return held
        shown = ", ".join(out[:4]) + (f" and {len(out) - 4} more" if len(out) > 4 else "")
        return (f"{held}; the hold is not trusted: CMD runs as uid {os.geteuid()}, which may write {shown}, so a "
                "process of CMD's can thaw its cgroup or move out of it and run without the token (the launcher "
                "and the daemon stop, continue and end it by the token; they cannot keep it from undoing that); "
                "for a trusted hold run CMD as a user who may write none of them: from a root launcher outside "
                "that user's delegated cgroups, `nodeagent run -- setpriv --reuid=USER --regid=GROUP --init-groups "
                "CMD`")

    def fds(self) -> tuple[int, ...]:
        return self.cgroup.fds() + self.outer.fds()

    def stop(self) -> None:
        if not self.cgroup.stop(_FREEZE_WAIT_S):
            log.warning("CMD's cgroup is not frozen %.0f ms after it was told to freeze (a task in an "
                        "uninterruptible wait freezes when it leaves it)", _FREEZE_WAIT_S * 1e3)

    def cont(self) -> None:
        self.cgroup.thaw()  # the launcher's freeze only: one the daemon made stays until it thaws it

    def kill(self) -> None:
        self.outer.kill()

    def release_daemons_stop(self) -> None:
        try:
            self.outer.thaw()
        except OSError as exc:
            log.warning("cannot thaw %s, which the daemon froze: %s", self.outer.path, exc)

    def finish(self, cmd_running: bool) -> None:
        """CMD has exited: end what it left in its cgroup, thaw, remove the cgroup."""
        try:
            left = self.cgroup.procs()
        except OSError:
            left = []
        if left:
            log.warning("CMD left %d process(es) in its cgroup (%s); ending them", len(left),
                        " ".join(map(str, left[:8])))
        self.end_orphaned()

    def end_orphaned(self) -> None:
        if self.outer.populated():
            self.outer.kill()
            self.outer.wait(lambda: not self.outer.populated(), _EMPTY_WAIT_S)
        self.cgroup.close()
        if not self.outer.remove():
            log.warning("cannot remove %s: processes are still in it (thawed)", self.outer.path)


def choose_hold(pid: int, mode: str) -> Hold | None:
    """Hold the stopped child ``pid``: in a cgroup of its own if one can be made (``mode``
    auto or require), frozen, the child then continued inside it; else its process
    group, left stopped. None if ``mode`` is require and there is no cgroup."""
    if mode == "off":
        hold = Hold(pid, "asked for (--cgroup off)")
    else:
        outer = cg = None
        adopted = False
        try:
            outer = cgroup.create_child(f"nodeagent-run.{os.getpid()}")  # the daemon freezes this one
            cg = outer.sub("cmd")  # and the launcher this one
            cg.adopt(pid)
            adopted = True
            cg.stop(_FREEZE_WAIT_S)  # a stopped task counts as frozen: at once
            os.kill(pid, signal.SIGCONT)  # no longer stopped; held by the freezer from now on
            hold = CgroupHold(pid, cg, outer)
        except (cgroup.Unavailable, OSError) as exc:
            where = cg.path if cg is not None else outer.path if outer is not None else "its cgroup"
            why = str(exc) if isinstance(exc, cgroup.Unavailable) else \
                f"cannot move CMD into {where}: {exc.strerror} (cgroup v2 delegation: the launcher needs " \
                f"write access to cgroup.procs of its own cgroup and of the new one)"
            if adopted:  # back where it came from, so that the directory can go
                why = f"cannot freeze {cg.path}: {exc}"
                with contextlib.suppress(OSError):
                    outer.eject(pid)
            if cg is not None:
                cg.close()
            if outer is not None:
                outer.remove()
            if mode == "require":
                log.error("no cgroup for CMD (--cgroup require): %s", why)
                return None
            hold = Hold(pid, why)
    described = hold.describe()
    (log.warning if "not trusted" in described else log.info)("CMD (pid %d) runs in %s", pid, described)
    return hold


def check_program(program: str) -> tuple[int, str] | None:
    """Why ``program`` cannot be run, as (shell-like exit code, message); None if it can."""
    if "/" not in program:
        if shutil.which(program) is None:
            return EXIT_NOT_FOUND, f"{program}: command not found"
        return None
    if not os.path.exists(program):
        return EXIT_NOT_FOUND, f"{program}: no such file"
    if os.path.isdir(program) or not os.access(program, os.X_OK):
        return EXIT_CANNOT_EXECUTE, f"{program}: not an executable file"
    return None


def _read_env(fd: int) -> dict[str, str]:
    """In the child: the JSON object the launcher writes (empty if it wrote none)."""
    with os.fdopen(fd, "rb") as pipe:
        data = pipe.read()
    if not data:
        return {}
    env = json.loads(data)
    return {str(k): str(v) for k, v in env.items()}


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group has exited
        os.killpg(pgid, signum)


def _close_all_but(keep: set[int]) -> None:
    """In a forked child: close every descriptor not in ``keep``."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed already
                os.close(fd)


def _wake_only(signum: int, frame: types.FrameType | None) -> None:
    """Python-level handler: nothing to do, the wakeup fd already woke the loop."""


def _pdeathsig_setter() -> Callable[[int], None]:
    """``prctl(PR_SET_PDEATHSIG, sig)`` from libc, or a no-op where there is none."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda signum: None
    return lambda signum: prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def main(args) -> int:
    """``nodeagent run`` after argument parsing (see :mod:`nodeagent.cli`)."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="nodeagent run: %(message)s")
    argv = list(args.cmd)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        log.error("no command to run; usage: nodeagent run [OPTIONS] -- CMD [ARGS...]")
        return 2
    from nodeagent.config import client_endpoint_problem
    problem = client_endpoint_problem(args.endpoint)
    if problem is not None:  # a typo, not a daemon that is away: CMD is not started
        log.error("%s", problem)
        return 2
    cgroup_mode = args.cgroup or os.environ.get("NODEAGENT_RUN_CGROUP", "auto")
    if cgroup_mode not in CGROUP_MODES:
        log.error("NODEAGENT_RUN_CGROUP=%s: expected one of %s", cgroup_mode, ", ".join(CGROUP_MODES))
        return 2
    launcher = Launcher(argv, name=args.name, workload=args.workload, weight=args.weight,
                        device=args.device, endpoint=args.endpoint, fail_closed=args.fail_closed,
                        cgroup_mode=cgroup_mode)
    return launcher.run()
