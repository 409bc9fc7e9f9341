"""Who may do what to the daemon: one table, one function (:func:`refusal`). Roles come from the
transport (peer credentials, the cluster's CURVE handshake), never from a claim; the answer is
None or a reason a user can act on. The roles and acts: docs/internals.md.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from nodeagent import procwatch


class Act(enum.Enum):
    """An act that needs rights; the value is how a refusal names it."""

    SUSPEND = "suspend sessions"
    RESUME = "resume sessions"
    PARTITION = "set MPS partitions"
    REGISTER = "register models"
    UNREGISTER = "unregister models"
    LEND = "lend devices"
    RECLAIM = "reclaim devices"
    DRAIN = "drain devices"
    SET_POLICY = "set policies"
    SET_WEIGHT = "set session weights"
    RENEW = "renew lends"


class Role(enum.Enum):
    """What the daemon knows a peer to be."""

    CLUSTER = "an authenticated placement client"
    ROOT = "root"
    DAEMON_USER = "the daemon's own user"
    OWNER = "the session's owner"
    REGISTRANT = "a member of ctxpool.register_group"
    LOCAL = "a local user"
    UNVERIFIED = "an unverifiable peer"


# Every act is the placement layer's (an authenticated placement client, or root) but these four. A
# session's owner may not raise its own share over its neighbours' (SET_WEIGHT): the placement layer's lever.
_SESSION_OWNERS = frozenset({Role.CLUSTER, Role.ROOT, Role.OWNER})
# A model's factory runs as the daemon's user in its workers: an operator's act, local only.
_OPERATORS = frozenset({Role.ROOT, Role.DAEMON_USER, Role.REGISTRANT})
ALLOWED: dict[Act, frozenset[Role]] = {act: frozenset({Role.CLUSTER, Role.ROOT}) for act in Act} | {
    Act.SUSPEND: _SESSION_OWNERS, Act.RESUME: _SESSION_OWNERS, Act.REGISTER: _OPERATORS, Act.UNREGISTER: _OPERATORS}


@dataclass(frozen=True, slots=True)
class Peer:
    """A requester as the daemon knows it: its roles, and how a refusal names it."""

    roles: frozenset[Role]
    label: str  # "uid 1000", "an unverifiable peer", "an authenticated placement client"


def at_home(creds: procwatch.PeerCredentials | None) -> bool:
    """Whether the kernel says the peer is in the daemon's pid, user and mount namespaces, or
    in the host's (:func:`nodeagent.procwatch.home_namespaces`)."""
    return creds is not None and creds.namespaces is not None and creds.namespaces in procwatch.home_namespaces()


def is_root(creds) -> bool:
    """Whether a local peer is :attr:`Role.ROOT`: uid 0 :func:`at_home`, never a container's root.
    ``creds``: its :class:`~nodeagent.procwatch.PeerCredentials`, or a session (its peer's uid and
    namespaces at hello), or None. What root may or goes first for (the status queue, any segment
    named) goes by this, never by uid 0 alone."""
    return creds is not None and creds.uid == 0 and at_home(creds)


def peer_of(route, frame, *, owner_uid: int | None = None, register_gid: int | None = None,
            daemon_uid: int | None = None, owner_namespaces: tuple | None = None) -> Peer:
    """The peer that sent a request on ``route`` (``frame``: what its identity is read from).
    ``owner_uid``, ``owner_namespaces``: the uid and namespaces of the session the request
    names, if any (a peer outside the daemon's namespaces owns only sessions opened from its own)."""
    from nodeagent.daemon.cluster import ClusterRoute  # the route's type is what the cluster endpoint proved
    if type(route) is ClusterRoute:
        return Peer(frozenset({Role.CLUSTER}), Role.CLUSTER.value)
    creds = procwatch.peer_credentials(frame)
    if creds is None:
        return Peer(frozenset({Role.UNVERIFIED}), Role.UNVERIFIED.value)
    found = {Role.LOCAL}
    host = at_home(creds)
    if is_root(creds):
        found.add(Role.ROOT)
    if host and creds.uid == (os.geteuid() if daemon_uid is None else daemon_uid):
        found.add(Role.DAEMON_USER)
    if owner_uid is not None and creds.uid == owner_uid and (
            host or (creds.namespaces is not None and creds.namespaces == owner_namespaces)):
        found.add(Role.OWNER)
    if register_gid is not None and host:
        from ctxpool import peer_open
        identity = peer_open.identity_of(creds.uid, creds.gid, creds.pid)
        if register_gid in {identity.gid, *identity.groups}:
            found.add(Role.REGISTRANT)
    where = "" if host else " in other pid, user or mount namespaces than the daemon's and the host's"
    return Peer(frozenset(found), f"uid {creds.uid}{where}")


def refusal(act: Act, peer: Peer) -> str | None:
    """Why ``peer`` may not do ``act`` (one line, naming who may), or None."""
    allowed = ALLOWED[act]
    if peer.roles & allowed:
        return None
    who = " or ".join(role.value for role in list(Role) if role in allowed)
    return f"{peer.label} may not {act.value}: only {who} may"
