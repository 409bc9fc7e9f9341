"""nodeagent.keys and `nodeagent keys generate`: files, modes, refusals, load errors, and a
real CURVE handshake through pyzmq's authenticator over the generated allowed/ directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from nodeagent import keys
from nodeagent.keys import KeysError, KeysExistError
from tests.conftest import REPO
from tests.conftest import nodeagent


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---------------------------------------------------------------- generate


def test_generate_writes_the_layout_with_private_modes(tmp_path):
    kd = str(tmp_path / "keys")
    paths = keys.generate(kd, clients=["placement", "ray"])
    assert paths.server_secret == os.path.join(kd, "server.key_secret")
    assert paths.server_public == os.path.join(kd, "server.key")
    assert set(paths.allowed) == set(paths.clients) == {"placement", "ray"}
    assert mode(kd) & 0o027 == 0
    assert mode(os.path.join(kd, "allowed")) == 0o750
    assert mode(os.path.join(kd, "clients")) == 0o700
    assert mode(paths.server_secret) == 0o600 and mode(paths.server_public) == 0o644
    for name in ("placement", "ray"):
        assert paths.allowed[name] == os.path.join(kd, "allowed", f"{name}.key")
        assert paths.clients[name] == os.path.join(kd, "clients", f"{name}.key_secret")
        assert mode(paths.clients[name]) == 0o600 and mode(paths.allowed[name]) == 0o644
    # Nothing else left behind (the staging directory is gone).
    assert sorted(os.listdir(kd)) == ["allowed", "clients", "server.key", "server.key_secret"]
    # The pieces fit together.
    public, secret = keys.load_server(kd)
    assert zmq.curve_public(secret) == public == keys.server_public(kd)
    allowed = keys.load_allowed(kd)
    for name in ("placement", "ray"):
        client_public, _ = keys.load_client(paths.clients[name])
        assert allowed[name] == client_public
    assert allowed["placement"] != allowed["ray"] != public


def test_a_client_named_server_gets_a_key_pair_of_its_own(tmp_path):
    kd = str(tmp_path / "keys")
    paths = keys.generate(kd, clients=["server"])
    public, _ = keys.load_server(kd)
    client_public, _ = keys.load_client(paths.clients["server"])
    assert keys.load_allowed(kd) == {"server": client_public} and client_public != public


def test_generate_refuses_to_overwrite_and_writes_nothing(tmp_path):
    kd = str(tmp_path / "keys")
    keys.generate(kd)
    before = keys.load_server(kd)
    with pytest.raises(KeysExistError, match="refusing to overwrite.*server.key.*overwrite=True"):
        keys.generate(kd, clients=["placement", "new-one"])
    assert keys.load_server(kd) == before
    assert not os.path.exists(os.path.join(kd, "allowed", "new-one.key"))
    assert isinstance(KeysExistError("x"), FileExistsError)


def test_generate_overwrite_replaces_named_keys_and_keeps_other_clients(tmp_path):
    kd = str(tmp_path / "keys")
    keys.generate(kd, clients=["a", "b"])
    old_server, old_allowed = keys.load_server(kd), keys.load_allowed(kd)
    keys.generate(kd, clients=["a"], overwrite=True)
    new_allowed = keys.load_allowed(kd)
    assert keys.load_server(kd) != old_server
    assert new_allowed["a"] != old_allowed["a"] and new_allowed["b"] == old_allowed["b"]


def test_clients_only_adds_a_client_and_keeps_the_server_key(tmp_path):
    kd = str(tmp_path / "keys")
    keys.generate(kd)
    server = keys.load_server(kd)
    paths = keys.generate(kd, clients=["second"], server=False)
    assert paths.server_secret is None and keys.load_server(kd) == server
    assert set(keys.load_allowed(kd)) == {"placement", "second"}


def test_clients_only_needs_a_server_key(tmp_path):
    with pytest.raises(KeysError, match="server.key.*no such key file"):
        keys.generate(str(tmp_path / "none"), clients=["a"], server=False)


@pytest.mark.parametrize("clients, fragment", [
    (["../evil"], "not valid"), ([""], "not valid"), ([".hidden"], "not valid"),
    (["a", "a"], "more than once"), ("placement", "list of names"),
])
def test_generate_rejects_bad_client_names(tmp_path, clients, fragment):
    with pytest.raises(ValueError, match=fragment):
        keys.generate(str(tmp_path / "keys"), clients=clients)
    assert not os.path.exists(tmp_path / "keys")


# ---------------------------------------------------------------- load errors


def test_load_server_missing_names_the_file(tmp_path):
    with pytest.raises(KeysError, match=r"server\.key_secret: no such key file.*keys generate"):
        keys.load_server(str(tmp_path))


def test_load_server_refuses_a_secret_readable_by_others(tmp_path):
    kd = str(tmp_path)
    keys.generate(kd)
    os.chmod(os.path.join(kd, "server.key_secret"), 0o644)
    with pytest.raises(KeysError, match="open to group or others.*chmod 600"):
        keys.load_server(kd)
    assert keys.load_server(kd, check_mode=False)[0] == keys.server_public(kd)


@pytest.mark.parametrize("content, fragment", [
    ("garbage\n", "not a ZeroMQ certificate"),
    ('curve\n    public-key = "tooshort"\n    secret-key = "x"\n', "not a 40-character"),
])
def test_load_server_corrupt_names_the_file(tmp_path, content, fragment):
    path = tmp_path / "server.key_secret"
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(KeysError, match=fragment) as err:
        keys.load_server(str(tmp_path))
    assert str(path) in str(err.value)


def test_load_server_mismatched_pair(tmp_path):
    kd = str(tmp_path)
    paths = keys.generate(kd)
    other_public, _ = zmq.curve_keypair()
    text = open(paths.server_secret).read()
    public, _ = keys.load_server(kd)
    with open(paths.server_secret, "w") as f:
        f.write(text.replace(public.decode(), other_public.decode()))
    with pytest.raises(KeysError, match="does not belong"):
        keys.load_server(kd)


def test_load_client_given_a_public_file(tmp_path):
    paths = keys.generate(str(tmp_path))
    with pytest.raises(KeysError, match="no secret-key"):
        keys.load_client(paths.allowed["placement"])


def test_load_allowed_errors(tmp_path):
    with pytest.raises(KeysError, match="allowed: no such directory"):
        keys.load_allowed(str(tmp_path))
    (tmp_path / "allowed").mkdir()
    assert keys.load_allowed(str(tmp_path)) == {}
    (tmp_path / "allowed" / "bad.key").write_text("nothing useful\n")
    with pytest.raises(KeysError, match="bad.key"):
        keys.load_allowed(str(tmp_path))


def test_server_public_falls_back_to_the_secret_file(tmp_path):
    kd = str(tmp_path)
    keys.generate(kd)
    expected = keys.server_public(kd)
    os.unlink(os.path.join(kd, "server.key"))
    assert keys.server_public(kd) == expected


# ---------------------------------------------------------------- a real CURVE handshake


class CurveEcho:
    """A ROUTER CURVE server using the generated server key, behind an authenticator over allowed/."""

    def __init__(self, kd: str) -> None:
        self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=os.path.join(kd, "allowed"))
        self.server_public, secret = keys.load_server(kd)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.curve_secretkey = secret
        self.router.curve_publickey = self.server_public
        self.router.curve_server = True
        self.router.linger = 0
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def client(self, public: bytes, secret: bytes, server_public: bytes | None = None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public or self.server_public
        sock.linger = 0
        sock.sndtimeo = 5000  # a refused handshake drops the only pipe, and a DEALER's send then blocks
        sock.connect(self.endpoint)
        return sock

    @staticmethod
    def send_refused(sock: zmq.Socket, body: bytes) -> None:
        """Send where the server must refuse: the frame is queued on the pipe the handshake is
        under way on, or, where the refusal already dropped that pipe, not taken at all."""
        try:
            sock.send(body, zmq.NOBLOCK)
        except zmq.Again:
            pass  # no pipe left: refused before the frame was sent

    def echo_until(self, sock: zmq.Socket, timeout_ms: int) -> bytes | None:
        """Serve the router until ``sock`` gets a reply or ``timeout_ms`` passes."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        end = time.monotonic() + timeout_ms / 1000
        while (remaining_ms := (end - time.monotonic()) * 1000) > 0:
            events = dict(poller.poll(remaining_ms))
            if self.router in events:
                route, body = self.router.recv_multipart()
                self.router.send_multipart([route, b"echo:" + body])
            if sock in events:
                return sock.recv()
        return None

    def close(self) -> None:
        self.auth.stop()
        self.ctx.destroy(linger=0)  # closes the sockets a failed test left open, so teardown cannot hang


@pytest.fixture
def curve_server(tmp_path):
    kd = str(tmp_path / "keys")
    paths = keys.generate(kd, clients=["placement"])
    server = CurveEcho(kd)
    yield server, paths
    server.close()


def test_allowed_client_gets_a_reply(curve_server):
    server, paths = curve_server
    sock = server.client(*keys.load_client(paths.clients["placement"]))
    sock.send(b"hi")
    assert server.echo_until(sock, 5000) == b"echo:hi"
    sock.close()


def _answers_the_allowed_client(server, paths) -> bool:
    """The control beside each "no reply": the same server answers an allowed client meanwhile,
    so a silence means a refusal, not a server that answers nobody."""
    sock = server.client(*keys.load_client(paths.clients["placement"]))
    try:
        sock.send(b"control")
        return server.echo_until(sock, 5000) == b"echo:control"
    finally:
        sock.close()


def test_client_with_a_key_not_allowed_gets_no_reply(curve_server, tmp_path):
    server, paths = curve_server
    stranger = keys.generate(str(tmp_path / "other"), clients=["stranger"])
    sock = server.client(*keys.load_client(stranger.clients["stranger"]))
    server.send_refused(sock, b"let me in")
    # The authenticator denies the handshake: the router never sees the frame, the client never a reply.
    assert server.echo_until(sock, 1500) is None
    assert _answers_the_allowed_client(server, paths)
    sock.close()


def test_client_with_the_wrong_server_key_gets_no_reply(curve_server, tmp_path):
    server, paths = curve_server
    impostor = keys.generate(str(tmp_path / "impostor"), clients=[])
    sock = server.client(*keys.load_client(paths.clients["placement"]),
                         server_public=keys.server_public(impostor.keys_dir))
    server.send_refused(sock, b"hi")
    assert server.echo_until(sock, 1500) is None
    assert _answers_the_allowed_client(server, paths)
    sock.close()


def test_plain_client_without_curve_gets_no_reply(curve_server):
    server, paths = curve_server
    sock = server.ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    server.send_refused(sock, b"hi")
    assert server.echo_until(sock, 1500) is None
    assert _answers_the_allowed_client(server, paths)
    sock.close()


# ---------------------------------------------------------------- the command



def test_cli_generate_prints_what_to_copy_where_and_refuses_a_second_time(tmp_path):
    kd = str(tmp_path / "keys")
    out = nodeagent("keys", "generate", "--dir", kd, "--client", "k8s-controller")
    assert out.returncode == 0, out.stderr
    assert "server.key_secret" in out.stdout and "copy it to every placement client" in out.stdout
    assert os.path.join(kd, "clients", "k8s-controller.key_secret") in out.stdout
    assert "keys_dir" in out.stdout
    assert set(keys.load_allowed(kd)) == {"k8s-controller"}
    again = nodeagent("keys", "generate", "--dir", kd)
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr and "add --force" in again.stderr
    assert "overwrite=True" not in again.stderr  # the command's flag only, not the function's argument
    assert len(again.stderr.strip().splitlines()) == 1
    forced = nodeagent("keys", "generate", "--dir", kd, "--force")
    assert forced.returncode == 0, forced.stderr
    assert set(keys.load_allowed(kd)) == {"k8s-controller", "placement"}


def test_cli_help_explains_the_layout():
    out = nodeagent("keys", "generate", "--help")
    assert out.returncode == 0
    for fragment in ("--dir", "--client", "--force", "allowed/NAME.key", "server.key_secret"):
        assert fragment in out.stdout
