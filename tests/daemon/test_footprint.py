"""What the daemon leaves on the host (issue 24): the socket's group said in the log,
only directories it made given its group and mode, and nothing left after a clean stop."""

from __future__ import annotations

import grp
import logging
import os
import stat

import pytest

from client_lib import Client
from nodeagent import runtime
from tests.conftest import Daemon


def _some_group() -> grp.struct_group:
    """A group of this host other than root's, to stand in for ``nodeagent``."""
    for entry in grp.getgrall():
        if entry.gr_gid != 0:
            return entry
    pytest.skip("this host has no group but root")


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("a root daemon's groups are set by root only")


def test_a_socket_directory_that_exists_keeps_its_group_and_mode(tmp_path, monkeypatch):
    _require_root()
    monkeypatch.setattr(runtime, "SOCKET_GROUP", _some_group().gr_name)
    existing = tmp_path / "run"
    existing.mkdir()
    os.chown(existing, 0, 0)
    os.chmod(existing, 0o755)
    assert runtime.prepare_socket_dir(str(existing / "agent.sock")) is False
    st = os.stat(existing)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0o755)  # a parent it did not make: untouched


def test_the_runtime_directory_systemd_made_for_the_daemon_gets_the_group(tmp_path, monkeypatch):
    """The unit's RuntimeDirectory= (root:root 0750, named in $RUNTIME_DIRECTORY) is the
    daemon's own: group members must reach the socket in it."""
    _require_root()
    group = _some_group()
    monkeypatch.setattr(runtime, "SOCKET_GROUP", group.gr_name)
    run = tmp_path / "nodeagent"
    run.mkdir(mode=0o750)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(run))
    assert runtime.prepare_socket_dir(str(run / "agent.sock")) is False  # not made here: not removed at stop
    assert os.stat(run).st_gid == group.gr_gid


def test_a_socket_directory_the_daemon_makes_gets_the_group(tmp_path, monkeypatch):
    _require_root()
    group = _some_group()
    monkeypatch.setattr(runtime, "SOCKET_GROUP", group.gr_name)
    made = tmp_path / "run" / "nodeagent"
    assert runtime.prepare_socket_dir(str(made / "agent.sock")) is True
    st = os.stat(made)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (group.gr_gid, 0o750)
    assert os.stat(tmp_path / "run").st_gid != group.gr_gid  # a parent made on the way is not the daemon's


def test_the_log_says_which_group_the_socket_got(tmp_path, monkeypatch, caplog):
    _require_root()
    group = _some_group()
    path = str(tmp_path / "agent.sock")
    open(path, "w").close()
    monkeypatch.setattr(runtime, "SOCKET_GROUP", group.gr_name)
    with caplog.at_level(logging.INFO, logger="nodeagent.runtime"):
        assert runtime.secure_socket(path) == group.gr_gid
    assert f"socket {path} mode 0660 group {group.gr_name} (gid {group.gr_gid})" in caplog.text
    caplog.clear()
    monkeypatch.setattr(runtime, "SOCKET_GROUP", "nodeagent-no-such-group")
    os.chown(path, 0, 0)
    with caplog.at_level(logging.INFO, logger="nodeagent.runtime"):
        assert runtime.secure_socket(path) == 0
    line = caplog.text
    assert "group nodeagent-no-such-group does not exist" in line and "only root can use it" in line
    assert "groupadd" in line


def test_a_clean_stop_leaves_nothing_beside_the_socket(start_daemon, workdir):
    d = start_daemon()
    with Client("a", endpoint=d.endpoint):
        assert {"agent.sock", "agent.sock.lock"} <= set(os.listdir(workdir))
    assert d.stop() == 0, d.log()
    assert sorted(os.listdir(workdir)) == ["daemon.log", "nodeagent.toml", "state"]


def test_a_socket_directory_the_daemon_made_is_gone_after_a_clean_stop(workdir):
    run = os.path.join(workdir, "run")
    d = Daemon(workdir, [], endpoint=f"ipc://{run}/agent.sock").start()
    assert os.path.isdir(run)
    assert d.stop() == 0, d.log()
    assert not os.path.exists(run)


def test_permission_denied_names_the_group_that_may_connect(start_daemon, workdir):
    from tests.nonroot import NOBODY_GID, SOCKET_GID, require_root, run_as_nobody
    require_root()
    os.chmod(workdir, 0o755)  # nobody may look in, and is stopped by the socket alone
    d = start_daemon()
    group = next(g for g in grp.getgrall() if g.gr_gid not in (0, NOBODY_GID, SOCKET_GID))
    connect = ("import sys\nfrom client_lib import Client, DaemonUnavailableError\n"
               "try:\n    Client('x', endpoint=sys.argv[1]).close()\n"
               "except DaemonUnavailableError as exc:\n    print(exc)\n")
    os.chown(d.socket_path, 0, group.gr_gid)
    out = run_as_nobody(connect, d.endpoint)
    assert f"permission denied: the socket is for root and group {group.gr_name!r} (ask to be added" in out.stdout, \
        out.stdout + out.stderr
    os.chown(d.socket_path, 0, 0)  # no group found to give it: root's alone
    out = run_as_nobody(connect, d.endpoint)
    assert "the socket is for root only" in out.stdout and "group 'nodeagent'" in out.stdout, out.stdout + out.stderr
