"""One holder per grant, as an invariant (issue 21): a stateful test against a real daemon.

Honest clients (one-hop and two-hop, training and inference) ask for the token,
hold it, yield when asked, release and cancel, in any order hypothesis picks; a
lying one-hop holder keeps every successor word it was ever told and writes all
of them whenever it likes, and releases claiming it handed nothing. After every
step, once every honest client has read what the daemon sent it, no two honest
clients believe they hold the device, and no grant id is believed held twice.

Single-threaded: the clients are driven through their non-blocking calls, so the
daemon's enforcement is set never to signal (this process holds them all) and its
grace is long (an honest client here answers a yield at the next step, never late).
``NODEAGENT_ONE_HOLDER_STEPS`` raises the step count for a longer run.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from client_lib import Client
from client_lib import protocol as p

STEPS = int(os.environ.get("NODEAGENT_ONE_HOLDER_STEPS", "2000"))
STEPS_PER_RUN = 50

HONEST = (("t1", "training", True), ("t2", "training", True), ("t3", "training", False),
          ("i1", "inference", True))


@pytest.fixture(scope="module")
def one_holder_daemon(tmp_path_factory):
    import tempfile
    from tests.conftest import Daemon
    workdir = tempfile.mkdtemp(prefix="na-")
    d = Daemon(workdir, ["--sharing", "exclusive", "--enforce", "revoke", "--grace-ms", "60000",
                         "--quantum-ms", "training=5", "--quantum-ms", "inference=5",
                         "--quantum-ms", "best-effort=5"]).start()
    yield d
    assert d.stop() == 0, d.log()


class OneHolder(RuleBasedStateMachine):
    """The machine; ``endpoint`` is set by the test before it runs."""

    endpoint = ""

    def __init__(self) -> None:
        super().__init__()
        self.clients: dict[str, Client] = {}
        self.wanting: set[str] = set()
        self.liar: Client | None = None
        self.words: list[tuple[str, bytes]] = []  # (wake path, word) the liar was ever told

    @initialize()
    def connect(self) -> None:
        for name, workload, one_hop in HONEST:
            self.clients[name] = Client(name, workload=workload, endpoint=self.endpoint, one_hop=one_hop,
                                        reconnect=False)
        self.liar = Client("liar", workload="training", endpoint=self.endpoint, one_hop=True, reconnect=False)

    def teardown(self) -> None:
        for client in [*self.clients.values(), self.liar]:
            if client is not None:
                try:
                    client.close()
                except Exception:
                    pass

    # ------------------------------------------------------------ honest clients

    @rule(name=st.sampled_from([h[0] for h in HONEST]))
    def want(self, name: str) -> None:
        c = self.clients[name]
        if not c.holding and name not in self.wanting:
            c.request()
            self.wanting.add(name)

    @rule(name=st.sampled_from([h[0] for h in HONEST]))
    def done(self, name: str) -> None:
        c = self.clients[name]
        c._pump(0)
        if c.holding:
            c.release()
        self.wanting.discard(name)

    @rule(name=st.sampled_from([h[0] for h in HONEST]))
    def cancel(self, name: str) -> None:
        c = self.clients[name]
        c._pump(0)
        if not c.holding and name in self.wanting:
            c.cancel()
            self.wanting.discard(name)

    # ------------------------------------------------------------ the liar

    @rule()
    def liar_acquires(self) -> None:
        self._liar_turn()
        if self.liar._grant is None:
            self.liar.request()

    @rule()
    def liar_gives_way(self) -> None:
        """It releases, always claiming it woke nobody, after writing every word it knows."""
        self._liar_turn(release=True)

    def _liar_turn(self, release: bool = False) -> None:
        """What the liar does whenever it runs: read, keep every successor word it is told,
        write them all (to every channel it ever heard of, whoever holds), and, when its rule
        says so (never because it was asked to yield), release claiming it handed nothing."""
        self.liar._pump(0, raise_async=False)
        hint = self.liar._wake.hint
        if hint is not None and hint[1] is not None:
            entry = (hint[2], p.wake_word(hint[3], hint[1]))
            if entry not in self.words:
                self.words.append(entry)
        for path, word in self.words:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                os.write(fd, word)
            except OSError:
                pass
            finally:
                os.close(fd)
        if self.liar._grant is not None and release:  # a yield request it ignores: it lies
            grant, self.liar._grant = self.liar._grant, None
            self.liar._wake.hint = None
            self.liar._yield_requested = False
            self.liar._send_quiet(p.Release(id=self.liar._take_id(), grant=grant, quiet=True, handed=None))

    # ------------------------------------------------------------ the invariant

    def _settle(self) -> None:
        """Let every honest client read what came, answering yields as a yield point does,
        until a round brings nothing new (the daemon has answered everything sent)."""
        for _ in range(50):
            busy = False
            for name, c in self.clients.items():
                if c._pump(1, raise_async=False):
                    busy = True
                if c.holding and c.yield_requested:
                    c.release(requeue=name in self.wanting)
                    busy = True
            self._liar_turn()
            if not busy:
                time.sleep(0.002)
                if not any(c._pump(0, raise_async=False) for c in self.clients.values()):
                    return

    @invariant()
    def one_honest_holder(self) -> None:
        if not self.clients:
            return
        self._settle()
        holders = {name: c._grant for name, c in self.clients.items() if c._grant is not None}
        assert len(holders) <= 1, f"two honest clients hold the device: {holders}"


def test_no_two_honest_clients_ever_hold_the_device(one_holder_daemon):
    OneHolder.endpoint = one_holder_daemon.endpoint
    runs = max(1, STEPS // STEPS_PER_RUN)
    machine = OneHolder.TestCase
    machine.settings = settings(max_examples=runs, stateful_step_count=STEPS_PER_RUN, deadline=None,
                                suppress_health_check=list(HealthCheck), derandomize=False)
    machine().runTest()
