"""One holder per grant, as an invariant (issue 21): a stateful test against a real daemon.

Honest clients (training and inference) ask for the token, hold it, yield when
asked, release and cancel, in any order hypothesis picks; a lying client ignores
every yield request, releases whenever it likes, and also releases every grant id
it ever heard of, its own old ones and the ones just above (another client's).
After every step, once every honest client has read what the daemon sent it, no
two honest clients believe they hold the device (under co-run, where each class has
its own token: no two of one class), and no grant id is believed held twice. Under
co-run the lanes' grant ids interleave, so the liar's guesses are the other lanes' ids.

Single-threaded: the clients are driven through their non-blocking calls, so the
daemon's enforcement is set never to signal (this process holds them all) and its
grace is long (an honest client here answers a yield at the next step, never late).
``NODEAGENT_ONE_HOLDER_STEPS`` raises the step count for a longer run.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from client_lib import Client
from client_lib import protocol as p
from tests.conftest import SHARING_MODES

STEPS = int(os.environ.get("NODEAGENT_ONE_HOLDER_STEPS", "2000"))
STEPS_PER_RUN = 50

HONEST = (("t1", "training"), ("t2", "training"), ("t3", "training"), ("i1", "inference"), ("i2", "inference"))
WORKLOAD = dict(HONEST)


@pytest.fixture(scope="module", params=SHARING_MODES)
def one_holder_daemon(request):
    import tempfile
    from tests.conftest import Daemon
    workdir = tempfile.mkdtemp(prefix="na-")
    d = Daemon(workdir, ["--sharing", request.param, "--enforce", "revoke", "--grace-ms", "60000",
                         "--quantum-ms", "training=5", "--quantum-ms", "inference=5",
                         "--quantum-ms", "best-effort=5"]).start()
    d.sharing = request.param
    yield d
    assert d.stop() == 0, d.log()


class OneHolder(RuleBasedStateMachine):
    """The machine; ``endpoint`` is set by the test before it runs."""

    endpoint = ""
    corun = False  # each class has its own token

    def __init__(self) -> None:
        super().__init__()
        self.clients: dict[str, Client] = {}
        self.wanting: set[str] = set()
        self.liar: Client | None = None
        self.seen: set[int] = set()  # every grant id the liar ever held

    @initialize()
    def connect(self) -> None:
        for name, workload in HONEST:
            self.clients[name] = Client(name, workload=workload, endpoint=self.endpoint, reconnect=False)
        self.liar = Client("liar", workload="training", endpoint=self.endpoint, reconnect=False)

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
        """It releases what it holds, and every grant id it ever heard of and the ones above."""
        self._liar_turn(release=True)

    def _liar_turn(self, release: bool = False) -> None:
        """What the liar does whenever it runs: read, note the grant it holds, and, when its
        rule says so (never because it was asked to yield), release it and every other grant
        id it knows or can guess: old ones of its own, and the next few (another client's)."""
        self.liar._pump(0, raise_async=False)
        if self.liar._grant is not None:
            self.seen.add(self.liar._grant)
        if not release or not self.seen:
            return
        self.liar._grant = None
        self.liar._yield_requested = False
        top = max(self.seen)
        for g in sorted(self.seen | {top + 1, top + 2, top + 3}):  # E_NOT_HOLDER for all but its own
            self.liar._transport.send_quiet(p.Release(id=self.liar._transport.take_id(), grant=g, quiet=True))

    # ------------------------------------------------------------ the invariant

    def _settle(self) -> None:
        """Let every honest client read what came, answering yields as a yield point does,
        until a round changes nothing. The cue: each client's heartbeat is answered after
        everything its connection sent before, and its ack after everything the daemon
        sent it before (one stream each way), so a round in which no client's grant or
        yield request changed and none released leaves nothing on its way to them."""
        for _ in range(50):
            changed = False
            for name, c in self.clients.items():
                before = (c._grant, c._yield_requested)
                c._call(p.Heartbeat(id=c._transport.take_id(), session=c.welcome.session, key=c.welcome.key),
                        timeout=10)
                changed |= (c._grant, c._yield_requested) != before
                if c.holding and c.yield_requested:
                    c.release(requeue=name in self.wanting)
                    changed = True
            self._liar_turn()
            if not changed:
                return

    @invariant()
    def one_honest_holder(self) -> None:
        if not self.clients:
            return
        self._settle()
        holders = {name: c._grant for name, c in self.clients.items() if c._grant is not None}
        assert len(set(holders.values())) == len(holders), f"one grant held twice: {holders}"
        if not self.corun:
            assert len(holders) <= 1, f"two honest clients hold the device: {holders}"
            return
        for workload in {w for _, w in HONEST}:
            mine = {name: g for name, g in holders.items() if WORKLOAD[name] == workload}
            assert len(mine) <= 1, f"two honest {workload} clients hold its token: {mine}"


def test_no_two_honest_clients_ever_hold_the_device(one_holder_daemon):
    OneHolder.endpoint = one_holder_daemon.endpoint
    OneHolder.corun = one_holder_daemon.sharing == "corun"
    runs = max(1, STEPS // STEPS_PER_RUN)
    machine = OneHolder.TestCase
    machine.settings = settings(max_examples=runs, stateful_step_count=STEPS_PER_RUN, deadline=None,
                                suppress_health_check=list(HealthCheck), derandomize=False)
    machine().runTest()
