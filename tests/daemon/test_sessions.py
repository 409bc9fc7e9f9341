"""SessionTable: the daemon's sessions by id, connection and process, with real
processes behind their pidfds."""

from __future__ import annotations

import subprocess
import sys

from nodeagent.daemon.sessions import Session, SessionTable
from sharing import Workload
from tests.conftest import wait_for


def _session(sid: str, pid: int | None, route=None) -> Session:
    return Session(id=sid, key="k", route=route, name=sid, claimed_pid=pid or 1, verified_pid=pid, start_ticks=None,
                   uid=0, workload=Workload.parse("training"), weight=1.0, device=0, memory_mb=0, last_seen=0.0)


def test_sessions_are_found_by_id_route_and_exited_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    table = SessionTable()
    try:
        watched = _session("s-watched", child.pid, route="conn-1")
        unverified = _session("s-tcp", None, route="conn-2")
        table.add(watched)
        table.add(unverified)
        assert watched.pidfd is not None and unverified.pidfd is None
        assert len(table) == 2 and "s-watched" in table and table["s-tcp"] is unverified
        assert table.by_route("conn-1") is watched and table.by_route("conn-2") is unverified
        table.attach(watched, "conn-3")  # it reconnected: the old connection no longer finds it
        assert table.by_route("conn-1") is None and table.by_route("conn-3") is watched
        assert table.exited() == []
        child.kill()
        child.wait()
        assert wait_for(lambda: table.exited()) == [watched]
        assert table.remove(watched) and not table.remove(watched)
        assert table.by_route("conn-3") is None and "s-watched" not in table
        table.close_pidfds(watched)
        assert watched.pidfd is None
    finally:
        child.kill()
        table.close()


def test_a_session_whose_route_was_taken_over_keeps_the_new_owner_indexed():
    table = SessionTable()
    old, new = _session("s-old", None, route="conn"), _session("s-new", None)
    table.add(old)
    table.add(new)
    table.attach(new, "conn")  # the same connection now speaks for another session
    assert table.remove(old)
    assert table.by_route("conn") is new  # removing the old one did not unindex the new owner
    table.close()
