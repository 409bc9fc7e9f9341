"""A worker pool driven as the daemon drives it (a ``select.poll`` loop over its fds), and the
checks that a test left no segment and no worker process behind."""

from __future__ import annotations

import os
import select
import time

import torch

from client_lib import protocol as p
from client_lib import tensors
from ctxpool.messages import ModelSpec
from ctxpool.pool import ModelFailed, ModelReady, RequestDone, RequestFailed, WorkerPool, WorkerReady


class Loop:
    """The daemon's side: polls the pool's fds, collects its events."""

    def __init__(self) -> None:
        self.poller = select.poll()
        self.fds: set[int] = set()
        self.events: list = []
        self.pools: list[WorkerPool] = []
        self.pids: set[int] = set()

    def fds_changed(self, added: list[int], removed: list[int]) -> None:
        for fd in removed:
            self.poller.unregister(fd)
            self.fds.discard(fd)
        for fd in added:
            self.poller.register(fd, select.POLLIN)
            self.fds.add(fd)

    def step(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` (less if a pool's deadline comes first) and handle what came."""
        deadlines = [d for d in (pool.next_deadline() for pool in self.pools) if d is not None]
        if deadlines:
            timeout_s = max(0.0, min(timeout_s, min(deadlines) - time.monotonic()))
        for fd, _ in self.poller.poll(timeout_s * 1000):
            for pool in self.pools:
                if fd in pool.watch_targets():
                    self.events.extend(pool.on_readable(fd))
        for pool in self.pools:
            due = pool.next_deadline()
            if due is not None and due <= time.monotonic():
                self.events.extend(pool.on_deadline())
        assert self.fds == {fd for pool in self.pools for fd in pool.watch_targets()}
        for pool in self.pools:
            self.pids.update(w.pid for ws in pool.snapshot().values() for w in ws)

    def wait(self, kind: type, timeout_s: float = 60.0, **fields):
        """The first event of ``kind`` with ``fields`` (consumed), waiting for it if need be."""
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self.events:
                if isinstance(event, kind) and all(getattr(event, k) == v for k, v in fields.items()):
                    self.events.remove(event)
                    return event
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind.__name__} {fields} within {timeout_s} s; events: {self.events}")
            self.step(min(left, 0.5))

    def wait_ready(self, pool: WorkerPool, count: int) -> list[WorkerReady]:
        return [self.wait(WorkerReady) for _ in range(count)]

    def register(self, pool: WorkerPool, spec: ModelSpec):
        pool.register_model(spec)
        return self.wait((ModelReady, ModelFailed), name=spec.name)

    def infer(self, pool: WorkerPool, request_id: int, model: str, inputs: list[torch.Tensor], device: int = 0):
        segment, refs = tensors.pack(inputs, "na-in")
        try:
            pool.submit(request_id, device, model, refs)
            event = self.wait((RequestDone, RequestFailed), request_id=request_id)
        finally:
            if segment is not None:
                segment.close()
                segment.unlink()
        if isinstance(event, RequestDone):
            return event, tensors.take(event.outputs)
        return event, None


def our_segments(pids: set[int]) -> set[str]:
    mine = (f"na-w-{os.getpid()}-", f"na-in-{os.getpid()}-", *(f"na-out-{pid}-" for pid in pids))
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}


def pool_process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def checked_loop():
    """A Loop whose pools are shut down after the test; then no segment or process may be left."""
    driver = Loop()
    yield driver
    for pool in driver.pools:
        pool.shutdown(5.0)
    check_left_nothing(driver)


def check_left_nothing(driver: Loop) -> None:
    """After its pools' shutdown: no fd registered, no segment and no worker process left."""
    assert not driver.fds, "fds still registered after shutdown"
    leftovers = our_segments(driver.pids)
    assert not leftovers, f"segments left in /dev/shm: {leftovers}"
    alive = [pid for pid in driver.pids if pool_process_alive(pid)]
    assert not alive, f"worker processes left running: {alive}"


def start_pool(loop: Loop, **kwargs) -> WorkerPool:
    pool = WorkerPool("cpu", kwargs.pop("devices", [0]), on_fds_changed=loop.fds_changed, **kwargs)
    loop.pools.append(pool)
    pool.start()
    return pool


class Example:
    """An example input kept in a segment for the model's lifetime, as the daemon keeps it."""

    def __init__(self, *tensors_in: torch.Tensor) -> None:
        self.segment, self.refs = tensors.pack(list(tensors_in), "na-in")

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()


def example_maker():
    made: list[Example] = []

    def make(*tensors_in: torch.Tensor) -> list[p.TensorRef]:
        made.append(Example(*tensors_in))
        return made[-1].refs

    yield make
    for example in made:
        example.close()
