"""Fixtures of the tests of nodeagent/ and nodeagent/daemon/."""

from __future__ import annotations

import pytest


@pytest.fixture
def launch(workdir):
    """Factory: ``launch(endpoint, *run_flags, cmd=[...])`` -> the ``nodeagent run`` Popen. Without
    ``cmd`` it runs :data:`tests.daemon.run_counter.COUNTER`. Launchers and their CMDs are killed at the end."""
    from tests.daemon.run_counter import launched_cmds
    yield from launched_cmds(workdir)


@pytest.fixture
def endpoint():
    """A ClusterEndpoint stepped by hand, no daemon and no sockets: (endpoint, recorder, sessions,
    schedulers) for two devices."""
    from tests.daemon.cluster_stepped import stepped_endpoint
    yield from stepped_endpoint()
