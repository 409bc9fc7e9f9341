"""RLIMIT_NOFILE: the daemon raises its soft limit to the hard one at start, and where
what is left cannot hold the configured connections, derives smaller limits so that
one user still cannot lock the others out."""

from __future__ import annotations

import re

import pytest

from client_lib import codec
from client_lib import protocol as p
from nodeagent.fdlimit import FDS_PER_CONNECTION, connection_limits
from tests.conftest import wait_for
from tests.nonroot import nobody_daemon  # noqa: F401 - a fixture
from tests.rawpeer import RawPeer


def test_the_configured_limits_stand_where_they_fit():
    limits = connection_limits(4096, 1024, soft_limit=65536, in_use=40)
    assert (limits.max_connections, limits.max_connections_per_uid, limits.derived) == (4096, 1024, False)
    assert connection_limits(4096, 1024, soft_limit=None, in_use=40).derived is False  # unlimited


def test_where_they_do_not_fit_both_shrink_in_the_configured_proportion():
    limits = connection_limits(4096, 1024, soft_limit=1024, in_use=40, reserved=200)
    room = (1024 - 40 - 200) // FDS_PER_CONNECTION
    assert limits.derived and limits.room == room == 392
    assert limits.max_connections == 392 and limits.max_connections_per_uid == 98  # a quarter, as configured
    assert limits.max_connections_per_uid * 4 <= limits.max_connections  # one user cannot take it all


def test_the_derived_limits_never_reach_zero_nor_exceed_what_was_configured():
    tiny = connection_limits(4096, 1024, soft_limit=100, in_use=90, reserved=200)
    assert (tiny.max_connections, tiny.max_connections_per_uid) == (1, 1)
    limits = connection_limits(1000, 3, soft_limit=1024, in_use=40, reserved=200)
    assert limits.max_connections == 392 and limits.max_connections_per_uid == 1  # 392 * 3 // 1000
    small_share = connection_limits(500, 1000, soft_limit=600, in_use=40, reserved=200)
    assert small_share.max_connections_per_uid == small_share.max_connections == 180


def _limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def test_the_daemon_raises_its_soft_limit_to_the_hard_limit_and_says_so(start_daemon):
    d = start_daemon(nofile=(256, 16384))
    assert _limits(d.proc.pid) == (16384, 16384)
    assert "[serve] RLIMIT_NOFILE soft limit raised from 256 to 16384 (hard 16384)" in d.log()
    assert "[local] the descriptor limit" not in d.log()  # 16,384 holds the default 4,096 connections


def test_a_daemon_already_at_its_hard_limit_says_what_it_has(start_daemon):
    d = start_daemon(nofile=(20000, 20000))
    assert "[serve] RLIMIT_NOFILE soft limit 20000 (hard 20000)" in d.log()


def test_at_a_low_hard_limit_one_user_fills_its_derived_share_and_another_still_connects(nobody_daemon):
    """The issue's case: at 1,024 descriptors, one user's 1,024 allowed connections
    locked every other user out. Now the per-uid limit is derived from what is left."""
    from tests.nonroot import run_as_nobody
    d = nobody_daemon(nofile=(512, 512))
    m = wait_for(lambda: re.search(r"\[local\] the descriptor limit \(RLIMIT_NOFILE 512\) leaves room for (\d+) "
                                   r"connections: local.max_connections 4096 -> (\d+), "
                                   r"local.max_connections_per_uid 1024 -> (\d+)", d.log()))
    room, total, per_uid = map(int, m.groups())
    assert total == room and 1 <= per_uid <= total // 4
    peers = [RawPeer(d.endpoint) for _ in range(per_uid)]
    try:
        wait_for(lambda: isinstance(peers[-1].call(p.StatusRequest(id=peers[-1].take_id())), p.StatusReply))
        extra = RawPeer(d.endpoint)  # root's share is full
        (frame,) = extra.recv_frames(5.0)
        refusal = codec.decode_reply(frame)
        assert refusal.code == p.ErrorCode.UNAVAILABLE and "local.max_connections_per_uid" in refusal.message
        extra.close()
        done = run_as_nobody("import sys\nfrom client_lib import query_status\n"
                             "print(len(query_status(sys.argv[1], timeout=10).devices))", d.endpoint)
        assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    finally:
        for peer in peers:
            peer.close()


@pytest.mark.parametrize("nofile", [(64, 64)])
def test_a_daemon_with_almost_no_descriptors_still_starts_and_serves(start_daemon, nofile):
    d = start_daemon(nofile=nofile)
    assert "local.max_connections 4096 -> 1," in d.log()
    assert d.status().devices
