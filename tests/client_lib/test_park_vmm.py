"""Parking with device addresses kept (client_lib.vmm, Yielder(keep_addresses=...)).

On cpu the region logic runs over host memory arranged as CUDA's virtual memory
management arranges device memory (HostVmm: a reserved range of addresses,
physical memory mapped at it and unmapped again, garbage in fresh memory, a
fault on touching an unmapped range). The gpu tests run the real driver: 1 GiB
parked and back at >= 20 GiB/s, a CUDA graph and a reduce-overhead compiled
model replaying bit for bit after another process filled the freed memory.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time

import pytest

torch = pytest.importorskip("torch")

from client_lib import vmm  # noqa: E402
from client_lib.torch import KeepAddressesError, RestoreVerifyError, Yielder  # noqa: E402
from client_lib.vmm import DriverError, Region, block_sums  # noqa: E402
from tests.host_vmm import HostVmm, fill_freed_memory_from_another_process  # noqa: E402
from tests.models_for_tests import Net  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# ----------------------------------------------------------- host regions


# ------------------------------------------------------------------ helpers


def make(device="cpu"):
    torch.manual_seed(0)
    model = Net().to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batches(steps, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 3, 8, 8, generator=g).to(device), torch.randint(0, 10, (16,), generator=g).to(device))
            for _ in range(steps)]


def step(model, opt, batch, set_to_none=False) -> float:
    x, y = batch
    opt.zero_grad(set_to_none=set_to_none)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def state_tensors(model, opt) -> list:
    found = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    found += list(model.buffers())
    for per_param in opt.state.values():
        found += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return found


def addresses(model, opt) -> list[int]:
    return [t.data_ptr() for t in state_tensors(model, opt)]


# --------------------------------------------------------------------- cpu


def test_the_driver_structs_are_laid_out_as_cuda_h_lays_them_out():
    assert ctypes.sizeof(vmm.CUmemLocation) == 8
    assert ctypes.sizeof(vmm.CUmemAllocationProp) == 32
    assert [getattr(vmm.CUmemAllocationProp, f).offset for f in
            ("type", "requestedHandleTypes", "location", "win32HandleMetaData", "allocFlags")] == [0, 4, 8, 16, 24]
    assert ctypes.sizeof(vmm.CUmemAccessDesc) == 12 and vmm.CUmemAccessDesc.flags.offset == 8


def test_on_cpu_the_same_api_runs_and_says_there_is_no_address_to_keep():
    model, opt = make()
    for batch in batches(2):
        step(model, opt, batch)
    before = [t.clone() for t in state_tensors(model, opt)]
    yielder = Yielder(modules=[model], optimizers=[opt])  # keep_addresses="auto"
    assert not yielder.keeps_addresses and "no device address to keep" in yielder.address_note
    assert yielder.park() > 0
    yielder.unpark()
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(model, opt), before))
    with pytest.raises(KeepAddressesError, match="keep_addresses=True, but the state is on cpu, where there is no "
                                                 "device address to keep"):
        Yielder(modules=[model], optimizers=[opt], keep_addresses=True)
    with pytest.raises(ValueError, match="keep_addresses"):
        Yielder(modules=[model], keep_addresses="yes")


def test_training_is_bit_identical_and_no_address_changes_after_the_first_step():
    straight_model, straight_opt = make()
    straight = [step(straight_model, straight_opt, b) for b in batches(8)]

    host = HostVmm()
    model, opt = make()
    yielder = Yielder(modules=[model], optimizers=[opt], keep_addresses=True, vmm=host)
    assert yielder.keeps_addresses and yielder.address_note is None
    losses, seen = [], None
    for i, batch in enumerate(batches(8)):
        losses.append(step(model, opt, batch))
        if i == 0:
            seen = addresses(model, opt)  # Adam's state and the gradients moved in after the first step
            assert all(host.region_at(t.untyped_storage().data_ptr()) for t in state_tensors(model, opt))
        if i in (2, 5):
            parked = yielder.park()
            assert yielder.parked and not host.handles  # every region's physical memory given back
            assert parked == yielder.bytes_parked == sum(r.nbytes for r in host.regions.values())
            yielder.unpark()
            assert addresses(model, opt) == seen
    assert losses == straight
    for a, b in zip(model.state_dict().values(), straight_model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_park_unmaps_each_region_and_an_unpark_maps_fresh_memory_at_the_same_addresses():
    host = HostVmm()
    model, opt = make()
    for batch in batches(1):
        step(model, opt, batch)
    yielder = Yielder(modules=[model], optimizers=[opt], vmm=host)
    regions = list(host.regions.values())
    assert len(regions) == 2 and sorted(r.used_bytes > 0 for r in regions) == [True, True]  # gradients apart
    host.calls.clear()
    yielder.park()
    assert host.calls.count("unmap") == host.calls.count("release") == 2 and "free" not in host.calls
    assert set(host.reserved) == {r.va for r in regions} and not host.handles
    assert all(p.numel() == 0 for p in model.parameters())  # touching one is a shape error, not a fault
    host.calls.clear()
    yielder.unpark()
    assert [c for c in host.calls if c != "synchronize"] == ["create", "map", "set_access"] * 2
    assert all(r.mapped for r in regions) and set(host.reserved) == {r.va for r in regions}
    assert yielder.verify_ms > 0 and yielder.checksum_ms > 0


def test_state_registered_later_moves_into_a_region_once_then_keeps_its_address():
    host = HostVmm()
    model, opt = make()
    yielder = Yielder(modules=[model], optimizers=[opt], vmm=host)
    cache = torch.arange(5000, dtype=torch.float32)  # a KV cache, say
    yielder.register_state(cache)
    first = cache.data_ptr()
    yielder.park()
    assert cache.numel() == 0
    yielder.unpark()
    moved = cache.data_ptr()
    assert moved != first and host.region_at(cache.untyped_storage().data_ptr()) is not None
    assert torch.equal(cache, torch.arange(5000, dtype=torch.float32))
    yielder.park()
    yielder.unpark()
    assert cache.data_ptr() == moved


def test_gradients_set_to_none_each_step_leave_no_region_behind():
    host = HostVmm()
    model, opt = make()
    yielder = Yielder(modules=[model], optimizers=[opt], vmm=host)
    for i, batch in enumerate(batches(6)):
        step(model, opt, batch, set_to_none=True)
        if i % 2:
            yielder.park()
            yielder.unpark()
    gc.collect()
    # The model's region, Adam's, and the gradients' of the last unpark; dead ones freed, not kept.
    assert len(host.regions) == 3 and len(host.reserved) == 3 and len(host.handles) == 3


def test_a_region_frees_its_memory_when_its_last_tensor_goes_or_after_a_capture():
    host = HostVmm()
    region, tensor = Region.create(host, torch.device("cpu"), 1000)
    view = tensor[10:20]
    del region, tensor
    assert len(host.reserved) == 1  # a view still holds it
    del view
    assert not host.reserved and not host.handles
    host.capturing_now = True  # synchronising now would break a capture: wait for the next drain
    tensor = Region.create(host, torch.device("cpu"), 1000)[1]
    del tensor
    assert len(host.reserved) == 1
    host.capturing_now = False
    assert host.drain() == 64 << 10 and not host.reserved and not host.handles


def test_state_held_elsewhere_is_parked_in_place_and_the_view_stays_the_state():
    host = HostVmm()
    model, opt = make()
    row = model.fc.weight[0]  # a view the Yielder does not know of
    yielder = Yielder(modules=[model], optimizers=[opt], vmm=host)
    assert host.region_at(model.conv.weight.untyped_storage().data_ptr()) is not None
    assert model.fc.weight.untyped_storage().data_ptr() == row.untyped_storage().data_ptr()  # not moved
    yielder.park()
    yielder.unpark()
    with torch.no_grad():
        model.fc.weight[0, 0] = 42.0
    assert row[0] == 42.0


def test_verify_names_the_bytes_of_a_host_copy_changed_while_parked():
    host = HostVmm()
    weights = torch.randn(100_000)
    yielder = Yielder(vmm=host)
    yielder.register_state(weights)
    yielder.reserve()  # into a region
    expected = weights.clone()
    yielder.park()
    yielder.host_buffer[70_000] ^= 1  # one bit, in the second 64 KiB block
    with pytest.raises(RestoreVerifyError, match=r"register_state\[0\]'s storage \(458752 bytes on cpu, its "
                                                 r"region\) at bytes 65536-131072 first"):
        yielder.unpark()
    assert not yielder.parked and not torch.equal(weights, expected)  # back, with the difference, and said
    assert (weights != expected).sum() == 1


def test_block_checksums_see_a_block_moved_which_one_sum_misses():
    data = torch.randint(0, 256, (4 * vmm.VERIFY_BLOCK_BYTES + 100,), dtype=torch.uint8)
    swapped = data.clone()
    block = vmm.VERIFY_BLOCK_BYTES
    swapped[:block], swapped[block:2 * block] = data[block:2 * block], data[:block]
    assert block_sums(data).numel() == 5  # four blocks and the tail
    assert block_sums(data)[2:].equal(block_sums(swapped)[2:]) and not block_sums(data).equal(block_sums(swapped))
    assert block_sums(data).sum() == block_sums(swapped).sum()


def test_an_unpark_that_cannot_map_stays_parked_and_a_retry_restores_everything():
    host = HostVmm()
    model, opt = make()
    for batch in batches(1):
        step(model, opt, batch)
    yielder = Yielder(modules=[model], optimizers=[opt], vmm=host)
    before = [t.clone() for t in state_tensors(model, opt)]
    seen = addresses(model, opt)
    yielder.park()
    host.fail["create"] = 1  # the first region is mapped again, the second is not
    with pytest.raises(DriverError, match=r"create\(test\) failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
        yielder.unpark()
    assert yielder.parked and not host.handles  # the region mapped before the failure went again
    yielder.unpark()
    assert addresses(model, opt) == seen
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(model, opt), before))


def test_a_region_that_cannot_be_made_leaves_the_state_in_place():
    host = HostVmm()
    model, opt = make()
    host.fail["create"] = 0
    yielder = Yielder(modules=[model], optimizers=[opt], vmm=host)  # "auto": falls back
    assert not yielder.keeps_addresses and "making a region failed" in yielder.address_note
    assert not host.regions and not host.reserved
    weight = model.fc.weight.clone()
    yielder.park()
    yielder.unpark()
    assert torch.equal(model.fc.weight, weight)

    host.fail["create"] = 0
    model, opt = make()
    with pytest.raises(KeepAddressesError, match="making a region failed"):
        Yielder(modules=[model], optimizers=[opt], vmm=host, keep_addresses=True)
    assert torch.equal(model.fc.weight, weight)  # restored in place


def test_driver_errors_name_the_call_its_arguments_and_the_curesult():
    calls = []

    def returns(code):
        def fn(*args):
            calls.append(args)
            return code
        return fn

    def error_text(text):
        def fn(rc, out):
            out._obj.value = text
            return 0
        return fn

    lib = type("Lib", (), {})()
    for name in vmm._SIGNATURES:
        setattr(lib, name, returns(0))
    lib.cuMemCreate = returns(2)
    lib.cuGetErrorName, lib.cuGetErrorString = error_text(b"CUDA_ERROR_OUT_OF_MEMORY"), error_text(b"out of memory")
    backend = vmm.CudaVmm(driver=vmm.CudaDriver(lib=lib))
    assert calls == [(0,)]  # cuInit
    with pytest.raises(DriverError) as err:
        backend.create(1 << 21, torch.device("cuda", 0))
    assert str(err.value) == ("cuMemCreate(2097152 bytes on cuda:0) failed: CUDA_ERROR_OUT_OF_MEMORY (2): "
                              "out of memory")
    assert err.value.code == 2 and err.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    # cuInit, then cuDeviceGet, the primary context retained and pushed, cuMemCreate, the context popped
    assert len(calls) == 6 and calls[4][1] == 1 << 21 and calls[4][3] == 0
    prop = calls[4][2]._obj  # what cuMemCreate was given: pinned device memory on cuda:0, no handle type
    assert (prop.type, prop.requestedHandleTypes, prop.location.type, prop.location.id) == (1, 0, 1, 0)
    assert backend.unavailable_reason(torch.device("cpu")).startswith("the state is on cpu")


# --------------------------------------------------------------------- gpu


@pytest.mark.gpu
@cuda
def test_a_cuda_region_keeps_its_address_and_gives_its_memory_back_between_unmap_and_remap():
    backend = vmm.default_backend()
    device = torch.device("cuda", torch.cuda.current_device())
    assert backend.unavailable_reason(device) is None
    size = 256 << 20
    region, tensor = Region.create(backend, device, size)
    assert tensor.data_ptr() == region.va and tensor.device == device and region.nbytes == size
    tensor.fill_(7)
    torch.cuda.synchronize()
    free_mapped = torch.cuda.mem_get_info()[0]
    region.unmap()
    free_unmapped = torch.cuda.mem_get_info()[0]
    region.remap()
    tensor.copy_(torch.full((size,), 9, dtype=torch.uint8, device=device))
    assert tensor.data_ptr() == region.va and int(tensor[::4096].min()) == int(tensor[::4096].max()) == 9
    print(f"\n[park-vmm] a 256 MiB region: granularity {backend.granularity(device)} bytes, unmapping freed "
          f"{(free_unmapped - free_mapped) >> 20} MiB")
    assert free_unmapped - free_mapped >= size - (8 << 20)
    va = region.va
    del region, tensor
    gc.collect()
    assert backend.region_at(va) is None


@pytest.mark.gpu
@cuda
def test_one_gib_parks_and_unparks_at_its_addresses_at_20_gib_per_s():
    gib = 1 << 30
    if torch.cuda.mem_get_info()[0] < 3 * gib:
        pytest.skip("needs 3 GiB of free device memory")
    module = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16 << 20, device="cuda"))
                                     for _ in range(16)])  # 16 x 64 MiB
    reference = [p.detach().clone() for p in module]
    t0 = time.perf_counter()
    yielder = Yielder(modules=[module], keep_addresses=True)
    adopt_ms = (time.perf_counter() - t0) * 1000
    seen = [p.data_ptr() for p in module]
    parks, unparks = [], []
    for i in range(4):
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        parked = yielder.park()
        parks.append(time.perf_counter() - t0)
        free_parked = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        yielder.unpark()
        unparks.append(time.perf_counter() - t0)
        assert yielder.bytes_copied >= gib and parked >= gib
        assert free_parked - free_before >= gib - (64 << 20), (free_before, free_parked)  # free for others
        assert [p.data_ptr() for p in module] == seen
        assert all(torch.equal(p, r) for p, r in zip(module, reference))
    park_s, unpark_s = statistics.median(parks[1:]), statistics.median(unparks[1:])
    park_gib_s, unpark_gib_s = yielder.bytes_copied / gib / park_s, yielder.bytes_copied / gib / unpark_s
    measured = (f"1 GiB keeping addresses: park {park_gib_s:.1f} GiB/s ({park_s * 1e3:.1f} ms), unpark "
                f"{unpark_gib_s:.1f} GiB/s ({unpark_s * 1e3:.1f} ms), first park {parks[0] * 1e3:.1f} ms; of them "
                f"checksums {yielder.checksum_ms:.2f} ms, verify {yielder.verify_ms:.2f} ms; moving the state in "
                f"at construction {adopt_ms:.0f} ms; host buffer pinned: {yielder.host_buffer.is_pinned()}")
    print(f"\n[park-vmm] {measured}")
    assert park_gib_s >= 20 and unpark_gib_s >= 20, measured


def _park_fill_unpark(yielder: Yielder) -> int:
    parked = yielder.park()
    filled = fill_freed_memory_from_another_process()
    yielder.unpark()
    print(f"\n[park-vmm] parked {parked >> 20} MiB; another process filled {filled >> 20} MiB with garbage; "
          f"verify {yielder.verify_ms:.2f} ms")
    assert filled > parked  # it had the freed memory too
    return parked


@pytest.mark.gpu
@cuda
def test_a_cuda_graph_captured_before_a_park_replays_bit_identically_after_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024),
                                torch.nn.LayerNorm(1024), torch.nn.BatchNorm1d(1024)).cuda().eval()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device="cuda")
    model(x).sum().backward()
    opt.step()  # Adam's state and gradients: parked too
    yielder = Yielder(modules=[model], optimizers=[opt], keep_addresses=True)  # before the capture
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = model(static_x)
    graph.replay()
    expected = static_out.clone()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = [p.data_ptr() for p in model.parameters()]

    _park_fill_unpark(yielder)
    static_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert [p.data_ptr() for p in model.parameters()] == seen
    assert torch.equal(static_out, expected)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.gpu
@cuda
def test_a_reduce_overhead_compiled_model_runs_bit_identically_after_a_park_without_recapturing(monkeypatch):
    from torch.utils._triton import has_triton
    if not has_triton():
        pytest.skip("torch.compile's inductor needs triton for CUDA")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).cuda().eval()
    yielder = Yielder(modules=[model], keep_addresses=True)  # before compiling
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):  # warm up, record, replay
            out = compiled(x)
        expected = out.clone()
    captures = []
    original = torch.cuda.graphs.CUDAGraph.capture_begin
    monkeypatch.setattr(torch.cuda.graphs.CUDAGraph, "capture_begin",
                        lambda self, *a, **k: (captures.append(1), original(self, *a, **k))[1])

    _park_fill_unpark(yielder)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        after = compiled(x).clone()
        again = compiled(x).clone()
    assert not captures  # replayed the graph recorded before the park
    assert torch.equal(after, expected) and torch.equal(again, expected)
