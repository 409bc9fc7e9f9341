"""MPS manager: one ``nvidia-cuda-mps-control`` daemon per GPU, started, spoken to and
supervised (:class:`MpsControl`). What the real program does and what this module relies on:
docs/internals.md.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Mapping

from nodeagent import procwatch

log = logging.getLogger("nodeagent.mps")

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"
LAUNCH_LOG = "nodeagent-launch.log"  # stdout/stderr of `<binary> -d`, beside the daemon's control.log
NO_DAEMON = "Cannot find MPS control daemon process"
# Client settings that must not leak from our environment into the control daemon's.
_CLIENT_ONLY_VARS = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
_POLL_S = 0.02
_START_TIMEOUT_S = 10.0  # to start, or restart, the control daemon until it answers
_MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL


class MpsError(RuntimeError):
    """A control daemon that cannot be started, reached or stopped; the message says which and why."""

    code = "E_MPS"


class MpsStartError(MpsError):
    """The control daemon did not start, or did not answer before the deadline."""


class MpsRestartBudgetError(MpsError):
    """The control daemon died more often than the restart budget allows; supervision gave up."""


class MpsState(enum.Enum):
    """Lifecycle of one device's control daemon, as this manager keeps it.

    ::

                 start()                 quit()
        STOPPED ─────────► RUNNING ─────────────► STOPPED
                            │   ▲
          ensure_running(): │   │ restarted (counted)
          died              └───┘
                            │ more than `restart_budget` restarts in `restart_window_s`
                            ▼
                          FAILED ── quit() ──► STOPPED

    A failed restart attempt leaves it RUNNING (the next ``ensure_running``
    tries again, and counts again).
    """

    STOPPED = "stopped"
    RUNNING = "running"
    FAILED = "failed"


class QuitStep(str, enum.Enum):
    """How far :meth:`MpsControl.quit` had to escalate."""

    NOT_RUNNING = "not-running"  # nothing to stop
    QUIT = "quit"  # the daemon obeyed the quit command
    SIGTERM = "sigterm"  # it ignored quit and exited on SIGTERM
    SIGKILL = "sigkill"  # it needed SIGKILL


class _DaemonProcess:
    """The control daemon, which is not our child: watched and signalled through a pidfd,
    so that a signal can reach only it, never a later process given its pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pidfd = procwatch.open_pidfd(pid)
        self._start_ticks = procwatch.process_start_ticks(pid)

    def alive(self) -> bool:
        if self.pidfd is not None:
            return not procwatch.pidfd_exited(self.pidfd)
        stat = procwatch.read_stat(self.pid)
        return stat is not None and stat.state != "Z" and stat.start_ticks == self._start_ticks

    def signal(self, sig: int) -> bool:
        if not self.alive():
            return False
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout_s: float) -> bool:
        """True once the process has exited, False if it still runs after ``timeout_s``."""
        if self.pidfd is not None:  # poll, not select: the pidfd may lie past FD_SETSIZE
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            return bool(poller.poll(max(timeout_s, 0.0) * 1000.0))
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class MpsControl:
    """The MPS control daemon of one GPU: start, commands, supervision, quit. Its pipe and log
    directories are ``<runtime_dir>/mps/<device_index>/{pipe,log}``, made with ``dir_mode`` (0700:
    only this daemon's user; a system daemon whose clients run as other users must let them in);
    ``env`` is the control program's base environment (default: ours)."""

    def __init__(self, device_index: int, device_uuid: str, runtime_dir: str,
                 control_binary: str = "nvidia-cuda-mps-control", env: Mapping[str, str] | None = None, *,
                 dir_mode: int = 0o700, restart_budget: int = 5, restart_window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if restart_budget < 1 or restart_window_s <= 0:
            raise ValueError("restart_budget must be >= 1 and restart_window_s > 0")
        self.device_index = device_index
        self.device_uuid = device_uuid
        self.control_binary = control_binary
        self.base_dir = os.path.join(runtime_dir, "mps", str(device_index))
        self.pipe_dir = os.path.join(self.base_dir, "pipe")
        self.log_dir = os.path.join(self.base_dir, "log")
        control = os.path.join(self.pipe_dir, CONTROL_SOCKET)
        if len(control.encode()) > _MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"MPS control socket path {control} is longer than a UNIX socket allows "
                             f"({_MAX_SOCKET_PATH_BYTES} bytes); use a shorter runtime_dir")
        self.dir_mode = dir_mode
        self.restart_budget = restart_budget
        self.restart_window_s = restart_window_s
        self.restarts = 0
        self.adopted = False  # start() found a daemon of an earlier run answering in our pipe dir
        self._clock = clock
        self._restart_times: collections.deque[float] = collections.deque()
        self._state = MpsState.STOPPED
        self._failure = ""
        self._proc: _DaemonProcess | None = None
        base = os.environ if env is None else env
        self._env = {**{k: v for k, v in base.items() if k not in _CLIENT_ONLY_VARS}, **self.client_env()}

    # ------------------------------------------------------------- lifecycle

    @property
    def state(self) -> MpsState:
        return self._state

    @property
    def pid(self) -> int | None:
        """Pid of the control daemon, if known."""
        return self._proc.pid if self._proc is not None else None

    def watch_fd(self) -> int | None:
        """A pidfd that becomes readable when the control daemon exits: poll it, then call
        :meth:`ensure_running`. It changes on every restart; None where pidfds are unavailable."""
        return self._proc.pidfd if self._proc is not None else None

    def client_env(self) -> dict[str, str]:
        """What a client needs in its environment to reach this daemon (set before CUDA starts).
        ``CUDA_VISIBLE_DEVICES`` names the GPU by UUID, which the docs allow on both sides; an
        inherited index would be remapped by the MPS server and fail."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir,
                "CUDA_VISIBLE_DEVICES": self.device_uuid}

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Start the control daemon (or adopt one of an earlier run still answering in our
        pipe dir) and return once it answers a command; :class:`MpsStartError` otherwise."""
        if self.alive():  # RUNNING, and so it is
            return
        if self._proc is not None:
            self._proc.close()
            self._proc = None
        self._restart_times.clear()  # an explicit start also clears a FAILED supervisor's record
        self._make_dirs()
        self.adopted = self._adopt()
        if not self.adopted:
            self._launch(timeout_s)
        self._state, self._failure = MpsState.RUNNING, ""
        log.info("[mps] %s device=%d pid=%s pipe=%s", "adopt" if self.adopted else "start",
                 self.device_index, self.pid, self.pipe_dir)

    def alive(self) -> bool:
        """Whether the control daemon runs (by its pidfd; by a command if its pid is unknown)."""
        if self._state is not MpsState.RUNNING:
            return False
        if self._proc is not None:
            return self._proc.alive()
        return self._answers()

    def ensure_running(self) -> bool:
        """The supervisor's step: restart a daemon that died. Returns True if it restarted it; raises
        :class:`MpsRestartBudgetError` once it died more than ``restart_budget`` times in
        ``restart_window_s``, and :class:`MpsStartError` if a restart failed."""
        if self._state is MpsState.STOPPED:
            return False
        if self._state is MpsState.FAILED:
            raise MpsRestartBudgetError(self._failure)
        if self.alive():
            return False
        now = self._clock()
        while self._restart_times and now - self._restart_times[0] > self.restart_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.restart_budget:
            self._state = MpsState.FAILED
            self._failure = (f"MPS control daemon of device {self.device_index} needed more than "
                             f"{self.restart_budget} restarts in {self.restart_window_s:g} s (last: exited); "
                             f"gave up; see the logs in {self.log_dir}")
            log.error("[mps] give-up device=%d restarts=%d reason=exited", self.device_index, self.restarts)
            raise MpsRestartBudgetError(self._failure)
        self._restart_times.append(now)
        self.restarts += 1
        log.warning("[mps] restart device=%d reason=exited restarts=%d", self.device_index, self.restarts)
        if self._proc is not None:  # it exited: ensure_running restarts only a daemon that did
            self._proc.close()
            self._proc = None
        self._launch(_START_TIMEOUT_S)
        return True

    def quit(self, timeout_s: float = 5.0) -> QuitStep:
        """Stop the daemon: ``quit`` command, then SIGTERM, then SIGKILL, with half, a
        third and the rest of ``timeout_s``. Returns the step that stopped it."""
        proc, self._proc = self._proc, None
        self._state = MpsState.STOPPED
        if proc is None or not proc.alive():
            step = QuitStep.NOT_RUNNING
            if proc is None and self._answers():  # running, but its pid is unknown: ask only
                self._try_command("quit", timeout_s)
                step = QuitStep.QUIT
        else:
            step = self._escalate(proc, timeout_s)
        if proc is not None:
            proc.close()
        log.info("[mps] quit device=%d step=%s", self.device_index, step.value)
        return step

    # -------------------------------------------------------------- commands

    def command(self, text: str, timeout_s: float = 5.0) -> str:
        """Send one command line to the daemon and return what it printed."""
        if not text.strip() or "\n" in text or "\r" in text:
            raise ValueError(f"an MPS command is one non-empty line, got {text!r}")
        try:
            done = subprocess.run([self.control_binary], input=text + "\n", capture_output=True, text=True,
                                  env=self._env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise MpsError(f"MPS control daemon of device {self.device_index} did not answer {text!r} "
                           f"within {timeout_s:g} s (pipe dir {self.pipe_dir})") from None
        except OSError as exc:
            raise MpsError(f"cannot run {self.control_binary}: {exc}") from None
        # The front end may report a missing daemon with exit status 0: check its words too.
        if done.returncode != 0 or NO_DAEMON in done.stdout or NO_DAEMON in done.stderr:
            detail = (done.stderr.strip() or done.stdout.strip() or "no output")
            raise MpsError(f"MPS command {text!r} for device {self.device_index} failed "
                           f"(exit {done.returncode}): {detail}")
        return done.stdout

    # -------------------------------------------------------------- internals

    def _make_dirs(self) -> None:
        for path in (os.path.dirname(self.base_dir), self.base_dir, self.pipe_dir, self.log_dir):
            os.makedirs(path, mode=self.dir_mode, exist_ok=True)
            os.chmod(path, self.dir_mode)  # makedirs' mode is filtered by the umask

    def _answers(self, timeout_s: float = 2.0) -> bool:
        try:
            self.command("get_server_list", timeout_s=timeout_s)
            return True
        except MpsError:
            return False

    def _try_command(self, text: str, timeout_s: float) -> None:
        try:
            self.command(text, timeout_s=timeout_s)
        except MpsError as exc:
            log.debug("[mps] device=%d %s failed: %s", self.device_index, text, exc)

    def _read_pid(self) -> _DaemonProcess | None:
        try:
            with open(os.path.join(self.pipe_dir, PID_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return _DaemonProcess(pid) if pid > 0 else None

    def _adopt(self) -> bool:
        """Take over a daemon that an earlier nodeagent started here and left running."""
        if not os.path.exists(os.path.join(self.pipe_dir, CONTROL_SOCKET)) or not self._answers():
            return False
        self._proc = self._read_pid()
        return True

    def _launch(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pid_file = os.path.join(self.pipe_dir, PID_FILE)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pid_file)  # a stale one would name a dead (or reused) pid
        # Output goes to a file, never a pipe: a daemonized grandchild holding a pipe open
        # would keep us waiting for EOF.
        launch_log = os.path.join(self.log_dir, LAUNCH_LOG)
        with open(launch_log, "wb") as out:
            try:
                # umask 022 whatever ours is (the unit's UMask=0077): the control daemon and the
                # per-user servers it starts make the pipes that other users' clients connect to.
                launcher = subprocess.Popen([self.control_binary, "-d"], env=self._env, stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                            umask=0o022)
            except OSError as exc:
                raise MpsStartError(f"cannot run {self.control_binary} -d for device {self.device_index}: {exc} "
                                    "(is the NVIDIA driver's MPS component installed?)") from None
        try:
            code = launcher.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
            raise MpsStartError(self._start_failure(f"{self.control_binary} -d did not return in {timeout_s:g} s"))
        if code != 0:
            raise MpsStartError(self._start_failure(f"{self.control_binary} -d exited {code}"))
        proc: _DaemonProcess | None = None
        while time.monotonic() < deadline:
            if proc is None:
                proc = self._read_pid()
            if proc is not None and not proc.alive():
                proc.close()
                raise MpsStartError(self._start_failure(f"control daemon pid {proc.pid} exited during start-up"))
            if self._answers(timeout_s=max(min(1.0, deadline - time.monotonic()), 0.05)):
                if proc is None:
                    proc = self._read_pid()
                if proc is None:
                    log.warning("[mps] device=%d no %s in %s: liveness by command only",
                                self.device_index, PID_FILE, self.pipe_dir)
                self._proc = proc
                return
            time.sleep(_POLL_S)
        if proc is not None:  # half started and silent: do not leave it holding the pipe dir
            proc.signal(signal.SIGKILL)
            proc.wait(1.0)
            proc.close()
        raise MpsStartError(self._start_failure(
            f"control daemon did not answer within {timeout_s:g} s "
            f"({'pid ' + str(proc.pid) if proc else 'no pid file'})"))

    def _start_failure(self, what: str) -> str:
        tail = []
        for name in (LAUNCH_LOG, "control.log"):
            with contextlib.suppress(OSError), open(os.path.join(self.log_dir, name), errors="replace") as f:
                tail += [f"{name}: {line.rstrip()}" for line in f.readlines()[-3:]]
        detail = ("; last log lines: " + " | ".join(tail)) if tail else ""
        return f"MPS for device {self.device_index}: {what}; see the logs in {self.log_dir}{detail}"

    def _escalate(self, proc: _DaemonProcess, timeout_s: float) -> QuitStep:
        quit_s, term_s = timeout_s / 2, timeout_s / 3
        started = time.monotonic()
        self._try_command("quit", quit_s)
        if proc.wait(quit_s - (time.monotonic() - started)):
            return QuitStep.QUIT
        log.warning("[mps] device=%d ignored quit for %.1f s: SIGTERM pid=%d", self.device_index, quit_s, proc.pid)
        if not proc.signal(signal.SIGTERM):
            return QuitStep.QUIT  # it exited between the wait and the signal: the quit worked, late
        if proc.wait(term_s):
            return QuitStep.SIGTERM
        log.warning("[mps] device=%d ignored SIGTERM for %.1f s: SIGKILL pid=%d", self.device_index, term_s, proc.pid)
        proc.signal(signal.SIGKILL)
        if not proc.wait(max(timeout_s - quit_s - term_s, 1.0)):
            log.error("[mps] device=%d pid=%d still runs after SIGKILL", self.device_index, proc.pid)
        return QuitStep.SIGKILL
