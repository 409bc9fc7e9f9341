"""What a training worker on a lent device does at a reclaim (nodeagent_ray.train), against a
real daemon and without Ray: it hands its state off, parks it, and the same process resumes
in-process without redoing a step; a new worker starts from the newest hand-off."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from client_lib.placement import PlacementClient
from nodeagent_ray.train import HandOff, LentWorker
from tests.conftest import wait_for

JOB = "job-7"


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model, opt, gen) -> None:
    loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_hand_off_keeps_the_newest_and_skips_one_that_cannot_be_read(tmp_path):
    store = HandOff(str(tmp_path), keep=2)
    model, opt = model_and_optimizer()
    gen = torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        train_step(model, opt, gen)
        store.write(step, model, opt)
    assert store.steps() == [2, 3]
    (tmp_path / "state-000000003.pt").write_bytes(b"cut short")  # a writer that died mid-file... renamed
    fresh, fresh_opt = model_and_optimizer(seed=5)
    assert store.load(fresh, fresh_opt) == 2
    assert HandOff(str(tmp_path / "empty")).load(fresh, fresh_opt) == 0


class Trainer(threading.Thread):
    """A LentWorker's training loop on a thread of its own (the Client is used from that thread only)."""

    def __init__(self, endpoint: str, handoff_dir: str) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.handoff_dir = endpoint, handoff_dir
        self.steps: list[int] = []
        self.stop_at: int | None = None
        self.error: BaseException | None = None
        self.worker: LentWorker | None = None
        self.model = None
        self.ready = threading.Event()
        self.resumed: tuple[int, list[torch.Tensor]] | None = None  # (step, parameters) just after a resume

    def run(self) -> None:
        try:
            self.worker = LentWorker(JOB, self.handoff_dir, tracker=None, rank=0, world_size=1,
                                     endpoint=self.endpoint)
            self.model, opt = model_and_optimizer()
            step = self.worker.start(self.model, opt)
            self.first_step = step
            self.ready.set()
            gen = torch.Generator().manual_seed(2)
            while self.stop_at is None or step < self.stop_at:
                train_step(self.model, opt, gen)
                step += 1
                self.steps.append(step)
                parks = self.worker.parks
                self.worker.step_done(step)
                if self.worker.parks != parks:  # it was parked in there, and is back
                    self.resumed = (step, [p.detach().clone() for p in self.model.parameters()])
                time.sleep(0.005)
            self.worker.close()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.ready.set()


def test_a_reclaimed_worker_hands_off_parks_and_resumes_in_process_without_redoing_a_step(daemon, tmp_path):
    handoff_dir = str(tmp_path / "handoff")
    with PlacementClient({"local": daemon.endpoint}, keys=None, timeout_ms=5000) as placement:
        placement.set_policy("local", 0, protect_s=0)  # lendable again as soon as it is reclaimed
        placement.lend("local", 0, JOB)
        trainer = Trainer(daemon.endpoint, handoff_dir)
        trainer.start()
        assert trainer.ready.wait(30) and trainer.error is None, trainer.error
        wait_for(lambda: len(trainer.steps) >= 20, timeout=30)

        reply = placement.reclaim("local", 0, deadline_ms=3000)
        assert list(reply.outcomes.values()) == ["suspended"], reply
        assert trainer.worker.parks == 1
        parked_at = trainer.steps[-1]
        time.sleep(0.3)
        assert trainer.steps[-1] == parked_at  # it waits, parked, while the device is inference's
        # The state it handed off at the reclaim is the step it parked at.
        assert HandOff(handoff_dir).steps()[-1] == parked_at

        placement.lend("local", 0, JOB)  # lent again: the controller resumes the session
        session = trainer.worker.client.session_id
        placement.resume("local", session)
        wait_for(lambda: len(trainer.steps) and trainer.steps[-1] >= parked_at + 10, timeout=30)
        trainer.stop_at = trainer.steps[-1] + 1
        trainer.join(30)
        assert trainer.error is None, trainer.error
        # In-process: every step once, in order, across the park (none redone, none skipped) ...
        assert trainer.steps == list(range(trainer.first_step + 1, trainer.steps[-1] + 1))
        assert trainer.worker.client.last_suspend is not None
        # ... and from exactly the state it parked: unparked, its weights are the ones it handed off.
        resumed_step, weights = trainer.resumed
        assert resumed_step == parked_at
        handed = torch.load(os.path.join(handoff_dir, f"state-{parked_at:09d}.pt"), weights_only=True)["model"]
        assert all(torch.equal(a, b) for a, b in zip(weights, handed.values()))


def test_a_new_worker_starts_from_the_newest_hand_off(daemon, tmp_path):
    handoff_dir = str(tmp_path / "handoff")
    model, opt = model_and_optimizer()
    gen = torch.Generator().manual_seed(3)
    for _ in range(7):
        train_step(model, opt, gen)
    HandOff(handoff_dir).write(7, model, opt)
    with PlacementClient({"local": daemon.endpoint}, keys=None, timeout_ms=5000) as placement:
        placement.lend("local", 0, JOB)
        worker = LentWorker(JOB, handoff_dir, tracker=None, rank=0, world_size=1, endpoint=daemon.endpoint)
        fresh, fresh_opt = model_and_optimizer(seed=4)
        assert worker.start(fresh, fresh_opt) == 7
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
        worker.close()


def test_a_worker_of_a_job_the_device_is_not_lent_to_is_refused(daemon, tmp_path):
    from client_lib import DaemonError
    with pytest.raises(DaemonError, match="not lent"):
        LentWorker(JOB, str(tmp_path), tracker=None, rank=0, world_size=1, endpoint=daemon.endpoint)


def test_the_borrower_reaches_a_training_session_through_the_environment(daemon, monkeypatch):
    """A loan node's NODEAGENT_BORROWER is all a worker needs: Client(workload="training") picks it up.
    An inference client in the same environment has no borrower (it may join any device)."""
    from client_lib import Client, DaemonError
    monkeypatch.setenv("NODEAGENT_BORROWER", JOB)
    with pytest.raises(DaemonError, match="not lent"):  # the device is FREE, not lent to job-7
        Client("worker", workload="training", endpoint=daemon.endpoint)
    with Client("ranker", workload="inference", endpoint=daemon.endpoint) as ranker:
        assert ranker.borrower is None
    with PlacementClient({"local": daemon.endpoint}, keys=None, timeout_ms=5000) as placement:
        placement.lend("local", 0, JOB)
        with Client("worker", workload="training", endpoint=daemon.endpoint) as worker:
            device = placement.inventory()["local"].reply.devices[0]
            assert [(s.id, s.borrower) for s in device.sessions] == [(worker.session_id, JOB)]


class StopAsked(LentWorker):
    """A worker whose tracker says "stop" from ``stop_from`` (monotonic) on: the rank-0 question
    the resize wait asks, without a Ray cluster."""

    stop_from = float("inf")

    def _stop_asked(self) -> bool:
        return time.monotonic() >= self.stop_from


def test_a_group_waiting_for_a_resize_that_does_not_come_trains_on_when_asked_to_stop(daemon, tmp_path):
    # The scenario's hang: a pause came (a loan node Ray Train could not use), the driver asked the
    # job to stop, and the workers kept waiting for a restart instead of training on to the stop step.
    with PlacementClient({"local": daemon.endpoint}, keys=None, timeout_ms=5000) as placement:
        placement.lend("local", 0, JOB)
        worker = StopAsked(JOB, str(tmp_path / "handoff"), resize_wait_s=20.0, tracker=None, rank=0, world_size=1,
                           endpoint=daemon.endpoint)
        model, opt = model_and_optimizer()
        worker.start(model, opt)
        worker.step = 12
        worker.stop_from = time.monotonic() + 0.3
        started = time.monotonic()
        worker._wait_for_resize()
        waited = time.monotonic() - started
        assert 0.3 <= waited < 2.0, f"waited {waited:.1f} s for a resize after the stop was asked"
        assert worker.handoff.steps() == [12]  # the hand-off was still written before the wait
        worker.close()


def test_a_group_waiting_for_a_resize_that_does_not_come_trains_on_after_resize_wait_s(daemon, tmp_path):
    with PlacementClient({"local": daemon.endpoint}, keys=None, timeout_ms=5000) as placement:
        placement.lend("local", 0, JOB)
        worker = StopAsked(JOB, str(tmp_path / "handoff"), resize_wait_s=0.6, tracker=None, rank=0, world_size=1,
                           endpoint=daemon.endpoint)
        model, opt = model_and_optimizer()
        worker.start(model, opt)
        started = time.monotonic()
        worker._wait_for_resize()
        assert 0.5 <= time.monotonic() - started < 3.0
        worker.close()

