"""Run client processes as an unprivileged user beside a test daemon run as root.

The daemon runs as root (as in production) and a client runs as uid 65534
("nobody") with one supplementary group, :data:`SOCKET_GID`, that may reach
the daemon's socket: the socket is ``0660 root:SOCKET_GID`` in a directory
``2750 root:SOCKET_GID``, as ``nodeagent.runtime`` sets up ``/run/nodeagent``
with the ``nodeagent`` group. The directory's setgid bit gives the socket its
group from the moment it is bound, as the daemon's own chown does in
production, so what the daemon reads off its socket at start is right. The
gid is one with no name on this host: the tests add no group to it.

    from tests.nonroot import nobody_daemon, run_as_nobody  # a fixture and a function

    def test_x(nobody_daemon):
        d = nobody_daemon("--ctxpool", "on")
        done = run_as_nobody("from client_lib import Client; ...", d.endpoint)
        assert done.returncode == 0, done.stderr

Registering a model is an operator's act: for nobody to register, start the
daemon with ``config=f"[ctxpool]\\nregister_group = {SOCKET_GID}\\n"``.
:func:`popen_as_nobody` starts one to talk to (or kill) while it runs.

Code run as nobody gets the endpoint as ``sys.argv[1]`` (and in
``NODEAGENT_ENDPOINT``), the extra arguments after it, the repository on its
path and its cwd at the repository root. Where the tests do not run as root,
or no Python interpreter here can be run by uid 65534 with the project's
packages, every user of this module is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import grp
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from typing import Iterator

import pytest

from tests.conftest import REPO, Daemon

NOBODY_UID = 65534
NOBODY_GID = 65534


def _has_group(gid: int) -> bool:
    try:
        grp.getgrgid(gid)
        return True
    except KeyError:
        return False


# A gid with no name: the socket's group in these tests, a supplementary group of the client.
SOCKET_GID = next(g for g in range(61_234, 65_000) if not _has_group(g))

_PROBE = "import client_lib, msgspec, numpy, zmq"


@functools.lru_cache(maxsize=1)
def _interpreter() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | str:
    """(argv prefix, environment) that runs Python as nobody with the project's
    packages, or why there is none. This interpreter first; where uid 65534 cannot
    run it (a venv over an interpreter under /root), the system's of the same
    version with this environment's site-packages on its path."""
    site = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [(sys.executable, [str(REPO)])]
    for path in (f"/usr/bin/{version}", f"/usr/local/bin/{version}", shutil.which(version)):
        if path and os.path.realpath(path) != os.path.realpath(sys.executable):
            candidates.append((path, [str(REPO), *site]))
    tried = []
    for exe, path in candidates:
        env = {"PYTHONPATH": os.pathsep.join(path), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
               "HOME": "/nonexistent", "PATH": "/usr/bin:/bin"}
        try:
            done = subprocess.run([exe, "-c", _PROBE], user=NOBODY_UID, group=NOBODY_GID, extra_groups=[],
                                  env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        except OSError as exc:
            tried.append(f"{exe}: {exc.strerror}")
            continue
        if done.returncode == 0:
            return (exe,), tuple(env.items())
        tried.append(f"{exe}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return "no Python here runs as uid 65534 with the project's packages (" + "; ".join(tried) + ")"


def skip_reason() -> str | None:
    """Why clients cannot be run as another user here, or None."""
    if os.geteuid() != 0:
        return f"running a client as uid {NOBODY_UID} needs root; these tests run as uid {os.geteuid()}"
    found = _interpreter()
    return found if isinstance(found, str) else None


def require_root() -> None:
    """Skip the calling test (or fixture) unless clients can be run as nobody."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


def _command(code: str, endpoint: str, args: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    found = _interpreter()
    if isinstance(found, str):
        raise RuntimeError(found)
    argv, env = found
    return [*argv, "-c", code, endpoint, *args], dict(env, NODEAGENT_ENDPOINT=endpoint)


def popen_as_nobody(code: str, endpoint: str, *args: str, **popen_kwargs) -> subprocess.Popen:
    """Start ``code`` as uid 65534 (groups: 65534 and :data:`SOCKET_GID`); text pipes
    for stdin, stdout and stderr unless given."""
    argv, env = _command(code, endpoint, args)
    for stream in ("stdin", "stdout", "stderr"):
        popen_kwargs.setdefault(stream, subprocess.PIPE)
    return subprocess.Popen(argv, user=NOBODY_UID, group=NOBODY_GID, extra_groups=[SOCKET_GID], env=env,
                            cwd=REPO, text=True, **popen_kwargs)


def run_as_nobody(code: str, endpoint: str, *args: str, timeout: float = 60.0,
                  input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` as uid 65534 to the end; its output as text."""
    argv, env = _command(code, endpoint, args)
    return subprocess.run(argv, user=NOBODY_UID, group=NOBODY_GID, extra_groups=[SOCKET_GID], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, input=input)


def share_with_socket_group(path: str, mode: int) -> None:
    """``path`` owned by root:SOCKET_GID with ``mode``."""
    os.chown(path, 0, SOCKET_GID)
    os.chmod(path, mode)


@contextlib.contextmanager
def reachable_daemon(*extra_args: str, config: str = "", nofile: tuple[int, int] | None = None) -> Iterator[Daemon]:
    """A root daemon whose socket uid 65534 can reach through :data:`SOCKET_GID`
    (for module-scoped fixtures; tests take :func:`nobody_daemon`). Stopped,
    and its directory removed, on exit."""
    require_root()
    workdir = tempfile.mkdtemp(prefix="na-")  # short: ipc paths must stay under 107 bytes
    try:
        share_with_socket_group(workdir, 0o2750)  # setgid: what is made in it (the socket) gets the group
        with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
            f.write(config)
        d = Daemon(workdir, list(extra_args), nofile=nofile).start()
        try:
            share_with_socket_group(d.socket_path, 0o660)  # what runtime.secure_socket does with its group
            yield d
        finally:
            code = d.stop()
            assert code == 0, f"daemon exited {code} on SIGTERM:\n{d.log()}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def nobody_daemon():
    """Factory: ``nobody_daemon("--ctxpool", "on", config="...")`` -> a running root
    :class:`Daemon` that clients run with :func:`run_as_nobody` can reach."""
    with contextlib.ExitStack() as stack:
        yield lambda *args, config="", nofile=None: stack.enter_context(
            reachable_daemon(*args, config=config, nofile=nofile))
