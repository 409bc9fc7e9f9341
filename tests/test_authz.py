"""Who may do what (nodeagent/daemon/authz.py), as a table: every act against every kind of peer."""

from __future__ import annotations

import os

import pytest

from nodeagent.daemon.authz import ALLOWED, Act, Peer, Role, peer_of, refusal
from nodeagent.daemon.cluster import ClusterRoute
from nodeagent.procwatch import PeerCredentials

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
    peer = peer_of(b"route", _Frame(PeerCredentials(pid=1, uid=other, gid=other)), owner_uid=other)
    assert peer.roles == {L, O} and peer.label == f"uid {other}"
    assert peer_of(b"route", _Frame(PeerCredentials(pid=1, uid=0, gid=0))).roles >= {R, L}
