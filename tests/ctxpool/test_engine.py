"""ctxpool.engine on real torch: swap-in equals the plain run, eviction, faults, and that it really pipelines."""

from __future__ import annotations

import copy
import gc
import itertools
import os
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ctxpool import hostmem, streams
from ctxpool.engine import BudgetError, CopyError, DeviceLost, Engine
from bench.switch import unique_tensors
from ctxpool.layout import Layout

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ------------------------------------------------------------------- models


class BnCnn(nn.Module):
    """Convs with BatchNorm whose running statistics are not the defaults (so buffers must travel)."""

    def __init__(self, seed: int = 0, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1, stride=2), nn.BatchNorm2d(4 * width), nn.ReLU())
        self.head = nn.Linear(4 * width * 4 * 4, 10)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.body(x), 1))


class TiedTransformer(nn.Module):
    """Embedding tied to the output projection, around stock encoder layers (whose eval fast path
    uses the attention weights without calling the submodules that own them)."""

    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.decoder = nn.Linear(dim, vocab, bias=False)
        self.decoder.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(self.embed(ids)))


class ContainerParam(nn.Module):
    """A bare parameter and a buffer on the model itself, and a layer reading a later sibling's weight."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.l1, self.l2, self.l3 = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.randn(dim))
        self.register_buffer("offset", torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h = self.l2(h) + F.linear(h, self.l3.weight)  # l3's weight is needed before l3 runs
        return self.l3(h) * self.scale + self.offset


class WideSiblings(nn.Module):
    """Big weights and little compute (copy-bound: a group per layer), with a sibling's weight used early."""

    def __init__(self, dim: int = 512, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        x = self.layers[1](x) + F.linear(x, self.layers[4].weight) * 1e-3
        for layer in self.layers[2:]:
            x = torch.tanh(layer(x))
        return x


class Deep(nn.Module):
    """Big layers with real compute: copies take milliseconds, so do the layers."""

    def __init__(self, dim: int = 2048, depth: int = 8) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.shape[0] == 3:
            raise RuntimeError("boom: batch of 3")
        return self.b(h)


def cases():
    return [
        ("cnn", BnCnn(), (torch.randn(2, 3, 16, 16),)),
        ("tied", TiedTransformer(), (torch.randint(0, 50, (2, 7)),)),
        ("container", ContainerParam(), (torch.randn(4, 16),)),
    ]


def plain(module: nn.Module, inputs: tuple):
    with torch.no_grad():
        return module.eval()(*inputs)


tensors_of = unique_tensors  # every parameter and buffer object once


@pytest.fixture
def engine():
    e = Engine("cpu")
    e.warm_up(pool_bytes=64 << 20)
    yield e
    e.close()


# ---------------------------------------------------------------- equality


@pytest.mark.parametrize("mode", ["pipelined", "sequential"])
def test_swap_in_output_equals_the_plain_run(engine, mode):
    for name, module, inputs in cases():
        expected = plain(module, inputs)
        engine.add_model(name, module, inputs)
        assert engine.resident() == [] or name not in engine.resident()  # not left resident
        out, stats = engine.infer(name, inputs, mode=mode)
        assert torch.equal(out, expected), name
        assert stats.swap == mode and stats.groups == len(engine.plan(name).groups)
        assert stats.swap_bytes >= engine.plan(name).model_bytes and stats.transfer_s > 0
        out, stats = engine.infer(name, inputs)
        assert stats.swap == "ready" and stats.swap_bytes == 0 and stats.transfer_s == 0
        assert torch.equal(out, expected), name


def test_evict_and_swap_again_gives_identical_outputs(engine):
    for name, module, inputs in cases():
        engine.add_model(name, module, inputs)
        first, _ = engine.infer(name, inputs)
        for mode in ("sequential", "pipelined", "pipelined"):
            engine.evict(name)
            assert name not in engine.resident()
            again, stats = engine.infer(name, inputs, mode=mode)
            assert stats.swap == mode and torch.equal(again, first), (name, mode)


def test_tied_weights_are_copied_once_and_stay_tied_on_the_device(engine):
    model = TiedTransformer()
    unique = sum(t.numel() * t.element_size() for t in tensors_of(model))
    host_ptr = model.embed.weight.data_ptr()
    plan = engine.add_model("tied", model, (torch.randint(0, 50, (2, 5)),))
    assert plan.model_bytes == unique
    engine.infer("tied", (torch.randint(0, 50, (2, 5)),))
    assert model.decoder.weight is model.embed.weight
    assert model.embed.weight.data_ptr() != host_ptr  # it is the device copy now
    engine.evict("tied")
    assert model.embed.weight.data_ptr() == host_ptr


def test_views_of_one_storage_stay_views_of_one_device_copy(engine):
    module = nn.Module()
    base = torch.randn(64)
    module.a = nn.Parameter(base)
    module.b = nn.Parameter(base[16:48].view(4, 8))
    module.forward = lambda x: (x * module.a[:4]).sum() + module.b.sum()
    plan = engine.add_model("views", module, (torch.randn(4),))
    assert plan.model_bytes == 64 * 4  # one atom: b lies inside a
    engine.infer("views", (torch.randn(4),))
    assert module.b.data_ptr() == module.a.data_ptr() + 16 * 4 and module.a.data_ptr() != base.data_ptr()


def test_ownership_puts_early_used_and_container_params_where_they_are_first_needed(engine):
    model = ContainerParam()
    plan = engine.add_model("container", model, (torch.randn(4, 16),))
    names = [layer.name for layer in plan.layers]
    assert names[:4] == ["", "l1", "l2", "l3"]
    by_name = {layer.name: layer.bytes for layer in plan.layers}
    w = 16 * 16 * 4
    assert by_name[""] == 2 * 16 * 4  # scale and offset: the model's own, needed from the start
    assert by_name["l2"] == w + 16 * 4 + w  # its own weight and bias, and l3.weight (used in l2's stretch)
    assert by_name["l3"] == 16 * 4  # only l3's bias is left to l3
    assert plan.groups[0][0] == 0


def test_pipelined_compute_never_reads_a_weight_before_its_group_arrived(monkeypatch):
    """Copy-bound on purpose (a group per layer, fresh pages): compute races ahead of the copy thread.
    Every tensor a torch function gets must be the device copy, never the host tensor."""
    engine = Engine("cpu")  # no pool: slower copies into fresh pages
    try:
        model = WideSiblings()
        x = torch.randn(1, 512)
        expected = plain(model, (x,))
        host_ptrs = {t.data_ptr() for t in tensors_of(model)}
        # Plan as copy-bound whatever this machine's speed: a measured bandwidth against compute
        # timed on a loaded core once planned 2 groups, and the race this test looks for needs many.
        engine.bytes_per_s = 1e7
        plan = engine.add_model("wide", model, (x,))
        assert len(plan.groups) >= 4
        used_host = []

        class Watch(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                for a in (*args, *(kwargs or {}).values()):
                    if isinstance(a, torch.Tensor) and a.data_ptr() in host_ptrs:
                        used_host.append(func.__name__)
                return func(*args, **(kwargs or {}))

        for _ in range(3):
            engine.evict("wide")
            with Watch():
                out, _ = engine.infer("wide", (x,), mode="pipelined")
            assert torch.equal(out, expected)
            assert used_host == []
    finally:
        engine.close()


def test_pipelined_swap_in_overlaps_copy_and_compute():
    """Fails if pipelining is removed: some group's copy must still run after compute started on an
    earlier group. Timestamps come from the engine (copy thread and compute hooks), not a threshold."""
    engine = Engine("cpu")  # fresh pages: each 16 MiB layer takes milliseconds to copy
    try:
        model = Deep()
        x = torch.randn(64, 2048)
        engine.add_model("deep", model, (x,))
        expected, _ = engine.infer("deep", (x,))
        overlapped = 0
        for _ in range(3):
            engine.evict("deep")
            out, stats = engine.infer("deep", (x,), mode="pipelined")
            assert torch.equal(out, expected)
            t = stats.timeline
            assert len(t) == stats.groups >= 2
            assert all(a.copy_end_s <= b.copy_start_s + 1e-9 for a, b in itertools.pairwise(t))  # copies in order
            assert all(g.copy_end_s <= g.compute_start_s + 1e-9 for g in t)  # compute waits for its group
            overlapped += any(t[k].compute_start_s < t[k + 1].copy_end_s and t[k + 1].copy_start_s < t[k].compute_end_s
                              for k in range(len(t) - 1))
            engine.evict("deep")
            out, stats = engine.infer("deep", (x,), mode="sequential")
            assert torch.equal(out, expected)
            assert max(g.copy_end_s for g in stats.timeline) <= min(g.compute_start_s for g in stats.timeline)
        assert overlapped >= 2, "copies never overlapped compute"
    finally:
        engine.close()


# ------------------------------------------------------- residency, memory


def test_lru_eviction_under_a_memory_budget():
    probe = Engine("cpu")
    size = probe.add_model("probe", BnCnn(0), (torch.randn(1, 3, 16, 16),)).device_bytes
    probe.close()
    engine = Engine("cpu", memory_budget_bytes=int(size * 2.5))
    try:
        x = (torch.randn(2, 3, 16, 16),)
        models = {n: BnCnn(seed) for seed, n in enumerate("abc")}
        expected = {n: plain(m, x) for n, m in models.items()}
        for n, m in models.items():
            engine.add_model(n, m, x)
        for n in "abc":
            out, stats = engine.infer(n, x)
            assert stats.swap == "pipelined" and torch.equal(out, expected[n])
        assert engine.resident() == ["b", "c"]  # a, least recently used, made room for c
        _, stats = engine.infer("b", x)
        assert stats.swap == "ready" and engine.resident() == ["c", "b"]
        out, stats = engine.infer("a", x)
        assert stats.swap == "pipelined" and torch.equal(out, expected["a"])
        assert engine.resident() == ["b", "a"]  # c went
        out, stats = engine.infer("c", x, mode="sequential")
        assert torch.equal(out, expected["c"]) and engine.resident() == ["a", "c"]
    finally:
        engine.close()


def test_a_model_bigger_than_the_budget_is_refused_at_registration():
    engine = Engine("cpu", memory_budget_bytes=1024)
    try:
        with pytest.raises(BudgetError, match="more than the engine's memory budget of 1024 bytes"):
            engine.add_model("big", BnCnn(), (torch.randn(1, 3, 16, 16),))
        with pytest.raises(KeyError):
            engine.plan("big")
    finally:
        engine.close()


def test_host_tensors_are_never_reallocated_or_written(engine):
    for name, module, inputs in cases():
        module.train()  # add_model serves in eval mode: BatchNorm must not update its statistics
        objs = tensors_of(module)
        hosts = [t.data for t in objs]  # aliases of the host memory
        ptrs = [t.data_ptr() for t in objs]
        before = [t.detach().clone() for t in objs]
        engine.add_model(name, module, inputs)
        assert not module.training
        for mode in ("pipelined", "sequential"):
            engine.infer(name, inputs, mode=mode)
            engine.infer(name, inputs)
            assert [h.data_ptr() for h in hosts] == ptrs
            assert all(torch.equal(h, b) for h, b in zip(hosts, before)), name
            engine.evict(name)
            assert [t.data_ptr() for t in objs] == ptrs
            assert all(torch.equal(t, b) for t, b in zip(objs, before)), name


def test_the_reserved_pool_serves_swap_ins_and_gets_its_memory_back(engine):
    arena = engine._backend.arena
    assert arena is not None and arena.in_use_bytes == 0
    model = BnCnn()
    plan = engine.add_model("cnn", model, (torch.randn(1, 3, 16, 16),))
    engine.infer("cnn", (torch.randn(1, 3, 16, 16),))
    assert arena.in_use_bytes >= plan.device_bytes
    lo, hi = arena.base_address, arena.base_address + arena.nbytes
    assert all(lo <= t.data_ptr() < hi for t in tensors_of(model))
    engine.evict("cnn")
    gc.collect()
    assert arena.in_use_bytes == 0


def test_warm_up_measures_the_copy_bandwidth():
    engine = Engine("cpu")
    try:
        took = engine.warm_up()
        assert took > 0 and engine.bytes_per_s > 1e8  # memmove manages far more than 100 MB/s
        plan = engine.add_model("cnn", BnCnn(), (torch.randn(1, 3, 16, 16),))
        assert plan.bytes_per_s == engine.bytes_per_s
        # Per layer the fastest of the timed runs, so at most the fastest whole forward.
        assert 0.2 * plan.forward_s < sum(layer.compute_s for layer in plan.layers) <= plan.forward_s * 1.001
    finally:
        engine.close()


# ------------------------------------------------------------------ faults


def test_an_exception_from_the_model_propagates_and_the_engine_stays_usable(engine):
    engine.add_model("fails", Fails(), (torch.randn(2, 8),))
    name, module, inputs = cases()[0]
    expected = plain(module, inputs)
    engine.add_model(name, module, inputs)
    for mode in ("pipelined", "sequential"):
        engine.evict("fails")
        with pytest.raises(RuntimeError, match="boom: batch of 3"):
            engine.infer("fails", (torch.randn(3, 8),), mode=mode)
        assert "fails" not in engine.resident() or mode == "sequential"
        out, _ = engine.infer(name, inputs, mode=mode)
        assert torch.equal(out, expected)
        out, _ = engine.infer("fails", (torch.randn(2, 8),))
        assert out.shape == (2, 8)
    with pytest.raises(RuntimeError, match="boom"):  # resident this time: the ready path
        engine.infer("fails", (torch.randn(3, 8),))
    assert engine.infer("fails", (torch.randn(2, 8),))[1].swap == "ready"


def test_a_failed_copy_raises_copy_error_and_leaves_the_model_on_the_host(engine, monkeypatch):
    module = Deep(dim=64, depth=6)
    x = torch.randn(2, 64)
    expected = plain(module, (x,))
    ptrs = [t.data_ptr() for t in tensors_of(module)]
    plan = engine.add_model("deep", module, (x,), first_group_bytes=1)
    assert len(plan.groups) >= 2
    real = streams.CpuBackend.copy_group
    calls = []

    def failing(self, spans, dev_buf):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("link down (injected)")
        return real(self, spans, dev_buf)

    monkeypatch.setattr(streams.CpuBackend, "copy_group", failing)
    with pytest.raises(CopyError, match=r"model 'deep'.*group 1 of .*link down \(injected\)"):
        engine.infer("deep", (x,))
    assert engine.resident() == []
    assert [t.data_ptr() for t in tensors_of(module)] == ptrs  # back on the host copy
    monkeypatch.setattr(streams.CpuBackend, "copy_group", real)
    out, stats = engine.infer("deep", (x,))
    assert stats.swap == "pipelined" and torch.equal(out, expected)


def test_a_model_that_cannot_run_its_example_is_refused_with_its_name(engine):
    with pytest.raises(ValueError, match=r"model 'cnn' cannot run its example inputs.*RuntimeError"):
        engine.add_model("cnn", BnCnn(), (torch.randn(2, 5, 16, 16),))  # 5 channels, not 3
    with pytest.raises(KeyError):
        engine.infer("cnn", (torch.randn(1, 3, 16, 16),))
    engine.add_model("cnn", BnCnn(), (torch.randn(1, 3, 16, 16),))  # the name is free again


def test_bad_calls_get_clear_errors(engine):
    with pytest.raises(KeyError, match="no model named 'nope'"):
        engine.infer("nope", ())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        engine.add_model("f", lambda x: x, (1,))
    engine.add_model("cnn", BnCnn(), (torch.randn(1, 3, 16, 16),))
    with pytest.raises(ValueError, match="already registered"):
        engine.add_model("cnn", BnCnn(), (torch.randn(1, 3, 16, 16),))
    with pytest.raises(ValueError, match="unknown swap mode"):
        engine.infer("cnn", (torch.randn(1, 3, 16, 16),), mode="eager")
    meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="'weight' is on meta"):
        engine.add_model("meta", meta, (torch.randn(1, 2),))
    with pytest.raises(ValueError, match="unknown backend"):
        Engine("tpu")
    engine.remove_model("cnn")
    with pytest.raises(KeyError):
        engine.plan("cnn")


def test_the_engine_refuses_a_second_call_while_one_runs(engine):
    engine.add_model("inner", BnCnn(), (torch.randn(1, 3, 16, 16),))

    class CallsBack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)
            self.armed = False

        def forward(self, x):
            if self.armed:
                engine.infer("inner", (torch.randn(1, 3, 16, 16),))
            return self.l(x)

    outer = CallsBack()
    engine.add_model("outer", outer, (torch.randn(1, 4),))
    outer.armed = True
    with pytest.raises(RuntimeError, match="single-threaded"):
        engine.infer("outer", (torch.randn(1, 4),))
    outer.armed = False
    assert engine.infer("inner", (torch.randn(1, 3, 16, 16),))[1].swap == "pipelined"


def test_remove_model_forgets_it_and_frees_its_device_copy(engine):
    module = BnCnn()
    ptrs = [t.data_ptr() for t in tensors_of(module)]
    engine.add_model("cnn", module, (torch.randn(1, 3, 16, 16),))
    engine.infer("cnn", (torch.randn(1, 3, 16, 16),))
    engine.remove_model("cnn")
    assert engine.resident() == [] and [t.data_ptr() for t in tensors_of(module)] == ptrs
    gc.collect()
    assert engine._backend.arena.in_use_bytes == 0


def test_a_copy_thread_that_cannot_start_is_reported_on_use(monkeypatch):
    def broken(self):
        raise OSError("no device context (injected)")

    monkeypatch.setattr(streams.CpuBackend, "thread_init", broken)
    engine = Engine("cpu")
    try:
        with pytest.raises(RuntimeError, match="copy thread is not running.*failed to start.*injected"):
            engine.add_model("cnn", BnCnn(), (torch.randn(1, 3, 16, 16),))
        with pytest.raises(KeyError):
            engine.plan("cnn")  # nothing registered
    finally:
        engine.close()


class FakeCudart:
    """cudaHostRegister/Unregister with CUDA's rule that a page is registered at most once."""

    class cudaError(int):
        pass

    def __init__(self, fail_call: int | None = None) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.fail_call = fail_call

    def cudaGetErrorString(self, error) -> str:
        return f"fake error {int(error)}"

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        if len(self.calls) == self.fail_call or any(p < ptr + n and ptr < p + s for p, s in self.registered.items()
                                                    for n in (size,)):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 713


def test_pin_registry_locks_each_page_once_and_unlocks_when_its_last_model_leaves():
    from ctxpool.hostmem import PinRegistry
    page = 4096
    rt = FakeCudart()
    pins = PinRegistry(rt)
    base = 0x100000
    assert pins.pin("a", [(base + 100, base + 5000), (base + 5000, base + 6000)]) == 2 * page
    assert pins.pin("b", [(base + page + 10, base + 3 * page)]) == page  # only the page a did not lock
    assert rt.registered == {base: 2 * page, base + 2 * page: page}
    assert pins.unpin("a") == 0  # b still uses a's second page, which lies in a's range
    assert pins.unpin("b") == 3 * page
    assert rt.registered == {} and pins.pinned_bytes() == 0


def test_pin_registry_keeps_ranges_locked_out_of_address_order_apart():
    from ctxpool.hostmem import PinRegistry
    page = 4096
    rt = FakeCudart()
    pins = PinRegistry(rt)
    base = 0x100000
    pins.pin("high", [(base + 4 * page, base + 5 * page)])
    pins.pin("low", [(base, base + page)])
    assert pins.pin("all", [(base, base + 5 * page)]) == 3 * page  # only the gap between them
    assert rt.registered == {base: page, base + page: 3 * page, base + 4 * page: page}


def test_pin_registry_failure_names_the_error_and_leaves_nothing_locked():
    from ctxpool.hostmem import PinRegistry
    rt = FakeCudart(fail_call=2)
    pins = PinRegistry(rt)
    with pytest.raises(RuntimeError, match=r"CUDA error 712 \(fake error 712\).*already page-locked"):
        pins.pin("a", [(0x100000, 0x101000), (0x200000, 0x201000)])
    assert rt.registered == {} and pins.pinned_bytes() == 0


def test_a_failed_register_clears_the_last_error_through_the_given_library():
    from ctxpool.hostmem import PinRegistry
    cleared = []
    pins = PinRegistry(FakeCudart(fail_call=1), clear_error=lambda: cleared.append(1))
    with pytest.raises(RuntimeError, match="CUDA error 712"):
        pins.pin("a", [(0x100000, 0x101000)])
    assert cleared == [1]


def test_loaded_library_finds_only_libraries_already_loaded():
    libc = hostmem.loaded_library("libc.so", ("libc.so.6",))
    assert libc is not None and hasattr(libc, "getpid")
    assert hostmem.loaded_library("libnodeagent-none.so", ("libnodeagent-none.so.1",)) is None
    if not torch.cuda.is_available():  # a cpu torch never loads libcudart, and the lookup must not either
        assert hostmem._torch_cudart() is None
        with open("/proc/self/maps") as maps:
            assert "libcudart" not in maps.read()


# ------------------------------------------------- cuda ordering, on fake streams


class FakeEvent:
    def __init__(self, log: list, name: str, t: float | None = None) -> None:
        self.log, self.name, self.t = log, name, time.perf_counter() if t is None else t

    def synchronize(self) -> None:
        self.log.append(f"{self.name}.synchronize")

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.t - self.t) * 1000.0


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(f"{self.name}.wait_stream({other.name})")

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name}.wait_event({event.name})")

    def synchronize(self) -> None:
        self.log.append(f"{self.name}.synchronize")


class LoggingCudart(FakeCudart):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def cudaHostUnregister(self, ptr: int) -> int:
        self.log.append("unregister")
        return super().cudaHostUnregister(ptr)


class RecordingCuda(streams.CudaBackend):
    """The cuda backend's ordering code (order_after_compute, wait_copied, block_until_copied, synchronize,
    unpin) on fake streams and events that log every call; bytes move as on the cpu backend."""

    def __init__(self) -> None:  # no super().__init__: it needs a GPU
        self.log: list[str] = []
        self.device = torch.device("cpu")
        self.copy_stream = FakeStream(self.log, "copy")
        self.compute = FakeStream(self.log, "compute")
        self.pins = hostmem.PinRegistry(LoggingCudart(self.log), clear_error=lambda: self.log.append("clear"))
        self._private = {}
        self.cpu = streams.CpuBackend()
        self.sync_error: BaseException | None = None
        # The caching allocator, as bytes: reserved from the device, allocated to live tensors.
        self.reserved_bytes, self.allocated_bytes = 0, 0

    def _reserved_bytes(self) -> int:
        return self.reserved_bytes

    def _allocated_bytes(self) -> int:
        return self.allocated_bytes

    def _empty_cache(self) -> None:
        self.log.append("empty_cache")
        self.reserved_bytes = self.allocated_bytes

    def _compute_stream(self) -> FakeStream:
        return self.compute

    def thread_init(self) -> None:
        pass

    def reserve(self, pool_bytes: int) -> None:
        self.log.append(f"reserve({pool_bytes})")
        self.reserved_bytes += max(0, pool_bytes)
        self.cpu.reserve(pool_bytes)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """As the caching allocator counts: allocated while the buffer lives, reserved grows to fit."""
        buf = self.cpu.alloc(nbytes)
        self.allocated_bytes += nbytes
        self.reserved_bytes = max(self.reserved_bytes, self.allocated_bytes)
        weakref.finalize(buf, self._freed, nbytes)
        return buf

    def _freed(self, nbytes: int) -> None:
        self.allocated_bytes -= nbytes

    def prepare(self, dev_buf: torch.Tensor) -> None:
        pass

    def copy_group(self, spans, dev_buf):
        start, end = self.cpu.copy_group(spans, dev_buf)
        self.log.append("copy")
        return FakeEvent(self.log, "copied", start), FakeEvent(self.log, "copied", end)

    def mark(self) -> FakeEvent:
        return FakeEvent(self.log, "mark")

    def synchronize_device(self) -> None:
        self.log.append("device.synchronize")
        if self.sync_error is not None:
            raise self.sync_error

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def warm_up_compute(self) -> None:
        pass

    def measure_bytes_per_s(self) -> float:
        return 1e9


class Logged(nn.Module):
    """Deep enough for several groups; logs each forward; raises on a batch of 3 (on cue: ``error``)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        self.log = log
        self.error: BaseException = RuntimeError("boom: batch of 3")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append("forward")
        h = self.layers[0](x)
        if x.shape[0] == 3:
            raise self.error
        return self.layers[1:](h)


def _registered(backend: RecordingCuda) -> list[tuple[int, int]]:
    return sorted((ptr, ptr + size) for ptr, size in backend.pins._cudart.registered.items())


def _overlaps(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(lo < end and start < hi for lo, hi in ranges)


def test_heap_weights_move_to_pages_of_their_own_before_they_are_page_locked():
    """CUDA fails a copy whose source runs past the end of a registered range (cudaErrorInvalidValue:
    the first GPU run, where the example input shared the weights' last heap page). So no page that
    may hold another allocation is ever registered: heap storages move first, keeping identity."""
    backend = RecordingCuda()
    engine = Engine(backend)
    try:
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64))
        model[2].weight = model[0].weight  # tied: one storage, moved once, still shared
        model.register_buffer("head", model[0].bias.detach()[:8])  # a view of a parameter's storage
        x = torch.randn(4, 64)
        expected = plain(copy.deepcopy(model), (x,))
        objs = tensors_of(model)
        old_ptrs = {t.untyped_storage().data_ptr() for t in objs}
        neighbour = torch.randn(4, 64)  # allocated right after: shares the weights' heap pages
        engine.add_model("m", model, (neighbour,))
        assert tensors_of(model) == objs and model[2].weight is model[0].weight
        assert model.head.untyped_storage().data_ptr() == model[0].bias.untyped_storage().data_ptr()
        assert not old_ptrs & {t.untyped_storage().data_ptr() for t in objs}
        region = backend._private["m"]
        registered = _registered(backend)
        assert registered and all(region.start <= lo and hi <= region.end for lo, hi in registered)
        assert sum(hi - lo for lo, hi in registered) == region.end - region.start  # the region, once
        n = neighbour.untyped_storage()
        assert not _overlaps(registered, n.data_ptr(), n.data_ptr() + n.nbytes())
        out, _ = engine.infer("m", (x,), mode="pipelined")
        assert torch.equal(out, expected)
        engine.remove_model("m")
        assert not backend.pins._cudart.registered and "m" not in backend._private
        assert torch.equal(plain(model, (x,)), expected)  # the module still works on its moved memory
    finally:
        engine.close()


def test_weights_in_a_shared_memory_segment_are_page_locked_where_they_are():
    """The model store's segment is a file mapping: its pages hold only its bytes, so zero-copy stays."""
    from client_lib import tensors as shm_tensors
    from ctxpool import store
    name = f"na-test-pin-{os.getpid()}"
    manifest = store.place_in_shared_memory(BnCnn(), None, name)
    backend = RecordingCuda()
    engine = Engine(backend)
    try:
        module = BnCnn()
        segment = store.attach_module(module, manifest)
        ptrs = [t.data_ptr() for t in tensors_of(module)]
        engine.add_model("cnn", module, (torch.randn(1, 3, 16, 16),))
        assert [t.data_ptr() for t in tensors_of(module)] == ptrs and not backend._private
        files = hostmem.file_backed_mappings()
        assert all(hostmem.inside(files, lo, hi) for lo, hi in _registered(backend))
        engine.remove_model("cnn")
        segment.close()
    finally:
        engine.close()
        shm_tensors.unlink_segment(name)


def test_file_backed_mappings_and_inside(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("1000-3000 rw-s 00000000 00:1a 7 /dev/shm/na-w\n"
                    "3000-4000 r--p 00000000 08:01 9 /opt/m.safetensors\n"
                    "5000-9000 rw-p 00000000 00:00 0 [heap]\n"
                    "9000-a000 rw-p 00000000 00:00 0 \n")
    files = hostmem.file_backed_mappings(str(maps))
    assert files == [(0x1000, 0x4000)]
    assert hostmem.inside(files, 0x1000, 0x4000) and hostmem.inside(files, 0x2000, 0x3000)
    assert not hostmem.inside(files, 0x3000, 0x5000) and not hostmem.inside(files, 0x5000, 0x6000)
    assert hostmem.file_backed_mappings(str(tmp_path / "absent")) == []


def _after(log: list, since: int) -> list:
    return log[since:]


def test_each_swap_in_orders_the_copy_stream_after_compute_and_sequential_blocks_the_cpu():
    backend = RecordingCuda()
    engine = Engine(backend)
    try:
        model = Logged(backend.log)
        x = torch.randn(2, 64)
        expected = plain(copy.deepcopy(model), (x,))
        plan = engine.add_model("m", model, (x,), first_group_bytes=1)
        groups = len(plan.groups)
        assert groups >= 2
        for mode in ("sequential", "pipelined"):
            engine.evict("m")
            since = len(backend.log)
            out, _ = engine.infer("m", (x,), mode=mode)
            assert torch.equal(out, expected)
            log = _after(backend.log, since)
            first_copy = log.index("copy")
            assert log.index("copy.wait_stream(compute)") < first_copy  # before any copy is issued
            assert log.count("copy") == groups and log.count("compute.wait_event(copied)") == groups
            if mode == "sequential":  # the CPU waits for the last copy before it launches compute
                assert log.index("copied.synchronize") < log.index("forward")
                assert max(i for i, e in enumerate(log) if e == "copy") < log.index("forward")
            else:
                assert "copied.synchronize" not in log
            assert "device.synchronize" not in log  # nothing failed
    finally:
        engine.close()


def test_cached_memory_goes_back_beyond_the_pool_only_when_asked_and_only_when_there_is_some():
    backend = RecordingCuda()
    backend.reserved_bytes, backend.allocated_bytes = 10_000, 2_000
    assert backend.release_cached(keep_bytes=4_000) == 6_000  # emptied, then the pool topped up again
    assert backend.log == ["empty_cache", "reserve(2000)"] and backend.reserved_bytes == 4_000
    backend.log.clear()
    backend.reserved_bytes = 6_000  # 4,000 cached unused: no more than the pool
    assert backend.release_cached(keep_bytes=4_000) == 0 and backend.log == []
    assert streams.CpuBackend().release_cached(keep_bytes=0) == 0


def test_a_model_that_leaves_gives_its_cached_device_memory_back_after_the_request():
    """Eviction frees a buffer into the caching allocator, which keeps it for this process alone (the
    first multi-model load on a GPU ran out of memory that way). The engine hands it back to the device,
    never inside a request: when the caller says it is between requests, and at remove/evict."""
    backend = RecordingCuda()
    big, small = Deep(dim=256, depth=4), Logged(backend.log)
    xb, xs = (torch.randn(2, 256),), (torch.randn(2, 64),)
    probe = Engine(RecordingCuda())
    big_bytes = probe.add_model("big", copy.deepcopy(big), xb).device_bytes
    small_bytes = probe.add_model("small", Logged([]), xs).device_bytes
    probe.close()
    # One model resident at a time. Placement pads spans to 512 bytes depending on where the
    # host tensors lie, so a copy's size may differ by a few such pads: half the small model's size
    # of slack, far more than that and less than both models together.
    engine = Engine(backend, memory_budget_bytes=big_bytes + small_bytes // 2)
    try:
        engine.warm_up(pool_bytes=0)
        engine.add_model("big", big, xb)
        engine.add_model("small", small, xs)
        gc.collect()
        engine.release_cached()  # the registrations' profiling copies went: given back now
        engine.infer("big", xb)
        assert engine.release_cached() == 0  # nothing left the device
        since = len(backend.log)
        engine.infer("small", xs)  # evicts big to make room
        assert engine.resident() == ["small"] and "empty_cache" not in _after(backend.log, since)
        gc.collect()
        assert engine.release_cached() >= engine.plan("big").device_bytes - engine.plan("small").device_bytes
        assert _after(backend.log, since).count("empty_cache") == 1
        assert backend.reserved_bytes == backend.allocated_bytes  # no pool to keep
        assert engine.release_cached() == 0  # once per departure
        engine.infer("big", xb)
        gc.collect()
        since = len(backend.log)
        engine.remove_model("small")  # was evicted already: nothing cached for it
        engine.remove_model("big")  # resident: its buffer goes back at once
        assert _after(backend.log, since).count("empty_cache") == 1 and backend.allocated_bytes == 0
    finally:
        engine.close()


def test_the_pool_reserved_at_warm_up_is_kept_when_cached_memory_goes_back():
    backend = RecordingCuda()
    engine = Engine(backend)
    try:
        engine.warm_up(pool_bytes=1 << 20)
        module = Logged(backend.log)
        engine.add_model("m", module, (torch.randn(2, 64),))
        engine.infer("m", (torch.randn(2, 64),))
        backend.reserved_bytes += 4 << 20  # activations and evicted models, cached
        gc.collect()
        engine.evict("m")
        gc.collect()
        engine.release_cached()  # evict gave it back already: nothing more
        assert backend.reserved_bytes == 1 << 20 and "empty_cache" in backend.log
    finally:
        engine.close()


def test_a_failed_forward_synchronizes_the_device_before_anything_else_runs():
    backend = RecordingCuda()
    engine = Engine(backend)
    try:
        model = Logged(backend.log)
        engine.add_model("m", model, (torch.randn(2, 64),))
        for mode in ("pipelined", "sequential"):
            engine.evict("m")
            since = len(backend.log)
            with pytest.raises(RuntimeError, match="boom"):
                engine.infer("m", (torch.randn(3, 64),), mode=mode)
            log = _after(backend.log, since)
            assert log[-1] == "device.synchronize" and log.index("forward") < len(log) - 1
        since = len(backend.log)
        engine.infer("m", (torch.randn(2, 64),))  # resident after the sequential failure: the ready path
        with pytest.raises(RuntimeError, match="boom"):
            engine.infer("m", (torch.randn(3, 64),))
        assert _after(backend.log, since)[-1] == "device.synchronize"
        assert engine.lost is None and engine.infer("m", (torch.randn(2, 64),))[1].swap == "ready"
    finally:
        engine.close()


def test_an_error_while_synchronizing_after_a_failure_means_the_context_is_lost():
    backend = RecordingCuda()
    engine = Engine(backend)
    try:
        model = Logged(backend.log)
        engine.add_model("m", model, (torch.randn(2, 64),))
        engine.add_model("other", BnCnn(), (torch.randn(1, 3, 16, 16),))
        backend.sync_error = RuntimeError("CUDA error: an illegal memory access was encountered")
        model.error = ValueError("a shape error, harmless in itself")  # the words say nothing fatal
        with pytest.raises(DeviceLost, match="lost.*illegal memory access") as info:
            engine.infer("m", (torch.randn(3, 64),))
        assert info.value.__cause__ is backend.sync_error
        assert isinstance(info.value.__cause__.__context__, ValueError)  # the first error stays in the chain
        since = len(backend.log)
        with pytest.raises(DeviceLost, match="lost earlier"):  # every later call, and nothing reaches the device
            engine.infer("other", (torch.randn(1, 3, 16, 16),))
        with pytest.raises(DeviceLost):
            engine.add_model("third", BnCnn(), (torch.randn(1, 3, 16, 16),))
        assert _after(backend.log, since) == []
    finally:
        engine.close()


@pytest.mark.parametrize("words", ["CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb)`",
                                   "CUDA error: unknown error", "CUDA error: uncorrectable ECC error encountered"])
def test_a_sticky_error_is_fatal_even_when_the_synchronize_passes(words):
    backend = RecordingCuda()
    engine = Engine(backend)
    try:
        model = Logged(backend.log)
        engine.add_model("m", model, (torch.randn(2, 64),))
        model.error = RuntimeError(words)
        with pytest.raises(DeviceLost):
            engine.infer("m", (torch.randn(3, 64),))
        assert engine.lost is not None and words.split()[0] in engine.lost
    finally:
        engine.close()


def test_a_failed_registration_unregisters_host_memory_only_after_the_copy_stream_is_idle():
    backend = RecordingCuda()
    engine = Engine(backend)
    try:
        with pytest.raises(ValueError, match="cannot run its example"):
            engine.add_model("cnn", BnCnn(), (torch.randn(2, 5, 16, 16),))  # 5 channels, not 3
        log = backend.log
        assert "unregister" in log and "device.synchronize" in log
        assert log.index("copy.synchronize") < log.index("unregister")
        assert backend.pins.pinned_bytes() == 0
        model = BnCnn()
        engine.add_model("cnn", model, (torch.randn(1, 3, 16, 16),))
        since = len(log)
        engine.remove_model("cnn")
        after = _after(log, since)
        assert after.index("copy.synchronize") < after.index("unregister")
    finally:
        engine.close()


# ------------------------------------------------------------ device alignment


class Packed(nn.Module):
    """Linear layers whose weights are views into one host buffer, ``stride_bytes`` apart."""

    def __init__(self, stride_bytes: int, count: int = 6, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(6)
        step = stride_bytes // 4
        self.base = torch.zeros(step * count + 1024)
        self.layers = nn.ModuleList()
        for i in range(count):
            layer = nn.Linear(dim, dim, bias=False)
            view = self.base[i * step:i * step + dim * dim].view(dim, dim)
            view.copy_(layer.weight.detach())
            layer.weight = nn.Parameter(view, requires_grad=False)
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("stride_bytes", [320, 512, 1024])
def test_every_atom_starts_512_byte_aligned_on_the_device(stride_bytes):
    model = Packed(stride_bytes)
    layout = Layout(model)
    assert len(layout.atoms) == 6
    placement = layout.place([0] * len(layout.atoms), 1)
    assert all(off % 512 == 0 for off in placement.atom_dev_offset), placement.atom_dev_offset
    spans = placement.group_spans[0]
    # neighbours a multiple of 512 bytes apart are still copied as one span; others each on their own
    assert len(spans) == (1 if stride_bytes % 512 == 0 else 6)
    engine = Engine("cpu")
    try:
        x = torch.randn(2, 8)
        expected = plain(model, (x,))
        engine.warm_up(pool_bytes=1 << 20)
        engine.add_model("packed", model, (x,))
        out, _ = engine.infer("packed", (x,))
        assert torch.equal(out, expected)
        assert all(layer.weight.data_ptr() % 512 == 0 for layer in model.layers)
    finally:
        engine.close()


# --------------------------------------------------------------------- GPU


@pytest.fixture
def deterministic_cuda():
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic = False


def close_under_tf32(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to what TF32 matmuls and convolutions (on by default for cuDNN) and kernels chosen
    differently may change: about 1e-3 relative per layer, here with room to spare."""
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-2,
                                                 atol=1e-2 * max(1.0, float(b.abs().max())))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["pipelined", "sequential"])
def test_cuda_swap_in_matches_the_engines_ready_output_and_a_plain_cuda_copy(deterministic_cuda, mode):
    """Bitwise only where the same kernels run: a sequential swap-in and the ready run have no hooks and the
    same placement; a pipelined one has forward pre-hooks, which switch off the fused transformer path.
    Against a plain .cuda() copy (other addresses, other kernels) the outputs agree within TF32 error."""
    engine = Engine("cuda", 0)
    try:
        engine.warm_up(pool_bytes=64 << 20)
        for name, module, inputs in cases():
            reference = copy.deepcopy(module).eval().cuda()
            plain_cuda = plain(reference, tuple(t.cuda() for t in inputs))
            engine.add_model(name, module, inputs)
            swapped, stats = engine.infer(name, inputs, mode=mode)
            assert swapped.device.type == "cuda" and stats.swap == mode
            ready, stats = engine.infer(name, inputs)
            assert stats.swap == "ready"
            assert all(t.data_ptr() % 512 == 0 for t in tensors_of(module)), name  # as the allocator aligns
            if mode == "sequential" or name != "tied":
                assert torch.equal(swapped, ready), name
            assert close_under_tf32(swapped, ready) and close_under_tf32(ready, plain_cuda), name
            engine.evict(name)
            again, _ = engine.infer(name, inputs, mode=mode)
            assert torch.equal(again, swapped), name  # the same mode, the same placement: the same kernels
            if name == "tied":
                assert module.decoder.weight is module.embed.weight and module.embed.weight.is_cuda
    finally:
        engine.close()


@pytest.mark.gpu
@cuda
def test_cuda_an_evicted_model_gives_its_device_memory_back_between_requests():
    probe = Engine("cuda", 0)
    big_bytes = probe.add_model("big", Deep(), (torch.randn(2, 2048),)).device_bytes
    probe.close()
    engine = Engine("cuda", 0, memory_budget_bytes=big_bytes)  # one of the two resident at a time
    try:
        engine.warm_up(pool_bytes=0)
        engine.add_model("big", Deep(), (torch.randn(2, 2048),))
        engine.add_model("small", BnCnn(), (torch.randn(1, 3, 16, 16),))
        engine.release_cached()
        engine.infer("big", (torch.randn(2, 2048),))
        engine.infer("small", (torch.randn(1, 3, 16, 16),))  # evicts big
        before = torch.cuda.memory_reserved(0)
        released = engine.release_cached()
        assert released == before - torch.cuda.memory_reserved(0) and released >= big_bytes // 2
        engine.remove_model("small")
        assert torch.cuda.memory_allocated(0) < big_bytes // 2
    finally:
        engine.close()


@pytest.mark.gpu
@cuda
def test_cuda_a_failed_register_leaves_no_error_for_torchs_next_launch():
    """A refused cudaHostRegister sets the calling thread's last error in libcudart; it must be cleared in
    the library torch uses, or torch's next kernel-launch check reports it as that kernel's error."""
    torch.ones(1, device="cuda").sum().item()  # torch has loaded its libcudart now
    assert hostmem._torch_cudart() is not None
    host = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()  # page-locked by torch already
    pins = hostmem.PinRegistry()
    with pytest.raises(RuntimeError, match="CUDA error"):
        pins.pin("twice", [(host.data_ptr(), host.data_ptr() + host.numel())])
    x = torch.randn(64, device="cuda").relu_()  # a launch, checked with cudaGetLastError
    torch.cuda.synchronize()
    assert x.min() >= 0 and pins.pinned_bytes() == 0


_DEVICE_ASSERT_CHILD = r"""
import sys, torch
from ctxpool.device_errors import is_fatal
from ctxpool.engine import DeviceLost, Engine

class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
    def forward(self, ids):
        return self.emb(ids) * 2

engine = Engine("cuda", 0)
engine.add_model("lookup", Lookup(), (torch.tensor([[1, 2]]),))
print("ok", float(engine.infer("lookup", (torch.tensor([[3, 4]]),))[0].sum()), flush=True)
try:
    engine.infer("lookup", (torch.tensor([[1, 10**6]]),))  # out of range: a device-side assert
    print("no error", flush=True)
except DeviceLost as exc:
    print("lost", is_fatal(exc), str(exc).splitlines()[0], flush=True)
except Exception as exc:
    print("other", type(exc).__name__, is_fatal(exc), str(exc).splitlines()[0], flush=True)
try:
    engine.infer("lookup", (torch.tensor([[3, 4]]),))
    print("later: served", flush=True)
except DeviceLost:
    print("later: lost", flush=True)
"""


@pytest.mark.gpu
@cuda
def test_cuda_a_device_side_assert_loses_the_engine_for_good():
    """In a child process (a device-side assert kills its CUDA context): the engine's synchronise after
    the failure turns it into DeviceLost, and every later call refuses."""
    import subprocess
    import sys

    from tests.conftest import REPO
    run = subprocess.run([sys.executable, "-c", _DEVICE_ASSERT_CHILD], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    lines = run.stdout.splitlines()
    assert lines and lines[0].startswith("ok"), run.stdout + run.stderr[-3000:]
    assert lines[1].startswith("lost True"), run.stdout + run.stderr[-3000:]
    assert lines[2] == "later: lost", run.stdout


@pytest.mark.gpu
@cuda
def test_cuda_pins_host_memory_on_pages_of_its_own_and_unpins_on_remove():
    """The first GPU run: weights on heap pages were registered in place, and the example input,
    allocated next, shared their last page; its .to("cuda") then failed (cudaErrorInvalidValue,
    a copy straddling a registration's end). Now heap weights move first, keeping identity."""
    engine = Engine("cuda", 0)
    try:
        module = BnCnn()
        objs = tensors_of(module)
        values = [t.detach().clone() for t in objs]
        neighbour = torch.randn(1, 3, 16, 16)  # allocated right after the weights, like a request's input
        assert not any(t.is_pinned() for t in objs)
        engine.add_model("cnn", module, (neighbour,))
        assert tensors_of(module) == objs  # the same Parameter and buffer objects
        assert all(t.is_pinned() for t in objs) and all(torch.equal(t, v) for t, v in zip(objs, values))
        assert not neighbour.is_pinned()
        assert neighbour.to("cuda").cpu().equal(neighbour)
        out, _ = engine.infer("cnn", (torch.randn(1, 3, 16, 16),))
        assert out.is_cuda
        engine.remove_model("cnn")
        assert not any(t.is_pinned() for t in objs) and all(torch.equal(t, v) for t, v in zip(objs, values))
    finally:
        engine.close()


@pytest.mark.gpu
@cuda
def test_cuda_pins_a_stored_models_shared_memory_in_place(tmp_path):
    """Weights in the model store's segment (a file mapping) are page-locked where they are: no copy."""
    from client_lib import tensors as shm_tensors
    from ctxpool import store
    module = BnCnn()
    manifest = store.place_in_shared_memory(module, None, f"na-test-pin-{os.getpid()}")
    attached = BnCnn()
    segment = store.attach_module(attached, manifest)
    engine = Engine("cuda", 0)
    try:
        ptrs = [t.data_ptr() for t in tensors_of(attached)]
        engine.add_model("cnn", attached, (torch.randn(1, 3, 16, 16),))
        assert [t.data_ptr() for t in tensors_of(attached)] == ptrs
        assert all(t.is_pinned() for t in tensors_of(attached))
        engine.remove_model("cnn")
    finally:
        engine.close()
        segment.close()
        shm_tensors.unlink_segment(manifest.segment)


@pytest.mark.gpu
@cuda
def test_cuda_copies_run_on_a_copy_stream_with_an_event_per_group_and_overlap_compute():
    engine = Engine("cuda", 0)
    try:
        engine.warm_up(pool_bytes=512 << 20)
        model = Deep(dim=4096, depth=8)  # 64 MiB per layer
        x = torch.randn(512, 4096)
        plan = engine.add_model("deep", model, (x,))
        expected, _ = engine.infer("deep", (x,))
        engine.evict("deep")
        out, stats = engine.infer("deep", (x,), mode="pipelined")
        assert torch.equal(out, expected)
        t = stats.timeline  # from CUDA events: copy stream and compute stream
        assert stats.groups == len(plan.groups) >= 2 and len(t) == stats.groups
        assert all(g.copy_end_s <= g.compute_start_s + 1e-4 for g in t)
        assert any(t[k].compute_start_s < t[k + 1].copy_end_s for k in range(len(t) - 1)), t
        assert stats.transfer_s > 0
        efficiency = plan.model_bytes / engine.bytes_per_s / stats.transfer_s
        assert 0.3 < efficiency <= 1.2
        engine.evict("deep")
        out, stats = engine.infer("deep", (x,), mode="sequential")
        assert torch.equal(out, expected)
        t = stats.timeline  # no compute before the last copy finished
        assert max(g.copy_end_s for g in t) <= min(g.compute_start_s for g in t) + 1e-4
    finally:
        engine.close()
