"""A ctxpool worker process: one warm :class:`ctxpool.engine.Engine` on one device, driven over a
pipe (:mod:`ctxpool.messages`), started by :class:`ctxpool.pool.WorkerPool` with ``spawn``.
Detail: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Mapping, Sequence

from client_lib import protocol as p
from client_lib import tensors
from ctxpool import messages as msg
from ctxpool.device_errors import is_fatal

log = logging.getLogger("ctxpool.worker")

FAULT_ENV = "NODEAGENT_CTXPOOL_TEST_FAULT"
OUTPUT_PREFIX = "na-out"
_PR_SET_PDEATHSIG = 1


class WorkerFatal(Exception):
    """The worker cannot go on (its device context is lost); it exits after Dying."""


def worker_main(conn: Connection, backend: str, device_index: int, pool_bytes: int,
                memory_budget_bytes: int | None, extra_sys_path: Sequence[str], output_group: int | None,
                env: Mapping[str, str], ordinal: int) -> None:
    """Process entry point. ``device_index`` is the daemon's name for the device; ``env`` is set
    before anything can start CUDA, and the engine then uses CUDA device ``ordinal``.
    Exit status: 0 after Shutdown or when the daemon is gone, 1 on an error."""
    os.environ.update(env)  # first: nothing below may have started CUDA yet
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s")
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the daemon decides
    faults = {f.strip() for f in os.environ.get(FAULT_ENV, "").split(",") if f.strip()}
    if "ignore-sigterm" in faults:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.path[:0] = [path for path in extra_sys_path if path not in sys.path]
    code = 1
    try:
        worker = _Worker(conn, backend, device_index, pool_bytes, memory_budget_bytes, output_group, faults, ordinal)
        code = worker.serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("[worker] daemon end of the pipe closed: exit")
        code = 0
    except BaseException as exc:  # noqa: BLE001 - the last word goes to the daemon, then we exit
        reason = f"{type(exc).__name__}: {exc}"
        log.error("[worker] dying device=%d reason=%s", device_index, reason, exc_info=True)
        with contextlib.suppress(OSError):
            conn.send_bytes(msg.encode(msg.Dying(reason=reason)))
    finally:
        conn.close()
    os._exit(code)  # skip atexit and finalizers: nothing of ours needs them, and a wedged one would hang


def _die_with_parent() -> None:
    """SIGKILL this process when the daemon's thread that spawned it exits (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("[worker] prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError):
        log.warning("[worker] no prctl: the worker relies on its pipe closing to notice a dead daemon")
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the daemon died before prctl took effect
        os._exit(0)


class _Worker:
    def __init__(self, conn: Connection, backend: str, device_index: int, pool_bytes: int,
                 memory_budget_bytes: int | None, output_group: int | None, faults: set[str],
                 ordinal: int) -> None:
        if "fail-start" in faults:
            raise RuntimeError(f"{FAULT_ENV}=fail-start: failing before Ready on cue")
        from ctxpool.engine import Engine  # torch and the engine load in the worker only

        self.conn = conn
        self.device_index = device_index
        self.output_group = output_group
        self.faults = faults
        self.segments: dict[str, tensors.Segment] = {}  # attached model -> the mapping of its weights
        self.engine = Engine(backend, device_index=ordinal, memory_budget_bytes=memory_budget_bytes)
        warm_up_s = self.engine.warm_up(pool_bytes)
        self._send(msg.Ready(pid=os.getpid(), warm_up_ms=warm_up_s * 1000.0))
        log.info("[worker] ready backend=%s device=%d on=%s CUDA_VISIBLE_DEVICES=%s budget_bytes=%s warm_up_ms=%.1f",
                 backend, device_index, self.engine.device, os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
                 memory_budget_bytes, warm_up_s * 1000.0)

    def _send(self, reply: msg.FromWorkerMessage) -> None:
        self.conn.send_bytes(msg.encode(reply))

    def serve(self) -> int:
        answer = {msg.Run: self._run, msg.Prepare: self._prepare, msg.Attach: self._attach, msg.Drop: self._drop}
        while True:
            request = msg.decode_to_worker(self.conn.recv_bytes())  # malformed: a bug, die with Dying
            if isinstance(request, msg.Shutdown):
                if "ignore-shutdown" in self.faults:
                    log.warning("[worker] ignoring Shutdown on cue (%s)", FAULT_ENV)
                    continue
                log.info("[worker] shutdown device=%d", self.device_index)
                self.engine.close()  # unpins host memory, stops the copy thread
                return 0
            self._send(answer[type(request)](request))  # every other ToWorkerMessage has its handler
            self._release_cached()  # after the reply, so that no request waits for it

    def _release_cached(self) -> None:
        """Give back the device memory of models this worker evicted (their cached blocks)."""
        try:
            self.engine.release_cached()
        except Exception as exc:  # DeviceLost: the synchronise after the failure found the context dead
            if is_fatal(exc):
                raise WorkerFatal(f"device context lost: {exc}") from exc
            log.warning("[worker] releasing cached device memory failed: %s: %s", type(exc).__name__, exc)

    # ------------------------------------------------------------ models

    def _prepare(self, request: msg.Prepare) -> msg.FromWorkerMessage:
        from ctxpool import store

        try:
            module = store.build_module(request.factory)
            state = None
            if request.weights is not None:
                state = store.load_weights(request.weights, reader=request.reader)  # the peer's rights
                store.check_weights(module, state, source=f"weights {request.weights}")
            manifest = store.place_in_shared_memory(module, state, request.segment, group=request.segment_group)
        except store.ModelError as exc:
            return msg.Rejected(model=request.model, step="prepare", code=exc.code, message=exc.message)
        except Exception as exc:  # shared memory full, out of host memory, ...
            return msg.Rejected(model=request.model, step="prepare", code=p.ErrorCode.MODEL,
                                message=f"preparing {request.model!r} failed: {type(exc).__name__}: {exc}")
        log.info("[worker] prepared model=%s bytes=%d segment=%s", request.model, manifest.total_bytes,
                 manifest.segment)
        return msg.Prepared(model=request.model, manifest=manifest, model_bytes=store.model_bytes(manifest),
                            layers=store.leaf_layers(module))

    def _attach(self, request: msg.Attach) -> msg.FromWorkerMessage:
        from ctxpool import store
        from ctxpool.engine import BudgetError

        def rejected(code: str, message: str) -> msg.Rejected:
            return msg.Rejected(model=request.model, step="attach", code=code, message=message)

        if request.model in self.segments:
            return rejected(p.ErrorCode.INTERNAL, f"model {request.model!r} is already attached to this worker")
        segment = None
        try:
            module = store.build_module(request.factory)
            segment = store.attach_module(module, request.manifest)
            example = tuple(tensors.take(request.example_input, unlink=False))  # private copies: the engine keeps them
            plan = self.engine.add_model(request.model, module, example)
        except Exception as exc:
            if segment is not None:
                segment.close()
            if isinstance(exc, store.ModelError):
                return rejected(exc.code, exc.message)
            if isinstance(exc, BudgetError):
                return rejected(p.ErrorCode.NO_MEMORY, f"{exc} (each worker's ctxpool.resident_mb); nothing was "
                                                       "registered")
            if isinstance(exc, tensors.TensorTransportError):
                return rejected(p.ErrorCode.MODEL, f"example input of {request.model!r}: {exc}")
            # The engine could not run the example (ValueError), or the model raised.
            reply = rejected(p.ErrorCode.MODEL, f"model {request.model!r} does not run its example input: "
                                                f"{type(exc).__name__}: {exc}")
            if is_fatal(exc):  # the engine synchronised after the failure: DeviceLost if the context died
                self._send(reply)
                raise WorkerFatal(f"device context lost: {exc}") from exc
            return reply
        self.segments[request.model] = segment
        log.info("[worker] attached model=%s layers=%d groups=%d", request.model, len(plan.layers), len(plan.groups))
        return msg.Attached(model=request.model, model_bytes=plan.model_bytes, layers=len(plan.layers),
                            groups=len(plan.groups), resident=list(self.engine.resident()))

    def _drop(self, request: msg.Drop) -> msg.Dropped:
        name = request.model
        segment = self.segments.pop(name, None)
        with contextlib.suppress(KeyError):  # the engine never added it
            self.engine.remove_model(name)
        if segment is not None:
            gc.collect()  # the module's views must go before the mapping can
            segment.close()
        log.info("[worker] dropped model=%s", name)
        return msg.Dropped(model=name)

    # ------------------------------------------------------------ requests

    def _run(self, request: msg.Run) -> msg.FromWorkerMessage:
        started = time.perf_counter()

        def failed(code: str, message: str) -> msg.Failed:
            return msg.Failed(request_id=request.request_id, code=code, message=message)

        if request.model not in self.segments:
            return failed(p.ErrorCode.NO_MODEL, f"model {request.model!r} is not attached to worker {os.getpid()}")
        try:  # only the requester's own segments, checked on the opened fd
            segments = tensors.attach_all(request.inputs,
                                          owner_uid=None if request.any_inputs else request.owner_uid)
        except tensors.SegmentAccessError as exc:
            return failed(p.ErrorCode.FORBIDDEN, f"inputs: {exc}")
        except tensors.TensorTransportError as exc:
            return failed(p.ErrorCode.INVALID, f"inputs: {exc}")
        try:
            try:
                inputs = tuple(tensors.views(request.inputs, segments))
            except tensors.TensorTransportError as exc:
                return failed(p.ErrorCode.INVALID, f"inputs: {exc}")
            try:
                outputs, stats = self.engine.infer(request.model, inputs)
            except Exception as exc:
                reply = failed(p.ErrorCode.INFERENCE, f"model {request.model!r} raised {type(exc).__name__}: {exc}")
                if is_fatal(exc):  # DeviceLost from the engine's synchronise, or a sticky error's words
                    self._send(reply)
                    raise WorkerFatal(f"device context lost: {exc}") from exc
                return reply
            flat = _flatten(outputs)
            if flat is None:
                return failed(p.ErrorCode.INFERENCE, f"model {request.model!r} returned a {type(outputs).__name__}; "
                                                     "expected a tensor or a tuple/list of tensors")
            single = len(flat) == 1 and flat[0] is outputs  # a bare tensor, not a 1-tuple
            try:
                # Owned by the requester, who unlinks it once read (the daemon does if it never is).
                # Reserved: a full /dev/shm is E_INFERENCE naming the size, not a SIGBUS of this worker.
                segment, refs = tensors.pack(flat, OUTPUT_PREFIX, group=self.output_group, owner=request.owner_uid,
                                             reserve=True)
            except (tensors.TensorTransportError, OSError) as exc:
                return failed(p.ErrorCode.INFERENCE, f"outputs of {request.model!r} cannot be returned: {exc}")
            if segment is not None:
                segment.close()  # the receiver owns it now
            del inputs, outputs, flat
        finally:
            for seg in segments.values():
                seg.close()
        return msg.Done(request_id=request.request_id, outputs=refs, swap=stats.swap,
                        run_ms=(time.perf_counter() - started) * 1000.0, resident=list(self.engine.resident()),
                        single=single)


def _flatten(outputs: Any) -> list | None:
    import torch

    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in outputs):
        return list(outputs)
    return None
