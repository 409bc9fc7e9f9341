"""Worker processes and their supervisor: real spawned workers on the cpu backend.

A :class:`Loop` drives the pool as the daemon does: a ``select.poll`` whose
fds follow ``on_fds_changed``, and ``on_readable`` for each ready fd. Every
test checks that it left no segment and no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from client_lib import protocol as p
from client_lib import tensors
from tests import safetensors_files as safetensors
from ctxpool.messages import ModelSpec
from ctxpool.pool import (ModelFailed, ModelReady, PoolError, RequestDone, RequestFailed, ShutdownStep,
                          WorkerPool, WorkerReady, WorkerReplaced, WorkerSetup, WorkerState, sweep_stale_segments)
from ctxpool.worker import FAULT_ENV
from tests import models_for_tests as m
from tests.conftest import REPO, wait_for
from tests.ctxpool.pool_driver import Loop, check_left_nothing, our_segments, pool_process_alive, start_pool

E = p.ErrorCode
MLP = "tests.models_for_tests:mlp"


@pytest.fixture(scope="module")
def _shared_pool():
    """One single-worker pool for the module's tests that leave it as they found it: a worker
    is a spawned interpreter importing torch (seconds of CPU), so they share one."""
    driver = Loop()
    pool = start_pool(driver, workers_per_device=1)
    try:
        [ready] = driver.wait_ready(pool, 1)
        yield driver, pool, ready.pid
    finally:
        pool.shutdown(5.0)
    check_left_nothing(driver)


@pytest.fixture
def shared(_shared_pool, examples):
    """(loop, pool) of the module's shared pool, its worker ready; after the test, every model it
    registered is unregistered and dropped, and the worker must be the one it was given."""
    driver, pool, pid = _shared_pool
    assert [w.pid for w in pool.snapshot()[0]] == [pid], "an earlier test replaced the shared worker"
    driver.events.clear()
    yield driver, pool
    for info in pool.models():
        pool.unregister_model(info.name)
    wait_for(lambda: (driver.step(0.05), pool.snapshot()[0][0].models == [])[1], timeout=10)
    assert [w.pid for w in pool.snapshot()[0]] == [pid], "the test replaced the shared worker"
    assert not [e for e in driver.events if isinstance(e, WorkerReplaced)], driver.events
    left = {n for n in our_segments({pid}) if not n.startswith("na-in-")}  # examples go after this
    assert not left, f"weight or output segments left in /dev/shm: {left}"


# ------------------------------------------------------------ models and requests


def test_registration_errors_leave_nothing_behind(shared, examples, tmp_path):
    loop, pool = shared
    x = examples(torch.randn(2, 8))
    path = str(tmp_path / "mlp.safetensors")
    safetensors.save(m.mlp().state_dict(), path)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    cases = {
        "bad-path": (ModelSpec(name="a", factory="not a path", example_input=x), "is not of the form"),
        "no-module": (ModelSpec(name="b", factory="no_such_pkg_q:make", example_input=x), "searched sys.path"),
        "no-file": (ModelSpec(name="c", factory=MLP, weights=str(tmp_path / "none.safetensors"), example_input=x),
                    "does not exist"),
        "wrong-format": (ModelSpec(name="d", factory=MLP, weights=str(garbage), example_input=x), "weights_only"),
        "shapes": (ModelSpec(name="e", factory="tests.models_for_tests:mlp_wider", weights=path, example_input=x),
                   "0.weight: file [16, 8] vs module [32, 8]"),
        "example": (ModelSpec(name="f", factory=MLP, example_input=examples(torch.randn(2, 5))),
                    "does not run its example input"),
    }
    for case, (spec, words) in cases.items():
        event = loop.register(pool, spec)
        assert isinstance(event, ModelFailed) and event.code == E.MODEL, (case, event)
        assert words in event.message, (case, event.message)
        assert pool.models() == []
        assert all(w.models == [] for ws in pool.snapshot().values() for w in ws), case
        assert not [n for n in our_segments(set()) if n.startswith("na-w-")], case
        with pytest.raises(PoolError) as info:
            pool.submit(1, 0, spec.name, x)
        assert info.value.code == E.NO_MODEL
    with pytest.raises(PoolError) as info:
        pool.register_model(ModelSpec(name="g", factory=MLP, devices=[3]))
    assert info.value.code == E.DEVICE
    assert isinstance(loop.register(pool, ModelSpec(name="ok", factory=MLP, weights=path, example_input=x)),
                      ModelReady)  # the same worker still registers a good model


def test_outputs_equal_the_module_run_plainly_and_weights_live_once(loop, examples, tmp_path):
    pool = start_pool(loop)  # two workers: active and standby
    ready = loop.wait_ready(pool, 2)
    reference = m.conv_bn()
    with torch.no_grad():
        reference.bn.running_mean.uniform_(-1, 1)
    path = str(tmp_path / "convbn.pt")
    torch.save(reference.state_dict(), path)
    event = loop.register(pool, ModelSpec(name="convbn", factory="tests.models_for_tests:conv_bn", weights=path,
                                          example_input=examples(torch.randn(1, 3, 8, 8))))
    assert isinstance(event, ModelReady), event
    assert event.info.model_bytes == sum(t.numel() * t.element_size()
                                         for t in [*reference.parameters(), *reference.buffers()])
    assert event.info.layers >= 2 and event.info.groups >= 1
    reference.eval()
    for request_id in (1, 2):
        x = torch.randn(2, 3, 8, 8)
        done, outputs = loop.infer(pool, request_id, "convbn", [x])
        assert isinstance(done, RequestDone), done
        with torch.no_grad():
            assert torch.equal(outputs[0], reference(x))
    # one segment, mapped shared by both workers
    segment = pool.weight_segment("convbn")
    for w in ready:
        with open(f"/proc/{w.pid}/maps") as f:
            lines = [line for line in f if f"/dev/shm/{segment}" in line]
        assert lines and all(line.split()[1].endswith("s") for line in lines), (w.pid, lines)
    assert [n for n in our_segments(set()) if n.startswith("na-w-")] == [segment]


def test_two_outputs_and_tied_weights_from_the_factory_init(shared, examples):
    loop, pool = shared
    ids = torch.tensor([[1, 2, 3, 4]])
    assert isinstance(loop.register(pool, ModelSpec(name="tied", factory="tests.models_for_tests:tied",
                                                    example_input=examples(ids))), ModelReady)
    done, outputs = loop.infer(pool, 7, "tied", [torch.tensor([[5, 6]])])
    assert isinstance(done, RequestDone) and len(outputs) == 2
    assert outputs[0].shape == (1, 2, 10) and outputs[1].shape == (1, 2, 6)
    # the head shares the embedding (rows of hidden are rows of it): logits[j, k] = E[id_j] . E[k]
    logits, hidden = outputs[0][0], outputs[1][0]
    assert torch.allclose(logits[0, 5], hidden[0] @ hidden[0]) and torch.allclose(logits[0, 6], hidden[0] @ hidden[1])
    assert torch.allclose(logits[1, 5], hidden[1] @ hidden[0])


def test_a_model_that_raises_fails_its_request_and_the_worker_serves_the_next(shared, examples):
    loop, pool = shared
    assert isinstance(loop.register(pool, ModelSpec(name="raising", factory="tests.models_for_tests:raising",
                                                    example_input=examples(torch.randn(1, 8)))), ModelReady)
    pid = pool.snapshot()[0][0].pid
    bad = torch.randn(1, 8)
    bad[0, 0] = m.FAIL_CUE
    failed, _ = loop.infer(pool, 1, "raising", [bad])
    assert isinstance(failed, RequestFailed) and failed.code == E.INFERENCE
    assert "ValueError: the model refused this input (FAIL_CUE)" in failed.message
    done, outputs = loop.infer(pool, 2, "raising", [torch.ones(1, 8)])
    assert isinstance(done, RequestDone) and outputs[0].shape == (1, 4)
    # inputs whose segment is gone, and outputs that are not tensors: the request fails, the worker stays
    segment, refs = tensors.pack([torch.ones(1, 8)], "na-in")
    segment.close(), segment.unlink()
    pool.submit(3, 0, "raising", refs)
    failed = loop.wait(RequestFailed, request_id=3)
    assert failed.code == E.INVALID and refs[0].shm in failed.message
    assert isinstance(loop.register(pool, ModelSpec(name="dict", factory="tests.models_for_tests:dict_out",
                                                    example_input=examples(torch.randn(1, 8)))), ModelReady)
    failed, _ = loop.infer(pool, 4, "dict", [torch.ones(1, 8)])
    assert failed.code == E.INFERENCE and "returned a dict" in failed.message
    assert [w.pid for w in pool.snapshot()[0]] == [pid]
    assert not [e for e in loop.events if isinstance(e, WorkerReplaced)]


def test_a_worker_dying_while_preparing_or_attaching_fails_the_registration(loop, examples):
    """The registration's own code killed the worker: E_MODEL saying so, and the deaths spend
    nothing of the restart budget (0 here: one counted death would stop all replacement)."""
    pool = start_pool(loop, workers_per_device=1, restart_budget=(0, 60.0))
    first = loop.wait_ready(pool, 1)[0].pid
    failed = loop.register(pool, ModelSpec(name="p", factory="tests.models_for_tests:dies_in_factory",
                                           example_input=examples(torch.zeros(1, 8))))
    assert isinstance(failed, ModelFailed) and failed.code == E.MODEL
    assert (f"the factory tests.models_for_tests:dies_in_factory killed its worker (pid {first}, killed by SIGKILL "
            "(signal 9)) while building model 'p'") in failed.message
    second = loop.wait(WorkerReplaced, old_pid=first).new_pid
    assert second is not None
    loop.wait(WorkerReady, pid=second)
    cue = torch.zeros(1, 8)
    cue[0, 0] = m.DIE_CUE
    failed = loop.register(pool, ModelSpec(name="a", factory="tests.models_for_tests:dying",
                                           example_input=examples(cue)))
    assert isinstance(failed, ModelFailed) and failed.code == E.MODEL
    assert f"killed its worker (pid {second}, killed by SIGKILL (signal 9)) while attaching model 'a'" in failed.message
    third = loop.wait(WorkerReplaced, old_pid=second).new_pid
    assert third is not None and pool.device_status()[0].gave_up == ""
    loop.wait(WorkerReady, pid=third)
    assert isinstance(loop.register(pool, ModelSpec(name="mlp", factory=MLP,
                                                    example_input=examples(torch.zeros(1, 8)))), ModelReady)
    assert [m_.name for m_ in pool.models()] == ["mlp"]
    assert not [n for n in our_segments(set()) if n.startswith("na-w-")
                and n != pool.weight_segment("mlp")]


def test_a_model_that_kills_its_worker_on_attach_kills_only_the_probe(loop, examples):
    """A registration attaches on one worker first: an example input that crashes the model
    takes down that worker only, while the other keeps serving."""
    pool = start_pool(loop, workers_per_device=2)
    pids = {e.pid for e in loop.wait_ready(pool, 2)}
    assert isinstance(loop.register(pool, ModelSpec(name="mlp", factory=MLP,
                                                    example_input=examples(torch.zeros(1, 8)))), ModelReady)
    cue = torch.zeros(1, 8)
    cue[0, 0] = m.DIE_CUE
    failed = loop.register(pool, ModelSpec(name="a", factory="tests.models_for_tests:dying",
                                           example_input=examples(cue)))
    assert isinstance(failed, ModelFailed) and failed.code == E.MODEL
    dead = loop.wait(WorkerReplaced).old_pid
    survivor = (pids - {dead}).pop()
    assert pool_process_alive(survivor) and not [e for e in loop.events if isinstance(e, WorkerReplaced)]
    done, _ = loop.infer(pool, 1, "mlp", [torch.randn(1, 8)])
    assert isinstance(done, RequestDone)
    assert survivor in [w.pid for w in pool.snapshot()[0]]
    assert not [e for e in loop.events if isinstance(e, WorkerReplaced)]


def test_requests_go_to_the_active_worker_else_the_standby(loop, examples):
    pool = start_pool(loop)
    loop.wait_ready(pool, 2)
    x = examples(torch.randn(1, 8))
    for name in ("a", "b"):
        assert isinstance(loop.register(pool, ModelSpec(name=name, factory=MLP, example_input=x)), ModelReady)
    ran_on: dict[int, int] = {}
    for request_id, name in enumerate(["a", "b", "a", "b", "a"], start=1):
        segment, refs = tensors.pack([torch.randn(1, 8)], "na-in")
        pool.submit(request_id, 0, name, refs)
        busy = [w for w in pool.snapshot()[0] if w.request_id == request_id]
        ran_on[request_id] = busy[0].pid
        done = loop.wait(RequestDone, request_id=request_id)
        tensors.discard(done.outputs)
        segment.close(), segment.unlink()
    assert ran_on[1] != ran_on[2]  # b went to the standby, a stayed resident on the active one
    assert ran_on[3] == ran_on[1] and ran_on[4] == ran_on[2] and ran_on[5] == ran_on[1]


@pytest.mark.slow  # three workers start
def test_each_device_s_workers_start_with_its_environment_and_budget_replacements_too(loop, examples):
    """What the device_setup hook answers reaches the worker process (the model reads its own
    environment), at every spawn, replacements included; each device's budget is its own."""
    asked: list[int] = []

    def setup(device: int) -> WorkerSetup:
        asked.append(device)
        uuid = f"GPU-fake-{device}"
        return WorkerSetup(env={"NODEAGENT_DEVICE_UUID": uuid, "CUDA_VISIBLE_DEVICES": uuid}, ordinal=0,
                           memory_budget_bytes=(1 << 30) if device == 0 else 0)

    pool = start_pool(loop, devices=[0, 1], workers_per_device=1, device_setup=setup)
    loop.wait_ready(pool, 2)
    assert sorted(asked) == [0, 1]
    x = examples(torch.ones(1, 1))
    echo = "tests.models_for_tests:env_echo"
    assert isinstance(loop.register(pool, ModelSpec(name="echo", factory=echo, devices=[0], example_input=x)),
                      ModelReady)
    _, outputs = loop.infer(pool, 1, "echo", [torch.ones(1, 1)], device=0)
    seen = m.read_env_echo(outputs[0])
    assert seen["NODEAGENT_DEVICE_UUID"] == seen["CUDA_VISIBLE_DEVICES"] == "GPU-fake-0"
    # device 1's workers may keep nothing resident: a model is refused there, naming the setting
    failed = loop.register(pool, ModelSpec(name="echo1", factory=echo, devices=[1], example_input=x))
    assert isinstance(failed, ModelFailed) and failed.code == E.NO_MEMORY, failed
    assert "memory budget of 0 bytes" in failed.message and "ctxpool.resident_mb" in failed.message
    old = pool.snapshot()[0][0].pid
    os.kill(old, signal.SIGKILL)
    replaced = loop.wait(WorkerReplaced, old_pid=old)
    loop.wait(WorkerReady, pid=replaced.new_pid)
    assert asked[-1] == 0 and len(asked) == 3
    _, outputs = loop.infer(pool, 2, "echo", [torch.ones(1, 1)], device=0)
    assert m.read_env_echo(outputs[0])["CUDA_VISIBLE_DEVICES"] == "GPU-fake-0"


def test_a_worker_gives_cached_device_memory_back_after_each_reply_not_before():
    """The worker's loop, in this process on a pipe: every reply is sent before the engine is asked to
    release what departed models left cached (a blocking empty_cache on cuda), so no request waits."""
    import multiprocessing
    import threading

    from ctxpool import messages as msg
    from ctxpool import worker as worker_module

    ours, theirs = multiprocessing.Pipe(duplex=True)
    w = worker_module._Worker(theirs, "cpu", 0, 0, None, None, set(), 0)
    assert isinstance(msg.decode_from_worker(ours.recv_bytes()), msg.Ready)
    order: list[str] = []
    send, release = w._send, w.engine.release_cached
    w._send = lambda reply: (order.append(type(reply).__name__), send(reply))[1]
    w.engine.release_cached = lambda: (order.append("release"), release())[1]
    served = threading.Thread(target=w.serve)
    served.start()
    try:
        ours.send_bytes(msg.encode(msg.Run(request_id=1, model="absent", inputs=[])))
        assert isinstance(msg.decode_from_worker(ours.recv_bytes()), msg.Failed)
        ours.send_bytes(msg.encode(msg.Drop(model="absent")))
        assert isinstance(msg.decode_from_worker(ours.recv_bytes()), msg.Dropped)
    finally:
        ours.send_bytes(msg.encode(msg.Shutdown()))
        served.join(10)
        ours.close(), theirs.close()
    assert order == ["Failed", "release", "Dropped", "release"]


def test_a_model_registered_again_while_a_busy_worker_still_drops_it_is_attached_there_too(loop, examples):
    """Unregistered while one worker runs its request, the model's Drop waits behind it there; the
    model registered again meanwhile must be attached on that worker after the Drop, not taken as
    attached already (it would serve on one worker of two, and on none of a device where that
    worker was the only one)."""
    pool = start_pool(loop)
    loop.wait_ready(pool, 2)
    spec = ModelSpec(name="sleeps", factory="tests.serving_models:sleeps_for_input",
                     example_input=examples(torch.zeros(1, 1)))
    assert isinstance(loop.register(pool, spec), ModelReady)
    pool.submit(1, 0, "sleeps", examples(torch.full((1, 1), 1.0)))
    [busy] = [w.pid for w in pool.snapshot()[0] if w.request_id == 1]
    pool.unregister_model("sleeps")
    assert isinstance(loop.register(pool, spec), ModelReady)
    tensors.discard(loop.wait(RequestDone, request_id=1, timeout_s=10).outputs)
    deadline = time.monotonic() + 1.0  # the busy worker's Drop, then whatever follows it, land
    while time.monotonic() < deadline:
        loop.step(0.05)
    assert {w.pid: w.models for w in pool.snapshot()[0]}[busy] == ["sleeps"]


def test_requests_queue_fifo_and_unregister_fails_the_queued_ones(shared, examples):
    loop, pool = shared
    assert isinstance(loop.register(pool, ModelSpec(name="mlp", factory=MLP,
                                                    example_input=examples(torch.randn(1, 8)))), ModelReady)
    segment, refs = tensors.pack([torch.randn(1, 8)], "na-in")
    try:
        for request_id in (1, 2, 3):
            pool.submit(request_id, 0, "mlp", refs)
        assert pool.device_status()[0].queued == 2
        with pytest.raises(PoolError) as info:
            pool.submit(2, 0, "mlp", refs)
        assert info.value.code == E.INVALID
        events = pool.unregister_model("mlp")
        assert {(e.request_id, e.code) for e in events} == {(2, E.NO_MODEL), (3, E.NO_MODEL)}
        done = loop.wait(RequestDone, request_id=1)  # the running one completes
        tensors.discard(done.outputs)
        assert not [n for n in our_segments(set()) if n.startswith("na-w-")]
        loop.step(0.2)
        deadline = time.monotonic() + 10
        while pool.snapshot()[0][0].models and time.monotonic() < deadline:
            loop.step(0.1)
        assert pool.snapshot()[0][0].models == []  # dropped
    finally:
        segment.close(), segment.unlink()


# ------------------------------------------------------------ deaths and restarts


def test_worker_killed_mid_request_is_replaced_and_the_replacement_serves(loop, examples, tmp_path, monkeypatch):
    monkeypatch.setenv(m.BLOCK_DIR_ENV, str(tmp_path))
    pool = start_pool(loop, workers_per_device=1)
    old = loop.wait_ready(pool, 1)[0].pid
    assert isinstance(loop.register(pool, ModelSpec(name="blocking", factory="tests.models_for_tests:blocking",
                                                    example_input=examples(torch.zeros(1, 8)))), ModelReady)
    x = torch.randn(1, 8)
    done, before = loop.infer(pool, 1, "blocking", [x])
    assert isinstance(done, RequestDone)
    cue = torch.zeros(1, 8)
    cue[0, 0] = m.BLOCK_CUE
    segment, refs = tensors.pack([cue], "na-in")
    plain, plain_refs = tensors.pack([x], "na-in")
    try:
        pool.submit(2, 0, "blocking", refs)
        pool.submit(3, 0, "blocking", plain_refs)  # queued behind it (one worker)
        marker = tmp_path / str(old)
        deadline = time.monotonic() + 30
        while not marker.exists():  # the worker is inside forward now
            assert time.monotonic() < deadline, "blocking model never started"
            loop.step(0.05)
        os.kill(old, signal.SIGKILL)
        failed = loop.wait(RequestFailed, request_id=2)
        assert failed.code == E.WORKER_DEAD
        assert f"worker pid {old}" in failed.message and "killed by SIGKILL" in failed.message
        replaced = loop.wait(WorkerReplaced, old_pid=old)
        assert replaced.lost_request_ids == [2] and replaced.new_pid not in (None, old)
        ready = loop.wait(WorkerReady, pid=replaced.new_pid)  # after re-attaching the model
        done = loop.wait(RequestDone, request_id=3)  # the replacement serves the queued request
        assert done.device == 0 and torch.equal(tensors.take(done.outputs)[0], before[0])
        # a running request withdrawn (its deadline passed): its worker is killed, no answer follows
        pool.submit(4, 0, "blocking", refs)
        marker = tmp_path / str(ready.pid)
        while not marker.exists():
            loop.step(0.05)
        assert pool.cancel(4) and not pool.cancel(4)
        loop.wait(WorkerReplaced, old_pid=ready.pid, lost_request_ids=[4])
        new = loop.wait(WorkerReady)
    finally:
        segment.close(), segment.unlink()
        plain.close(), plain.unlink()
    assert not [e for e in loop.events if isinstance(e, (RequestFailed, RequestDone)) and e.request_id == 4]
    done, after = loop.infer(pool, 5, "blocking", [x])
    assert isinstance(done, RequestDone) and torch.equal(after[0], before[0])
    assert [w.pid for w in pool.snapshot()[0]] == [new.pid]
    assert pool.device_status()[0].restarts == 2


def test_restart_budget_exhausted_makes_the_device_unavailable(loop, examples, tmp_path, monkeypatch):
    monkeypatch.setenv(m.BLOCK_DIR_ENV, str(tmp_path))
    pool = start_pool(loop, workers_per_device=1, restart_budget=(1, 60.0))
    first = loop.wait_ready(pool, 1)[0].pid
    assert isinstance(loop.register(pool, ModelSpec(name="mlp", factory=MLP,
                                                    example_input=examples(torch.zeros(1, 8)))), ModelReady)
    segment, refs = tensors.pack([torch.zeros(1, 8)], "na-in")
    try:
        os.kill(first, signal.SIGKILL)
        second = loop.wait(WorkerReplaced, old_pid=first).new_pid
        assert second is not None  # one death is within the budget
        pool.submit(1, 0, "mlp", refs)  # waits for the replacement
        assert pool.device_status()[0].queued == 1
        os.kill(second, signal.SIGKILL)
        gave_up = loop.wait(WorkerReplaced, old_pid=second)
        assert gave_up.new_pid is None and gave_up.lost_request_ids == []
        failed = loop.wait(RequestFailed, request_id=1)
        assert failed.code == E.UNAVAILABLE and "exceed the restart budget of 1" in failed.message
        with pytest.raises(PoolError) as info:
            pool.submit(2, 0, "mlp", refs)
        assert info.value.code == E.UNAVAILABLE
        status = pool.device_status()[0]
        assert status.available is False and pool.snapshot()[0] == [] and status.restarts == 1
        assert "2 worker deaths in 60 s exceed the restart budget of 1" in status.gave_up
    finally:
        segment.close(), segment.unlink()


def test_a_request_past_its_deadline_is_answered_and_its_hung_worker_replaced(loop, examples, tmp_path,
                                                                              monkeypatch):
    """E_TIMEOUT at the deadline; the worker still in forward after the grace is killed and replaced
    without spending the restart budget (0 here); the standby serves meanwhile."""
    monkeypatch.setenv(m.BLOCK_DIR_ENV, str(tmp_path))
    pool = start_pool(loop, workers_per_device=2, restart_budget=(0, 60.0), timeout_grace_s=0.3)
    loop.wait_ready(pool, 2)
    assert isinstance(loop.register(pool, ModelSpec(name="blocking", factory="tests.models_for_tests:blocking",
                                                    example_input=examples(torch.zeros(1, 8)))), ModelReady)
    cue = torch.zeros(1, 8)
    cue[0, 0] = m.BLOCK_CUE
    segment, refs = tensors.pack([cue], "na-in")
    try:
        started = time.monotonic()
        pool.submit(1, 0, "blocking", refs, deadline=started + 0.5)
        hung = next(w.pid for w in pool.snapshot()[0] if w.request_id == 1)
        failed = loop.wait(RequestFailed, request_id=1, timeout_s=10)
        answered_s = time.monotonic() - started
        assert failed.code == E.TIMEOUT and "did not answer within the request's timeout" in failed.message
        assert 0.45 <= answered_s < 1.5, answered_s
        assert pool_process_alive(hung)  # given its grace
        done, _ = loop.infer(pool, 2, "blocking", [torch.randn(1, 8)])  # the standby serves meanwhile
        assert isinstance(done, RequestDone)
        replaced = loop.wait(WorkerReplaced, old_pid=hung, timeout_s=10)
        assert time.monotonic() - started < 0.5 + 0.3 + 1.5
        assert replaced.new_pid is not None and replaced.lost_request_ids == [1]
        assert "after its timeout" in replaced.reason
        loop.wait(WorkerReady, pid=replaced.new_pid)
        assert pool.device_status()[0].gave_up == "" and pool.next_deadline() is None
    finally:
        segment.close(), segment.unlink()
    assert not [e for e in loop.events if isinstance(e, (RequestFailed, RequestDone)) and e.request_id == 1]


def test_a_request_that_finishes_within_the_grace_keeps_its_worker(loop, examples):
    """Late by less than the grace: answered E_TIMEOUT all the same, its outputs dropped, the worker kept."""
    pool = start_pool(loop, workers_per_device=1, timeout_grace_s=5.0)
    pid = loop.wait_ready(pool, 1)[0].pid
    assert isinstance(loop.register(pool, ModelSpec(name="sleeps", factory="tests.serving_models:sleeps_for_input",
                                                    example_input=examples(torch.zeros(1, 1)))), ModelReady)
    pool.submit(1, 0, "sleeps", examples(torch.full((1, 1), 0.6)), deadline=time.monotonic() + 0.2)
    pool.submit(2, 0, "sleeps", examples(torch.full((1, 1), 0.0)), deadline=time.monotonic() + 0.1)
    assert loop.wait(RequestFailed, request_id=2, timeout_s=5).code == E.TIMEOUT  # still queued at its deadline
    assert pool.device_status()[0].queued == 0
    assert loop.wait(RequestFailed, request_id=1, timeout_s=5).code == E.TIMEOUT
    done, out = loop.infer(pool, 3, "sleeps", [torch.full((1, 1), 0.0)])  # served once the late one is done
    assert isinstance(done, RequestDone) and float(out[0]) == 0.0
    assert [w.pid for w in pool.snapshot()[0]] == [pid]
    assert not [e for e in loop.events if isinstance(e, WorkerReplaced)]


def test_a_worker_dying_at_start_says_why(loop, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "fail-start")
    pool = start_pool(loop, workers_per_device=1, restart_budget=(0, 60.0))
    event = loop.wait(WorkerReplaced, timeout_s=30)
    assert event.new_pid is None and event.lost_request_ids == []
    assert "exit code 1" in event.reason and "fail-start" in event.reason
    with pytest.raises(PoolError) as info:
        pool.register_model(ModelSpec(name="x", factory=MLP))
    assert info.value.code == E.UNAVAILABLE


def test_a_worker_not_ready_by_its_deadline_is_killed(loop):
    pool = start_pool(loop, workers_per_device=1, restart_budget=(0, 60.0), start_timeout_s=0.0)
    assert pool.next_deadline() is not None
    pool.on_deadline()
    event = loop.wait(WorkerReplaced, timeout_s=30)
    assert "killed by SIGKILL" in event.reason and "start_timeout_s" in event.reason
    assert pool.next_deadline() is None


# ------------------------------------------------------------ shutdown


@pytest.mark.parametrize("faults, step", [("", ShutdownStep.SHUTDOWN),
                                          ("ignore-shutdown", ShutdownStep.SIGTERM),
                                          ("ignore-shutdown,ignore-sigterm", ShutdownStep.SIGKILL)])
def test_shutdown_escalates_and_records_the_step(loop, monkeypatch, faults, step):
    monkeypatch.setenv(FAULT_ENV, faults)
    pool = start_pool(loop, workers_per_device=1)
    pid = loop.wait_ready(pool, 1)[0].pid
    started = time.monotonic()
    steps = pool.shutdown(2.0)
    assert steps == {pid: step}
    assert time.monotonic() - started < 4.0
    assert not pool_process_alive(pid) and pool.watch_targets() == []
    assert pool.snapshot()[0] == []
    with pytest.raises(PoolError) as info:
        pool.submit(1, 0, "x", [])
    assert info.value.code == E.SHUTTING_DOWN


def test_a_worker_still_starting_gets_sigterm_at_once(loop):
    pool = start_pool(loop, workers_per_device=2)
    pids = [w.pid for w in pool.snapshot()[0]]
    started = time.monotonic()
    assert pool.shutdown(10.0) == {pid: ShutdownStep.SIGTERM for pid in pids}
    assert time.monotonic() - started < 5.0  # not the 5 s a Shutdown message would wait
    assert not any(pool_process_alive(pid) for pid in pids)


def test_a_pool_dropped_without_shutdown_is_cleaned_up_by_its_finaliser():
    pool = WorkerPool("cpu", [0], workers_per_device=1)
    pool.start()
    pid = next(w.pid for ws in pool.snapshot().values() for w in ws)
    assert pool_process_alive(pid) and pool.snapshot()[0][0].state == WorkerState.STARTING.value
    del pool  # no shutdown: the finaliser kills and reaps the worker
    assert not pool_process_alive(pid)


def test_workers_die_with_a_daemon_killed_by_sigkill_and_its_segment_is_swept(tmp_path):
    child = subprocess.Popen([sys.executable, "-m", "tests.pool_daemon_child", str(tmp_path)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        words = child.stdout.readline().split()
        assert words and words[0] == "READY", f"child said {words}"
        pids = [int(words[1]), int(words[2])]
        segment = words[3]
        assert all(pool_process_alive(pid) for pid in pids)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        # the blocked worker is inside forward, not reading its pipe: only PR_SET_PDEATHSIG can end it
        wait_for(lambda: not any(pool_process_alive(pid) for pid in pids), timeout=10)
        assert os.path.exists(f"/dev/shm/{segment}")  # nobody could unlink it
        assert segment in sweep_stale_segments()
        assert not os.path.exists(f"/dev/shm/{segment}")
    finally:
        child.kill()
        child.wait()
        for pid in pids:
            if pool_process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for name in os.listdir("/dev/shm"):
            if name.startswith((f"na-in-{child.pid}-", f"na-w-{child.pid}-")):
                tensors.unlink_segment(name)


# ------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_workers_share_pinned_weights_and_match_the_plain_run(loop, examples, tmp_path):
    pool = WorkerPool("cuda", [0], pool_bytes=64 << 20, on_fds_changed=loop.fds_changed)
    loop.pools.append(pool)
    pool.start()
    ready = loop.wait_ready(pool, 2)
    reference = m.conv_bn()
    path = str(tmp_path / "convbn.safetensors")
    safetensors.save(reference.state_dict(), path)
    assert isinstance(loop.register(pool, ModelSpec(name="convbn", factory="tests.models_for_tests:conv_bn",
                                                    weights=path, example_input=examples(torch.randn(1, 3, 8, 8)))),
                      ModelReady)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        expected = reference.eval()(x)
    for request_id in (1, 2, 3):
        done, outputs = loop.infer(pool, request_id, "convbn", [x])
        assert isinstance(done, RequestDone), done
        assert torch.allclose(outputs[0], expected, atol=1e-2, rtol=1e-2)  # cuDNN convolutions run in TF32
    segment = pool.weight_segment("convbn")
    for w in ready:
        with open(f"/proc/{w.pid}/maps") as f:
            assert any(f"/dev/shm/{segment}" in line for line in f), w.pid


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_worker_named_by_uuid_runs_on_that_gpu_as_its_device_0(loop, examples):
    """NVML's last GPU, whatever CUDA_VISIBLE_DEVICES this process has: the worker sees only it."""
    from nodeagent.devices import CudaBackend as NvmlGpus
    from nodeagent.daemon.worker_setup import worker_env

    with NvmlGpus() as gpus:
        info = gpus.device(gpus.count() - 1)
    env, ordinal = worker_env("cuda", info)
    pool = WorkerPool("cuda", [info.index], workers_per_device=1, on_fds_changed=loop.fds_changed,
                      device_setup=lambda device: WorkerSetup(env=env, ordinal=ordinal))
    loop.pools.append(pool)
    pool.start()
    loop.wait_ready(pool, 1)
    assert isinstance(loop.register(pool, ModelSpec(name="echo", factory="tests.models_for_tests:env_echo",
                                                    example_input=examples(torch.ones(1, 1)))), ModelReady)
    done, outputs = loop.infer(pool, 1, "echo", [torch.ones(1, 1)], device=info.index)
    assert isinstance(done, RequestDone), done
    seen = m.read_env_echo(outputs[0])
    assert seen["CUDA_VISIBLE_DEVICES"] == info.uuid and seen["device"] == "cuda:0"
    assert seen["cuda_uuid"] == info.uuid  # CUDA's device 0 in the worker is the GPU NVML named
