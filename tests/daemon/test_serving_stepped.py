"""Serving stepped by hand: real tokens and bus, a scripted worker pool, no workers and no
sockets (tests/daemon/test_serving.py drives the same paths through a daemon and real workers)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import msgspec
from prometheus_client import CollectorRegistry

from client_lib import protocol as p
from ctxpool.messages import ModelReady, RequestDone, RequestFailed
from nodeagent.config import ServeConfig
from nodeagent.daemon.bus import Bus, DelegatedAction, DeviceLost
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.serving import Serving, _Model
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.journal import ModelRecord
from nodeagent.metrics import Metrics
from sharing import Workload
from tests.daemon_parts import FakeDevices, loop_handle, make_tokens, replies


class ScriptedPool:
    """Stands in for ctxpool's WorkerPool: records what it is handed to run."""

    def __init__(self) -> None:
        self.submitted: list[int] = []  # job ids
        self.owner_uids: list[int | None] = []  # whose input segments each job may read

    def submit(self, job_id, device, model, inputs, *, owner_uid, any_inputs, deadline) -> None:
        self.submitted.append(job_id)
        self.owner_uids.append(owner_uid)

    def next_deadline(self):
        return None

    def snapshot(self) -> dict:
        """Device -> its workers, each with the models resident on it: model ``m`` on device 0."""
        return {0: [SimpleNamespace(resident=["m"])]}

    def shutdown(self, timeout_s: float) -> dict:
        return {}  # worker pid -> the step that stopped it: none here


class FlakyJournal:
    """Stands in for the JournalWriter: writes fail while ``ok`` is False; records the models written."""

    def __init__(self) -> None:
        self.ok, self.journal, self.models = True, None, []

    def write(self, fn, session=None) -> bool:
        if self.ok:
            fn(self)
        return self.ok

    def put_model(self, record: ModelRecord) -> None:
        self.models.append(record.name)


def _serving():
    """(serving, pool, tokens, sessions, sent) over one cpu device, model ``m`` ready."""
    bus, sessions, sent = Bus(), SessionTable(), []
    metrics = Metrics(CollectorRegistry())
    tokens = make_tokens(sessions=sessions, sent=sent, bus=bus)
    serving = Serving(config=ServeConfig(backend="cpu"), devices=FakeDevices(1), loop=loop_handle(),
                      sessions=sessions, tokens=tokens, mps=None, journal=JournalWriter(None, metrics, bus),
                      replies=replies(sent, session_for=lambda route, request_id, now: sessions.by_route(route)))
    bus.subscribe(DelegatedAction, serving.on_delegated)
    bus.subscribe(DeviceLost, serving.on_device_lost)
    serving._pool = pool = ScriptedPool()
    record = ModelRecord(name="m", factory="x:y", weights=None, device=None, example_refs=[], example_bytes=b"",
                         created_unix=0.0)
    serving._models["m"] = _Model(record=record, segment=None, example=[], ready=True)
    return serving, pool, tokens, sessions, sent, bus


def _client(sessions: SessionTable, tokens, sid: str, workload: str, uid: int | None = None) -> Session:
    s = Session(id=sid, key="k", route=f"conn-{sid}", name=sid, claimed_pid=1, verified_pid=None, start_ticks=None,
                uid=uid, workload=Workload.parse(workload), weight=1.0, device=0, memory_mb=0, last_seen=0.0)
    sessions.add(s)
    tokens.add(0, sid, s.workload, s.weight, 0.0)
    return s


def _infer(serving: Serving, s: Session, request_id: int, now: float) -> None:
    serving.on_infer(s.route, p.Infer(id=request_id, model="m", inputs=[p.TensorRef(dtype="float32", shape=[1])]),
                     None, now)


def test_a_granted_queue_runs_its_requests_one_by_one_and_answers_each():
    serving, pool, tokens, sessions, sent, _ = _serving()
    s = _client(sessions, tokens, "s-a", "inference")
    _infer(serving, s, 1, 0.0)
    _infer(serving, s, 2, 0.0)
    assert pool.submitted == [1]  # granted at once (nobody else on the device); one request at a time
    serving._on_pool_event(RequestDone(request_id=1, device=0, outputs=[], swap="warm", run_ms=2.0), 0.5)
    assert pool.submitted == [1, 2]
    serving._on_pool_event(RequestFailed(request_id=2, code=p.ErrorCode.MODEL, message="boom"), 1.0)
    replies_to_s = [msg for route, msg in sent if route == s.route]
    assert isinstance(replies_to_s[0], p.InferResult) and replies_to_s[0].id == 1
    assert replies_to_s[0].queue_ms == 0.0 and replies_to_s[0].run_ms == 2.0
    assert replies_to_s[1] == p.Error(id=2, code=p.ErrorCode.MODEL, message="boom")
    assert tokens.schedulers[0].holder() is None  # the queue is empty: its token went back


def test_a_queue_asked_to_yield_gives_the_token_back_when_its_running_request_ends():
    serving, pool, tokens, sessions, sent, _ = _serving()
    a, b = _client(sessions, tokens, "s-a", "inference"), _client(sessions, tokens, "s-b", "inference")
    _infer(serving, a, 1, 0.0)
    _infer(serving, a, 2, 0.0)  # queued behind request 1
    _infer(serving, b, 3, 0.01)  # waits for the same class's token
    tokens.on_timers(1.0)  # a's quantum is over and b waits: a's queue is asked to yield
    serving._on_pool_event(RequestDone(request_id=1, device=0, outputs=[], swap="warm", run_ms=2.0), 1.0)
    assert pool.submitted == [1, 3]  # b is served next; a's request 2 waits for a new grant
    assert tokens.schedulers[0].holder() == "s-b:serve" and tokens.state(0, "s-a:serve").value == "waiting"


def test_requests_waiting_for_a_lost_devices_token_are_answered_and_leave_the_line():
    serving, pool, tokens, sessions, sent, bus = _serving()
    trainer = _client(sessions, tokens, "s-t", "training")
    tokens.request(0, trainer.id, 0.0)
    s = _client(sessions, tokens, "s-a", "inference")
    _infer(serving, s, 1, 0.1)  # waits: the trainer is asked to yield first
    assert pool.submitted == [] and tokens.schedulers[0].waiting_count() == 1
    bus.publish(DeviceLost(0, "GPU 0 is lost", 0.2))
    assert [msg for route, msg in sent if route == s.route] == [p.Error(id=1, code=p.ErrorCode.DEVICE,
                                                                        message="GPU 0 is lost")]
    assert tokens.schedulers[0].waiting_count() == 0


def test_a_gone_clients_queue_leaves_the_device_once_its_running_request_ends():
    serving, pool, tokens, sessions, sent, _ = _serving()
    s = _client(sessions, tokens, "s-a", "inference")
    _infer(serving, s, 1, 0.0)
    _infer(serving, s, 2, 0.0)
    serving.forget(s.id, 0.1)  # request 1 runs on; request 2 goes
    assert tokens.on_device(0, "s-a:serve") and tokens.schedulers[0].holder() == "s-a:serve"
    serving._on_pool_event(RequestDone(request_id=1, device=0, outputs=[], swap="warm", run_ms=2.0), 0.5)
    assert pool.submitted == [1] and [msg for route, msg in sent if route == s.route] == []
    assert tokens.schedulers[0].holder() is None and not tokens.on_device(0, "s-a:serve")


def test_a_gone_clients_waiting_queue_leaves_the_device_at_once():
    serving, pool, tokens, sessions, sent, _ = _serving()
    trainer = _client(sessions, tokens, "s-t", "training")
    tokens.request(0, trainer.id, 0.0)
    s = _client(sessions, tokens, "s-a", "inference")
    _infer(serving, s, 1, 0.1)
    serving.forget(s.id, 0.2)
    assert not tokens.on_device(0, "s-a:serve") and tokens.schedulers[0].waiting_count() == 0


def test_shutdown_answers_the_running_the_queued_and_the_registering_at_once(caplog):
    serving, pool, tokens, sessions, sent, _ = _serving()
    s = _client(sessions, tokens, "s-a", "inference")
    _infer(serving, s, 1, 0.0)  # runs
    _infer(serving, s, 2, 0.0)  # queued behind it
    registering = _Model(record=serving._models["m"].record, segment=None, example=[], waiters=[("conn-r", 9)])
    serving._models["m2"] = registering
    with caplog.at_level("INFO", logger="nodeagent.serving"):
        serving.stop()
    answered = [(route, msg.id, msg.code) for route, msg in sent if isinstance(msg, p.Error)]
    assert answered == [(s.route, 1, p.ErrorCode.SHUTTING_DOWN), (s.route, 2, p.ErrorCode.SHUTTING_DOWN),
                        ("conn-r", 9, p.ErrorCode.SHUTTING_DOWN)]
    assert "[shutdown] step=serving answered running=1 queued=1 registering=1" in caplog.text


def test_a_ready_model_whose_journal_write_failed_is_written_once_the_journal_takes_writes():
    serving, *_ = _serving()
    serving._models["m"].journalled = True  # as ready models are once their ModelReady wrote them
    journal = serving._journal = FlakyJournal()
    record = dataclasses.replace(serving._models["m"].record, name="m2")
    serving._models["m2"] = _Model(record=record, segment=None, example=[])
    journal.ok = False
    info = p.ModelInfo(name="m2", factory="x:y", weights=None, model_bytes=4, layers=1, groups=1, devices=[0])
    serving._on_pool_event(ModelReady(name="m2", info=info), 0.0)
    serving.on_timers(1.0)  # the journal still fails: not tried again
    assert journal.models == [] and serving._models["m2"].ready
    journal.ok = True
    serving.on_timers(2.0)
    serving.on_timers(3.0)
    assert journal.models == ["m2"]  # written once, and only the model that was not


def test_models_lists_the_ready_ones_with_the_devices_they_are_resident_on():
    serving, _, _, _, sent, _ = _serving()
    info = p.ModelInfo(name="m", factory="x:y", weights=None, model_bytes=4, layers=1, groups=1, devices=[0])
    serving._models["m"].info = info
    serving._models["m2"] = _Model(record=serving._models["m"].record, segment=None, example=[])  # registering
    serving.on_models("conn-x", p.ModelsRequest(id=5), None, 0.0)
    assert sent == [("conn-x", p.ModelsReply(id=5, models=[msgspec.structs.replace(info, resident=[0])]))]


def test_a_request_runs_with_its_clients_verified_uid_as_the_owner_of_its_inputs():
    serving, pool, tokens, sessions, _, _ = _serving()
    _infer(serving, _client(sessions, tokens, "s-a", "inference", uid=4242), 1, 0.0)
    assert pool.submitted == [1] and pool.owner_uids == [4242]
