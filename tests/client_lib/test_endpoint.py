"""Where a client looks for the daemon (client_lib.endpoint): the environment, then the system
socket where its directory exists, then the socket the daemon itself would bind."""

from __future__ import annotations

import os

from client_lib import endpoint


def test_a_client_takes_the_environment_then_the_system_socket_then_the_daemons_own(monkeypatch, tmp_path):
    system = tmp_path / "run" / "agent.sock"
    monkeypatch.setattr(endpoint, "SYSTEM_SOCKET", str(system))
    system.parent.mkdir()
    monkeypatch.setenv("NODEAGENT_ENDPOINT", "ipc:///somewhere/else.sock")
    assert endpoint.client_endpoint() == "ipc:///somewhere/else.sock"  # though the system directory exists
    monkeypatch.delenv("NODEAGENT_ENDPOINT")
    assert endpoint.client_endpoint() == f"ipc://{system}"
    system.parent.rmdir()
    assert endpoint.client_endpoint() == endpoint.daemon_endpoint()
    if os.geteuid() != 0:
        assert endpoint.client_endpoint() == "ipc://" + endpoint.user_socket_path()
