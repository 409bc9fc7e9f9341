"""A stand-in daemon that a test kills with SIGKILL: it starts a worker pool, registers
the blocking test model, gets one worker stuck inside forward, prints
``READY <blocked pid> <idle pid> <weight segment>`` and waits to be killed.

Run as ``python -m tests.pool_daemon_child <block dir>`` from the repository root.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import sys
import threading

import torch

from client_lib import tensors
from ctxpool.messages import ModelSpec
from ctxpool.pool import ModelReady, WorkerPool, WorkerReady
from tests import models_for_tests as m


def main() -> None:
    block_dir = sys.argv[1]
    os.environ[m.BLOCK_DIR_ENV] = block_dir
    pool = WorkerPool("cpu", [0], workers_per_device=2)
    pool.start()
    events: list = []

    def until(predicate) -> None:
        while not predicate():
            for fd in multiprocessing.connection.wait(pool.watch_targets(), timeout=60):
                events.extend(pool.on_readable(fd if isinstance(fd, int) else fd.fileno()))

    until(lambda: sum(isinstance(e, WorkerReady) for e in events) == 2)
    _, example = tensors.pack([torch.zeros(1, 8)], "na-in")
    pool.register_model(ModelSpec(name="blocking", factory="tests.models_for_tests:blocking", example_input=example))
    until(lambda: any(isinstance(e, ModelReady) for e in events))
    cue = torch.zeros(1, 8)
    cue[0, 0] = m.BLOCK_CUE
    _, refs = tensors.pack([cue], "na-in")
    pool.submit(1, 0, "blocking", refs)
    workers = pool.snapshot()[0]
    blocked = next(w.pid for w in workers if w.request_id == 1)
    idle = next(w.pid for w in workers if w.pid != blocked)
    while not os.path.exists(os.path.join(block_dir, str(blocked))):
        threading.Event().wait(0.02)
    print("READY", blocked, idle, pool.weight_segment("blocking"), flush=True)
    threading.Event().wait(120)  # until killed


if __name__ == "__main__":
    main()
