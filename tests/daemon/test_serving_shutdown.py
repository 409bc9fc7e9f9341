"""SIGTERM answers every serving request still open, at once (issue 10, defect 9
follow-up): an ``infer`` still waiting for its device's token and a ``register_model``
still waiting for its workers get ``E_SHUTTING_DOWN``, not silence until the
requester's own timeout. A real daemon with one warm worker; raw peers, so that each
request's answer (or its absence) is seen as it is."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from client_lib import Client, serving
from client_lib import protocol as p
from tests.conftest import wait_for
from tests.rawpeer import RawPeer

pytestmark = pytest.mark.slow


def _answer(peer: RawPeer, request_id: int, timeout: float):
    """The reply to ``request_id``, notices skipped; TimeoutError if none comes."""
    deadline = time.monotonic() + timeout
    while True:
        msg = peer.recv(max(0.0, deadline - time.monotonic()))
        if msg.id == request_id:
            return msg


def test_sigterm_answers_a_queued_infer_and_a_pending_registration_at_once(start_daemon, workdir):
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        # The raw peers send no heartbeats: 3 x 5 s before the daemon would drop them.
        f.write("[ctxpool]\nworkers_per_device = 1\n[heartbeat]\ninterval_ms = 5000\n")
    marker = os.path.join(workdir, "slow.pid")
    os.environ["NA_TEST_SLOW_MARKER"] = marker  # inherited by the daemon's worker
    try:
        # A training holder keeps the token through a 30 s grace: the infer stays queued for it.
        d = start_daemon("--ctxpool", "on", "--enforce", "revoke", "--grace-ms", "30000")
    finally:
        del os.environ["NA_TEST_SLOW_MARKER"]
    with Client("setup", workload="inference", endpoint=d.endpoint) as c:
        c.register_model("sleeps", "tests.serving_models:sleeps_for_input", example_input=torch.zeros(1, 1))
    hog, svc, operator = RawPeer(d.endpoint), RawPeer(d.endpoint), RawPeer(d.endpoint)
    try:
        hog.hello("hog", workload="training")
        assert isinstance(hog.call(p.Acquire(id=hog.take_id())), p.Ok)
        hog.next_notice(p.Grant)
        session = svc.hello("svc", workload="inference").session
        with serving.Packed([torch.zeros(1, 1)], d.endpoint) as packed:
            infer_id = svc.take_id()
            svc.send(p.Infer(id=infer_id, model="sleeps", inputs=packed.refs, timeout_ms=60_000))
            wait_for(lambda: session + ":serve" in d.status().devices[0].queue, timeout=10)
            register_id = operator.take_id()
            operator.send(p.RegisterModel(id=register_id, name="slow", factory="tests.serving_models:slow_factory",
                                          example_input=packed.refs))
            wait_for(lambda: os.path.exists(marker), timeout=30)  # its worker is building it

            sent = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            answers = {name: _answer(peer, rid, timeout=10.0)
                       for name, peer, rid in (("infer", svc, infer_id), ("register", operator, register_id))}
            waited_s = time.monotonic() - sent
    finally:
        for peer in (hog, svc, operator):
            peer.close()
    for name, reply in answers.items():
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.SHUTTING_DOWN, (name, reply)
        assert "retry when it is back" in reply.message, (name, reply)
    assert waited_s < 3.0, waited_s  # at once, not at the 60 s timeout
    assert d.proc.wait(timeout=30) == 0
    assert "[shutdown] step=serving answered running=0 queued=1 registering=1" in d.log()
