"""Who may do what (nodeagent/daemon/authz.py), as a table: every act against every kind of peer."""

from __future__ import annotations

import os

import pytest

from nodeagent.daemon.authz import ALLOWED, Act, Peer, Role, peer_of, refusal
from nodeagent.daemon.cluster import ClusterRoute
from nodeagent.procwatch import PeerCredentials, own_namespaces

C, R, D, O, G, L, U = (Role.CLUSTER, Role.ROOT, Role.DAEMON_USER, Role.OWNER, Role.REGISTRANT, Role.LOCAL,
                       Role.UNVERIFIED)
PEERS = {
    "placement client": {C},
    "root": {R, L, D},
    "the daemon's user (not root)": {D, L},
    "the session's owner": {O, L},
    "a register_group member": {G, L},
    "another local user": {L},
    "unverifiable": {U},
}
# act -> the peers above that may do it
TABLE = {
    Act.SUSPEND: {"placement client", "root", "the session's owner"},
    Act.RESUME: {"placement client", "root", "the session's owner"},
    Act.PARTITION: {"placement client", "root"},
    Act.REGISTER: {"root", "the daemon's user (not root)", "a register_group member"},
    Act.UNREGISTER: {"root", "the daemon's user (not root)", "a register_group member"},
    Act.LEND: {"placement client", "root"},
    Act.RECLAIM: {"placement client", "root"},
    Act.DRAIN: {"placement client", "root"},
    Act.SET_POLICY: {"placement client", "root"},
    Act.SET_WEIGHT: {"placement client", "root"},  # not the owner: it would raise its own share
    Act.RENEW: {"placement client", "root"},
}


def test_the_table_covers_every_act():
    assert set(TABLE) == set(Act) == set(ALLOWED)


@pytest.mark.parametrize("act", list(Act), ids=lambda a: a.name.lower())
@pytest.mark.parametrize("peer", list(PEERS))
def test_each_act_against_each_peer(act, peer):
    why = refusal(act, Peer(frozenset(PEERS[peer]), peer))
    if peer in TABLE[act]:
        assert why is None
    else:
        assert why is not None and why.startswith(f"{peer} may not {act.value}: only ")


class _Frame:
    """A local connection as procwatch reads its peer credentials."""

    def __init__(self, creds):
        self.creds = creds


def test_roles_come_from_the_transport_never_from_a_claim(monkeypatch):
    from nodeagent import procwatch
    monkeypatch.setattr(procwatch, "peer_credentials", lambda frame: getattr(frame, "creds", None))
    me = os.geteuid()
    assert peer_of(ClusterRoute(b"x"), None).roles == {C}
    assert peer_of(b"route", _Frame(None)).roles == {U}
    other = me + 1000 if me else 1000
    host = own_namespaces()
    peer = peer_of(b"route", _Frame(PeerCredentials(pid=1, uid=other, gid=other, namespaces=host)), owner_uid=other)
    assert peer.roles == {L, O} and peer.label == f"uid {other}"
    assert peer_of(b"route", _Frame(PeerCredentials(pid=1, uid=0, gid=0, namespaces=host))).roles >= {R, L}


@pytest.mark.parametrize("kind", ["pid", "user", "mnt", "unreadable"])
def test_uid_0_outside_the_daemons_namespaces_is_a_local_user_and_owns_only_its_own(monkeypatch, kind):
    """A container's root: not ROOT, not the daemon's user, no registrant by the groups it gave
    itself; the owner of a uid-0 session only if that session came from its own namespaces."""
    from nodeagent import procwatch
    monkeypatch.setattr(procwatch, "peer_credentials", lambda frame: getattr(frame, "creds", None))
    host = own_namespaces()
    assert host is not None
    depth, uid_map, root_mount = host
    theirs = {"pid": (depth + 1, uid_map, root_mount), "user": (depth, "0 100000 65536", root_mount),
              "mnt": (depth, uid_map, root_mount + 1), "unreadable": None}[kind]
    frame = _Frame(PeerCredentials(pid=1, uid=0, gid=0, namespaces=theirs))
    peer = peer_of(b"route", frame, owner_uid=0, owner_namespaces=host, register_gid=0, daemon_uid=0)
    assert peer.roles == {L} and "in other pid, user or mount namespaces" in peer.label
    assert refusal(Act.SET_WEIGHT, peer).startswith(
        "uid 0 in other pid, user or mount namespaces than the daemon's and the host's may not")
    if theirs is not None:  # its own session, opened from the same namespaces
        assert peer_of(b"route", frame, owner_uid=0, owner_namespaces=theirs).roles == {L, O}


_IN_A_CONTAINER = r"""
import json, sys
from client_lib import protocol as p
from tests.rawpeer import RawPeer

endpoint, victim = sys.argv[1], sys.argv[2]
peer = RawPeer(endpoint)
asks = {
    "suspend": p.SuspendSession(id=0, session=victim, deadline_ms=100),
    "resume": p.ResumeSession(id=0, session=victim),
    "set_weight": p.SetWeight(id=0, session=victim, weight=1e-6),
    "lend": p.Lend(id=0, device=0, borrower="me"),
    "drain": p.Drain(id=0, device=0),
    "set_policy": p.SetPolicy(id=0, device=0, grace_ms=1.0),
    "partition": p.Partition(id=0, device=0, shares={victim: 99.0}),
    "register": p.RegisterModel(id=0, name="m", factory="os:getpid"),
}
answers = {}
for what, msg in asks.items():
    msg.id = peer.take_id()
    reply = peer.call(msg)
    answers[what] = [getattr(reply, "code", "ok"), getattr(reply, "message", "")]
own = peer.hello("in-a-container").session  # it may open a session, and act on its own
reply = peer.call(p.ResumeSession(id=peer.take_id(), session=own))
answers["resume own"] = [getattr(reply, "code", "ok"), getattr(reply, "message", "")]
print(json.dumps(answers))
"""


@pytest.mark.parametrize("unshare", [["--pid", "--mount", "--fork"], ["--user", "--map-root-user"]],
                         ids=["pid+mount", "user"])
def test_a_root_process_in_its_own_pid_and_mount_namespaces_is_not_the_daemons_root(start_daemon, unshare):
    """Issue 32, item 2: a real uid-0 process in new pid and mount namespaces (unshare(1)), as a
    container's root is (or in a user namespace whose root is the host's uid 0), connects to a real daemon: it may not stop, resume or reweigh another's
    session (one of uid 0, from the host), lend, drain, set policies or partitions, or register a
    model; it may act on the session it opened itself. Host root, asking the same, may."""
    import json
    import shutil
    import subprocess
    import sys

    from client_lib import Client
    from client_lib import protocol as p
    from tests.conftest import REPO
    from tests.rawpeer import RawPeer

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to make a process in new pid and mount namespaces")
    d = start_daemon("--ctxpool", "on")  # served models on: registering is refused for who asks, not for that
    with Client("victim", endpoint=d.endpoint) as victim:
        run = subprocess.run(["unshare", *unshare, "--", sys.executable, "-c", _IN_A_CONTAINER,
                              d.endpoint, victim.session_id], cwd=REPO, capture_output=True, text=True, timeout=60)
        if run.returncode != 0 and "unshare" in run.stderr and "Operation not permitted" in run.stderr:
            pytest.skip(f"this sandbox refuses new namespaces: {run.stderr.strip()}")
        assert run.returncode == 0, run.stderr
        answers = json.loads(run.stdout.strip().splitlines()[-1])
        assert answers.pop("resume own") == ["ok", ""]
        for what, (code, message) in answers.items():
            assert code == p.ErrorCode.FORBIDDEN, (what, code, message)
            assert "in other pid, user or mount namespaces than the daemon's" in message, (what, message)
        host = RawPeer(d.endpoint)  # host root, in the daemon's namespaces
        assert host.call(p.Inventory(id=host.take_id())).devices[0].state == "FREE"  # not lent, not draining
        info = next(s for s in d.status().devices[0].sessions if s.name == "victim")
        assert (info.weight, info.suspended) == (1.0, None)
        reply = host.call(p.SetWeight(id=host.take_id(), session=victim.session_id, weight=2.0))
        assert not isinstance(reply, p.Error), reply
        host.close()
