"""CURVE keys of the cluster endpoint: create them, and load them with errors that say what to
fix. The keys directory's layout: docs/cluster.md and docs/internals.md.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger("nodeagent.keys")

__all__ = ["DEFAULT_KEYS_DIR", "KeyPaths", "KeysError", "KeysExistError", "generate", "load_allowed",
           "load_client", "load_server", "server_public"]

DEFAULT_KEYS_DIR = "/etc/nodeagent/keys"
SERVER_NAME = "server"
ALLOWED_DIR = "allowed"
CLIENTS_DIR = "clients"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SECRET_MODE = 0o600
_PUBLIC_MODE = 0o644


class KeysError(Exception):
    """A key file or directory is missing, unreadable, corrupt or too open; the message names it."""


class KeysExistError(KeysError, FileExistsError):
    """``generate`` would overwrite existing keys and was not told to; ``existing``: their paths."""

    def __init__(self, existing: Sequence[str]) -> None:
        self.existing = list(existing)
        super().__init__(f"refusing to overwrite existing keys: {', '.join(self.existing)} "
                         "(generate with overwrite=True replaces them; every client then needs the new keys)")


@dataclass(frozen=True)
class KeyPaths:
    """What :func:`generate` wrote."""

    keys_dir: str
    server_public: str | None  # None when only clients were generated
    server_secret: str | None
    allowed: dict[str, str] = field(default_factory=dict)  # client name -> its public key file
    clients: dict[str, str] = field(default_factory=dict)  # client name -> its secret key file


def _check_names(clients: Sequence[str]) -> list[str]:
    if isinstance(clients, str):
        raise ValueError(f"clients must be a list of names, not the string {clients!r}")
    names = list(clients)
    for name in names:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"client name {name!r} is not valid: use 1-64 letters, digits, '_', '.', '-', "
                             "starting with a letter or digit")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"client names given more than once: {', '.join(dupes)}")
    return names


def generate(keys_dir: str, *, clients: Sequence[str] = ("placement",), overwrite: bool = False,
             server: bool = True) -> KeyPaths:
    """Create the server key pair (unless ``server=False``) and one key pair per client name.

    Refuses (:class:`KeysExistError`, nothing written) when a file it would write exists, unless
    ``overwrite``. Clients not named are left alone: their public keys in ``allowed/`` stay allowed.
    With ``server=False`` only clients are added, and the server key must already exist.
    """
    names = _check_names(clients)
    if not server and not names:
        raise ValueError("nothing to generate: server=False and no client names")
    keys_dir = os.path.abspath(keys_dir)
    allowed_dir = os.path.join(keys_dir, ALLOWED_DIR)
    clients_dir = os.path.join(keys_dir, CLIENTS_DIR)
    # certificate name -> where its public and its secret file go
    pairs = {name: (os.path.join(allowed_dir, f"{name}.key"), os.path.join(clients_dir, f"{name}.key_secret"))
             for name in names}
    server_pair = (os.path.join(keys_dir, f"{SERVER_NAME}.key"), os.path.join(keys_dir, f"{SERVER_NAME}.key_secret"))
    if not server:
        server_public(keys_dir)  # raises KeysError naming the file when there is no server key yet
    targets = [*(server_pair if server else ()), *(path for pair in pairs.values() for path in pair)]
    existing = [t for t in targets if os.path.lexists(t)]
    if existing and not overwrite:
        raise KeysExistError(existing)

    os.makedirs(keys_dir, mode=0o750, exist_ok=True)
    for path, mode in ((allowed_dir, 0o750), (clients_dir, 0o700)):
        os.makedirs(path, mode=mode, exist_ok=True)
        os.chmod(path, mode)  # makedirs' mode is filtered by the umask, and an existing dir keeps its own
    staging = tempfile.mkdtemp(prefix=".keys-", dir=keys_dir)  # 0700, same filesystem: renames are atomic
    try:
        moves: list[tuple[str, str]] = []
        if server:
            moves += zip(zmq.auth.create_certificates(staging, SERVER_NAME), server_pair)
        client_staging = os.path.join(staging, CLIENTS_DIR)  # apart from the server's: a client may be "server"
        os.mkdir(client_staging)
        for name, pair in pairs.items():
            moves += zip(zmq.auth.create_certificates(client_staging, name), pair)
        for src, dst in moves:
            os.chmod(src, _SECRET_MODE if src.endswith(".key_secret") else _PUBLIC_MODE)
            os.replace(src, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("[keys] generated dir=%s server=%s clients=%s", keys_dir, server, ",".join(names) or "-")
    return KeyPaths(keys_dir, *(server_pair if server else (None, None)),
                    allowed={name: pair[0] for name, pair in pairs.items()},
                    clients={name: pair[1] for name, pair in pairs.items()})


# ------------------------------------------------------------------ loading


def _check_key(key: bytes, what: str, path: str) -> None:
    try:
        raw = z85.decode(key)
    except Exception:  # z85 raises ValueError, KeyError or struct.error on junk, depending on the junk
        raw = b""
    if len(raw) != 32:
        raise KeysError(f"{path}: the {what} is not a 40-character Z85 CURVE key; regenerate it with "
                        "`nodeagent keys generate`")


def _load(path: str, *, secret: bool, check_mode: bool) -> tuple[bytes, bytes | None]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise KeysError(f"{path}: no such key file; create it with `nodeagent keys generate`") from None
    except OSError as exc:
        raise KeysError(f"{path}: cannot read the key file: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeysError(f"{path}: not a regular file")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise KeysError(f"{path}: not a ZeroMQ certificate: {exc}") from None
    _check_key(public, "public key", path)
    if secret:
        if secret_key is None:
            raise KeysError(f"{path}: holds no secret-key; this is a public certificate, "
                            "give the matching .key_secret file")
        if check_mode and st.st_mode & 0o077:
            raise KeysError(f"{path}: secret key file is open to group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                            "chmod 600 it (in Kubernetes: defaultMode: 0400 on the Secret volume)")
        _check_key(secret_key, "secret key", path)
        if zmq.curve_public(secret_key) != public:
            raise KeysError(f"{path}: the public key does not belong to the secret key; regenerate the file")
    return public, secret_key


def load_server(keys_dir: str, *, check_mode: bool = True) -> tuple[bytes, bytes]:
    """The daemon's (public, secret) CURVE keys, from ``keys_dir/server.key_secret``."""
    return _load(os.path.join(keys_dir, f"{SERVER_NAME}.key_secret"), secret=True,  # type: ignore[return-value]
                 check_mode=check_mode)


def server_public(keys_dir: str) -> bytes:
    """The daemon's public key: from ``server.key``, or derived from ``server.key_secret`` if that is all there is."""
    path = os.path.join(keys_dir, f"{SERVER_NAME}.key")
    if os.path.lexists(path) or not os.path.lexists(os.path.join(keys_dir, f"{SERVER_NAME}.key_secret")):
        return _load(path, secret=False, check_mode=False)[0]
    return load_server(keys_dir, check_mode=False)[0]


def load_allowed(keys_dir: str) -> dict[str, bytes]:
    """Client name -> public key (Z85) for every ``keys_dir/allowed/*.key``. Empty when none are allowed."""
    allowed_dir = os.path.join(keys_dir, ALLOWED_DIR)
    try:
        entries = sorted(os.listdir(allowed_dir))
    except FileNotFoundError:
        raise KeysError(f"{allowed_dir}: no such directory; create keys with `nodeagent keys generate`") from None
    except OSError as exc:
        raise KeysError(f"{allowed_dir}: cannot list it: {exc.strerror}") from None
    allowed: dict[str, bytes] = {}
    for entry in entries:
        if entry.endswith(".key") and not entry.startswith("."):
            allowed[entry[: -len(".key")]] = _load(os.path.join(allowed_dir, entry), secret=False,
                                                   check_mode=False)[0]
    if not allowed:
        log.warning("[keys] no client keys in %s: no placement client can connect", allowed_dir)
    return allowed


def load_client(path: str, *, check_mode: bool = True) -> tuple[bytes, bytes]:
    """A client's (public, secret) CURVE keys from its ``.key_secret`` file."""
    return _load(path, secret=True, check_mode=check_mode)  # type: ignore[return-value]
