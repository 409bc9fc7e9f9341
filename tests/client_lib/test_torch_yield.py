"""client_lib.torch: park a model and its optimizer in host memory and bring
them back so that training goes on bit for bit; directly, through a real
daemon's suspend/resume, and from the Lightning and Hugging Face callbacks."""

from __future__ import annotations

import ctypes
import gc
import importlib
import mmap
import os
import sys
import threading
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")

from client_lib import Client, resume_session, suspend_session  # noqa: E402
import client_lib.torch as tctx  # noqa: E402
from client_lib.torch import AlreadyParkedError, HostBuffer, NotParkedError, ParkError, Yielder  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.models_for_tests import Net

STEPS = 12
PARK_AT = 5  # park after this many steps
OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ------------------------------------------------------------------ helpers


def make(opt_name: str, device: str = "cpu"):
    torch.manual_seed(0)
    model = Net().to(device)
    return model, OPTIMIZERS[opt_name](model.parameters())


def batches(device: str = "cpu", steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 3, 8, 8, generator=g).to(device), torch.randint(0, 10, (16,), generator=g).to(device))
            for _ in range(steps)]


def step(model, opt, batch) -> float:
    x, y = batch
    opt.zero_grad(set_to_none=False)  # grads stay allocated between steps: they get parked too
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def train(opt_name: str, device: str = "cpu", between=None) -> tuple[list[float], dict]:
    """Losses of STEPS steps; ``between(model, opt, i)`` runs after step i."""
    model, opt = make(opt_name, device)
    losses = []
    for i, batch in enumerate(batches(device)):
        losses.append(step(model, opt, batch))
        if between is not None:
            between(model, opt, i)
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def state_tensors(model, opt) -> list:
    """Every tensor the Yielder must park, found independently of it."""
    found = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    found += list(model.buffers())
    for per_param in opt.state.values():
        found += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return found


def state_bytes(model, opt) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state_tensors(model, opt)}
    return sum(storages.values())


# ------------------------------------------------------------ park directly


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_training_is_bit_identical_across_a_park(opt_name):
    straight, straight_state = train(opt_name)
    parked_sizes = []

    def park_once(model, opt, i):
        if i == PARK_AT:
            yielder = Yielder(modules=[model], optimizers=[opt])
            yielder.park()
            parked_sizes.append([p.numel() for p in model.parameters()])
            yielder.unpark()

    with_park, parked_state = train(opt_name, between=park_once)
    assert parked_sizes and all(n == 0 for n in parked_sizes[0])  # the park really emptied them
    assert with_park == straight
    for key, value in straight_state.items():
        assert torch.equal(parked_state[key], value), key


def test_park_empties_the_state_and_unpark_restores_the_same_objects():
    model, opt = make("adam")
    for batch in batches(steps=2):
        step(model, opt, batch)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    opt_tensors = [v for s in opt.state.values() for v in s.values()]
    before = {id(t): t.detach().clone() for t in state_tensors(model, opt)}
    expected_bytes = state_bytes(model, opt)
    storages = [t.untyped_storage() for t in state_tensors(model, opt)]

    yielder = Yielder(modules=[model], optimizers=[opt])
    assert yielder.park() == expected_bytes == yielder.bytes_parked
    assert yielder.parked
    assert all(t.numel() == 0 for t in state_tensors(model, opt))
    assert all(s.nbytes() == 0 for s in storages)  # the memory itself is gone, not just hidden
    with pytest.raises(RuntimeError):
        model(torch.randn(1, 3, 8, 8))  # a mistaken use fails cleanly instead of reading freed memory

    yielder.unpark()
    assert not yielder.parked
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(a is b for a, b in zip((v for s in opt.state.values() for v in s.values()), opt_tensors))
    for t in state_tensors(model, opt):
        assert torch.equal(t, before[id(t)])
    assert all(s.nbytes() > 0 for s in storages)  # the same storages hold the state again
    assert all(p.requires_grad and p.is_leaf for p in params)


def test_host_buffer_is_allocated_once_and_reused():
    model, opt = make("sgd-momentum")
    yielder = Yielder(modules=[model], optimizers=[opt])
    data = batches()
    step(model, opt, data[0])
    yielder.park()
    first = yielder.host_buffer.data_ptr()
    yielder.unpark()
    step(model, opt, data[1])
    yielder.park()
    assert yielder.host_buffer.data_ptr() == first
    yielder.unpark()


def test_host_buffer_can_be_reserved_before_the_first_park():
    model, opt = make("sgd-momentum")
    step(model, opt, batches()[0])
    yielder = Yielder(modules=[model], optimizers=[opt])
    reserved = yielder.reserve()
    ptr = yielder.host_buffer.data_ptr()
    assert reserved >= state_bytes(model, opt)
    yielder.park()
    assert yielder.host_buffer.data_ptr() == ptr
    yielder.unpark()


def test_state_created_after_the_first_park_is_parked_too():
    model, opt = make("adam")
    yielder = Yielder(modules=[model], optimizers=[opt])
    params_only = yielder.park()  # no grads, no Adam state yet
    yielder.unpark()
    step(model, opt, batches()[0])
    expected = state_bytes(model, opt)
    assert yielder.park() == expected > params_only
    assert all(v.numel() == 0 for s in opt.state.values() for v in s.values())
    yielder.unpark()


def _rss_bytes() -> int:
    """Resident size, after giving freed heap pages back: in a long test process
    glibc's mmap threshold has grown past 64 MiB, so a freed storage may sit in
    the heap rather than be unmapped (malloc_trim returns it, where glibc has it)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_park_gives_the_memory_back_on_the_cpu_backend():
    layer = torch.nn.Linear(4096, 4096, bias=False)  # 64 MiB
    yielder = Yielder(modules=[layer])
    yielder.reserve()  # the host buffer is resident before we measure
    before = _rss_bytes()
    assert yielder.park() == 64 << 20
    assert _rss_bytes() <= before - (48 << 20)
    yielder.unpark()
    assert _rss_bytes() >= before - (8 << 20)


def test_a_second_park_is_refused_and_changes_nothing():
    model, opt = make("sgd-momentum")
    yielder = Yielder(modules=[model], optimizers=[opt])
    parked = yielder.park()
    with pytest.raises(AlreadyParkedError):
        yielder.park()
    assert yielder.parked and yielder.bytes_parked == parked
    yielder.unpark()
    assert all(p.numel() > 0 for p in model.parameters())


def test_unpark_without_park_is_a_clear_error():
    model, opt = make("sgd-momentum")
    yielder = Yielder(modules=[model], optimizers=[opt])
    with pytest.raises(NotParkedError, match="needs a park"):
        yielder.unpark()
    yielder.park()
    yielder.unpark()
    with pytest.raises(NotParkedError):
        yielder.unpark()


def test_shared_storage_is_parked_once_and_views_stay_shared():
    flat = torch.arange(10, dtype=torch.float32)
    a = torch.nn.Parameter(flat[:4])
    b = torch.nn.Parameter(flat[4:])
    outside_view = flat[2:6]  # a view the Yielder does not know about
    yielder = Yielder()
    yielder.register_state(lambda: {"a": a, "nested": [b, "not a tensor"]})
    assert yielder.park() == 10 * 4
    assert a.numel() == b.numel() == 0
    yielder.unpark()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == outside_view.untyped_storage().data_ptr()
    assert torch.equal(a.detach(), torch.arange(4.0)) and torch.equal(b.detach(), torch.arange(4.0, 10.0))
    assert torch.equal(outside_view, torch.arange(2.0, 6.0))  # sees the restored memory, not a stale copy
    with torch.no_grad():
        a[3] = 100.0
    assert outside_view[1] == 100.0


def test_register_state_takes_tensors_and_rejects_anything_else():
    ema = {"w": torch.ones(256)}
    yielder = Yielder()
    yielder.register_state(ema["w"])
    assert yielder.park() == 256 * 4 and ema["w"].numel() == 0
    yielder.unpark()
    assert torch.equal(ema["w"], torch.ones(256))
    with pytest.raises(TypeError, match="register_state takes"):
        yielder.register_state({"w": torch.ones(1)})  # a dict: pass a callable returning it instead


@pytest.mark.parametrize("kind", ["foreign", "shared"])
def test_a_storage_that_cannot_be_freed_is_refused_before_anything_changes(kind):
    model, _ = make("sgd-momentum")
    if kind == "foreign":
        odd = torch.frombuffer(bytearray(64), dtype=torch.float32)  # memory torch does not own
    else:
        odd = torch.ones(16).share_memory_()  # would come back private, unseen by the other processes
    yielder = Yielder(modules=[model])
    yielder.register_state(odd)
    with pytest.raises(ParkError, match="not resizable"):
        yielder.park()
    assert not yielder.parked and all(p.numel() > 0 for p in model.parameters()) and odd.numel() == 16


def test_importing_the_torch_helpers_is_what_imports_torch():
    import subprocess
    code = ("import sys, client_lib, client_lib.integrations; assert 'torch' not in sys.modules; "
            "import client_lib.torch; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------- through a daemon


class Trainer(threading.Thread):
    """The plain loop in a thread, as a training job would run it: a Client, a
    Yielder, ``yield_point()`` after every step. At step ``wait_at`` it waits
    for the daemon's suspend notice before its yield point, so the suspend
    lands there whatever the timing."""

    def __init__(self, endpoint: str, opt_name: str, wait_at: int = PARK_AT) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.opt_name, self.wait_at = endpoint, opt_name, wait_at
        self.connected = threading.Event()
        self.waiting = threading.Event()
        self.losses: list[float] = []
        self.yielded: list[bool] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.model, self.opt = make(self.opt_name)
            self.client = Client("torch-yield-test", workload="training", endpoint=self.endpoint)
            self.yielder = Yielder(self.client, modules=[self.model], optimizers=[self.opt])
            self.connected.set()
            with self.client.slice():
                for i, batch in enumerate(batches()):
                    self.losses.append(step(self.model, self.opt, batch))
                    if i == self.wait_at:
                        self.expected_bytes = state_bytes(self.model, self.opt)
                        self.waiting.set()
                        wait_for(lambda: self.client.suspend_requested, timeout=10)
                    self.yielded.append(self.client.yield_point())
            self.client.close()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.connected.set()
            self.waiting.set()


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_suspend_and_resume_through_the_daemon_keep_training_bit_identical(daemon, opt_name):
    straight, _ = train(opt_name)
    trainer = Trainer(daemon.endpoint, opt_name)
    trainer.start()
    assert trainer.waiting.wait(30) and trainer.error is None, trainer.error

    result = suspend_session(trainer.client.session_id, deadline_ms=5000, endpoint=daemon.endpoint)
    assert result.outcome == "suspended", result
    assert result.bytes_parked == trainer.expected_bytes
    assert result.suspend_ms > 0 and result.elapsed_ms >= result.suspend_ms
    assert trainer.yielder.parked and all(p.numel() == 0 for p in trainer.model.parameters())
    session = next(s for d in daemon.status().devices for s in d.sessions if s.id == trainer.client.session_id)
    assert session.suspended == "suspended" and session.bytes_parked == trainer.expected_bytes

    resume_session(trainer.client.session_id, endpoint=daemon.endpoint)
    trainer.join(30)
    assert not trainer.is_alive() and trainer.error is None, trainer.error
    assert trainer.yielded[PARK_AT] is True and not any(trainer.yielded[PARK_AT + 1:])
    bytes_parked, suspend_ms, resume_ms = trainer.client.last_suspend
    assert bytes_parked == trainer.expected_bytes and resume_ms > 0
    assert trainer.losses == straight


# ------------------------------------------------------------- integrations


class ScriptedClient:
    """Stands in for :class:`Client` where the callbacks use it: on yield point
    number ``suspend_at`` it runs the suspend handlers as a suspend notice would."""

    def __init__(self, suspend_at: int) -> None:
        self.suspend_at = suspend_at
        self.yield_points = 0
        self.parked_numel: list[int] = []
        self.slices = 0
        self._park = self._unpark = None
        self.holding = False

    def set_suspend_handlers(self, park, unpark) -> None:
        self._park, self._unpark = park, unpark

    def yield_point(self) -> bool:
        self.yield_points += 1
        if self.yield_points != self.suspend_at or self._park is None:
            return False
        param_bytes = sum(p.numel() * p.element_size() for p in self.model_params)
        self.bytes_parked = self._park()
        self.parked_numel.append(sum(p.numel() for p in self.model_params))
        # Parameters plus Adam's exp_avg and exp_avg_sq at least: the optimizer was parked too.
        self.optimizer_parked = self.bytes_parked >= 3 * param_bytes
        self._unpark()
        return True

    @contextmanager
    def slice(self):
        self.slices += 1
        self.holding = True
        try:
            yield 1
        finally:
            self.holding = False


def test_integrations_raise_a_clear_import_error_without_their_framework(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    for module, hint in (("client_lib.integrations.lightning", "pip install lightning"),
                         ("client_lib.integrations.huggingface", "pip install transformers")):
        monkeypatch.delitem(sys.modules, module, raising=False)
        with pytest.raises(ImportError, match=hint):
            importlib.import_module(module)


def _lightning():
    try:
        return importlib.import_module("lightning.pytorch")
    except ImportError:
        return pytest.importorskip("pytorch_lightning")


def test_lightning_callback_yields_each_batch_and_parks_bit_identically():
    pl = _lightning()
    from client_lib.integrations.lightning import NodeAgentCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    def fit(callbacks, client=None):
        torch.manual_seed(0)
        module = Module()
        module.losses = []
        if client is not None:
            client.model_params = list(module.parameters())
        trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, torch.utils.data.DataLoader(batches(), batch_size=None))
        return module

    straight = fit([])
    client = ScriptedClient(suspend_at=PARK_AT)
    with_suspend = fit([NodeAgentCallback(client)], client)
    assert client.yield_points == STEPS and client.slices == 1 and not client.holding
    assert client.parked_numel == [0] and client.optimizer_parked
    assert with_suspend.losses == straight.losses
    for a, b in zip(straight.parameters(), with_suspend.parameters()):
        assert torch.equal(a, b)


def test_huggingface_callback_yields_each_step_and_parks_bit_identically(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from client_lib.integrations.huggingface import NodeAgentTrainerCallback

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}

    data = [{"x": x[i], "labels": y[i]} for x, y in batches() for i in range(4)]

    def train_hf(callbacks, client=None):
        torch.manual_seed(0)
        model = Model()
        if client is not None:
            client.model_params = list(model.parameters())
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        out = trainer.train()
        return model, out.training_loss

    straight, straight_loss = train_hf([])
    client = ScriptedClient(suspend_at=PARK_AT)
    suspended, suspended_loss = train_hf([NodeAgentTrainerCallback(client)], client)
    assert client.yield_points == STEPS and client.slices == 1 and not client.holding
    assert client.parked_numel == [0] and client.optimizer_parked
    assert suspended_loss == straight_loss
    for a, b in zip(straight.parameters(), suspended.parameters()):
        assert torch.equal(a, b)


# ------------------------------------------------ host buffer, CUDA paths on cpu


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records page-locking, fails on cue."""

    def __init__(self, fail_with: int = 0) -> None:
        self.fail_with = fail_with
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        if self.fail_with:
            return self.fail_with
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 712  # not registered

    def cudaGetErrorString(self, rc: int) -> str:
        return f"fake error {rc}"


PAGE = mmap.PAGESIZE


def pinned_yielder(model, opt, cudart, cleared=None):
    buffer = HostBuffer(cudart=cudart, clear_error=lambda: cleared.append(True) or True if cleared is not None else True)
    return Yielder(modules=[model], optimizers=[opt], pin_memory=True, host_buffer=buffer)


def assert_exact_size(buffer, model, opt) -> None:
    """The state, each storage starting 512-aligned: no power-of-two rounding, no slack."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state_tensors(model, opt)}
    need = sum(storages.values())
    assert need <= buffer.numel() < need + 512 * len(storages)


def test_a_pinned_host_buffer_is_reserved_at_construction_exactly_sized_and_page_aligned():
    model, opt = make("sgd-momentum")
    step(model, opt, batches()[0])  # grads and momentum exist: nothing grows later
    cudart = FakeCudart()
    yielder = pinned_yielder(model, opt, cudart)
    assert yielder.host_buffer is not None
    assert_exact_size(yielder.host_buffer, model, opt)
    need = yielder.host_buffer.numel()
    [(kind, ptr, size)] = cudart.calls  # pinned once, before any park
    assert kind == "register" and ptr == yielder.host_buffer.data_ptr() and ptr % PAGE == 0
    assert size == (need + PAGE - 1) // PAGE * PAGE
    yielder.park()
    yielder.unpark()
    assert len(cudart.calls) == 1  # the suspend did not pin anything


def test_adam_state_from_the_first_step_grows_the_buffer_then_and_the_old_one_goes_first():
    model, opt = make("adam")
    cudart = FakeCudart()
    yielder = pinned_yielder(model, opt, cudart)
    params_only = yielder.host_buffer.numel()
    first_ptr = yielder.host_buffer.data_ptr()
    step(model, opt, batches()[0])  # Adam makes its moments in its first step
    assert_exact_size(yielder.host_buffer, model, opt)
    assert yielder.host_buffer.numel() > params_only
    assert [c[0] for c in cudart.calls] == ["register", "unregister", "register"]
    assert cudart.calls[1] == ("unregister", first_ptr) and len(cudart.registered) == 1
    calls = len(cudart.calls)
    reserves = []
    yielder.reserve = lambda: reserves.append(1)  # what the hook would do again, were it still there
    step(model, opt, batches()[1])  # the hook was for the first step only
    assert reserves == []
    yielder.park()
    yielder.unpark()
    assert len(cudart.calls) == calls


def test_state_that_grows_later_grows_the_buffer_at_the_park_and_says_so(caplog):
    model, opt = make("sgd-momentum")
    step(model, opt, batches()[0])
    cudart = FakeCudart()
    yielder = pinned_yielder(model, opt, cudart)
    extra = torch.ones(4096)
    yielder.register_state(extra)
    with caplog.at_level("WARNING", logger="client_lib.torch"):
        yielder.park()
    assert "call Yielder.reserve()" in caplog.text
    assert [c[0] for c in cudart.calls] == ["register", "unregister", "register"]
    yielder.unpark()
    assert torch.equal(extra, torch.ones(4096))


def test_a_failed_pinning_parks_in_pageable_memory_and_clears_the_cuda_error(caplog):
    model, opt = make("sgd-momentum")
    data = batches()
    step(model, opt, data[0])
    cleared: list = []
    cudart = FakeCudart(fail_with=2)
    with caplog.at_level("WARNING", logger="client_lib.torch"):
        yielder = pinned_yielder(model, opt, cudart, cleared)
    assert cleared == [True] and "ulimit -l" in caplog.text and "fake error 2" in caplog.text
    before = [t.clone() for t in state_tensors(model, opt)]
    yielder.park()
    yielder.unpark()
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(model, opt), before))
    assert len(cudart.calls) == 1  # not tried again at every park, inside its deadline


def test_releasing_the_host_buffer_unregisters_it():
    cudart = FakeCudart()
    buffer = HostBuffer(cudart=cudart, clear_error=lambda: True)
    ptr = buffer.ensure(10_000, pin=True).data_ptr()
    assert buffer.pinned
    buffer.release()
    assert cudart.calls[-1] == ("unregister", ptr) and not cudart.registered and buffer.tensor is None
    assert not buffer.pinned
    buffer.ensure(10_000, pin=True)
    del buffer
    gc.collect()
    assert not cudart.registered  # garbage-collected: unregistered too


def test_clearing_a_cuda_error_finds_the_runtime_torch_loaded(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /opt/py/nvidia/cu13/lib/libcudart.so.13\n")
    assert tctx._mapped_library("libcudart.so", str(maps)) == "/opt/py/nvidia/cu13/lib/libcudart.so.13"
    assert tctx._mapped_library("libcudart.so") is None  # this process has no CUDA runtime
    assert tctx._clear_cuda_error() is False  # and clearing says it could not


def test_releasing_cuda_memory_clears_cublas_workspaces_before_emptying_the_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    tctx._release_cached("cuda")
    assert calls == ["workspaces", "empty_cache"]


def test_bytes_parked_is_what_the_allocator_gave_back_not_the_state_size(monkeypatch):
    model, opt = make("sgd-momentum")
    step(model, opt, batches()[0])
    reserved = iter([10 << 20, 7 << 20])  # before the park, after it (a device that can say)
    monkeypatch.setattr(tctx, "_reserved_bytes", lambda device: next(reserved))
    yielder = Yielder(modules=[model], optimizers=[opt])
    expected_copied = state_bytes(model, opt)
    assert yielder.park() == yielder.bytes_parked == 3 << 20
    assert yielder.bytes_copied == expected_copied
    yielder.unpark()


class Wrapper(torch.Tensor):
    """A wrapper subclass, as DTensor is: its own storage holds nothing."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_a_wrapper_tensor_subclass_is_refused_naming_it_before_anything_changes():
    model, opt = make("sgd-momentum")
    holder = torch.nn.Module()
    holder.register_buffer("wrapped", Wrapper(torch.ones(3)))
    yielder = Yielder(modules=[model, holder], optimizers=[opt])
    with pytest.raises(ParkError, match=r"modules\[1\]\.wrapped \(Wrapper of shape \(3,\)"):
        yielder.park()
    assert not yielder.parked and all(p.numel() > 0 for p in model.parameters())


def test_a_dtensor_is_refused_with_a_park_error():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch without torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer = torch.nn.Linear(4, 4)
        distribute_module(layer, init_device_mesh("cpu", (1,)))
        with pytest.raises(ParkError, match=r"modules\[0\]\.weight \(DTensor"):
            Yielder(modules=[layer]).park()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------- GPU


@pytest.mark.gpu
@cuda
def test_park_frees_device_memory_on_cuda():
    model, opt = make("adam", "cuda")
    big = torch.nn.Linear(4096, 4096, device="cuda")  # 64 MiB, so the drop is unmistakable
    yielder = Yielder(modules=[model, big], optimizers=[opt], keep_addresses=False)  # the in-place path
    assert yielder.host_buffer is not None and yielder.host_buffer.is_pinned()  # reserved before any park
    for batch in batches("cuda", steps=2):
        step(model, opt, batch)
    big(torch.randn(64, 4096, device="cuda")).sum().item()  # cuBLAS makes its workspace
    torch.cuda.synchronize()
    on_gpu = [t for t in state_tensors(model, opt) + list(big.parameters()) if t.is_cuda]  # Adam's step stays
    state = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in on_gpu}.values())
    assert state <= yielder.host_buffer.numel() < state + 512 * 64  # grown after Adam's first step, exactly
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    free_before, _ = torch.cuda.mem_get_info()
    slack = 16 << 20  # blocks of parked tensors that share a cached segment with live ones
    parked = yielder.park()
    assert yielder.bytes_copied >= 64 << 20 and parked >= yielder.bytes_copied - slack
    assert all(p.numel() == 0 for p in big.parameters())
    assert torch.cuda.memory_allocated() <= allocated - yielder.bytes_copied
    assert torch.cuda.memory_reserved() == reserved - parked  # what bytes_parked counts, exactly
    assert torch.cuda.mem_get_info()[0] >= free_before + parked - slack  # free for other processes
    yielder.unpark()
    assert torch.cuda.memory_allocated() <= allocated


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_training_is_bit_identical_across_a_park_on_cuda(opt_name):
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    straight, straight_state = train(opt_name, "cuda")
    if train(opt_name, "cuda")[0] != straight:
        pytest.skip("two identical runs already differ on this GPU: nothing to compare a park against")

    def park_once(model, opt, i):
        if i == PARK_AT:
            yielder = Yielder(modules=[model], optimizers=[opt])
            yielder.park()
            yielder.unpark()

    with_park, parked_state = train(opt_name, "cuda", between=park_once)
    assert with_park == straight
    for key, value in straight_state.items():
        assert torch.equal(parked_state[key], value), key


def test_the_yielder_reports_the_host_memory_it_keeps_for_the_next_park():
    """What the daemon counts (suspended.host_bytes): the host buffer the state is parked in,
    kept after the unpark so the next park allocates nothing."""
    from client_lib.torch import Yielder

    class Recorder:
        def set_suspend_handlers(self, park, unpark, held=None):
            self.park, self.unpark, self.held = park, unpark, held

    client = Recorder()
    model = torch.nn.Linear(64, 64)
    Yielder(client, modules=[model])
    assert client.held() == (0, False)  # nothing parked yet: nothing kept
    parked = client.park()
    kept, pinned = client.held()
    assert kept >= parked > 0 and pinned is False  # on cpu nothing is page-locked
    client.unpark()
    assert client.held() == (kept, False)  # kept for the next park
