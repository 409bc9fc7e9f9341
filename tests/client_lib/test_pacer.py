"""client_lib.torch.Pacer: pause points between layers, a fence before a yield (cpu here;
the bounded run-ahead needs CUDA and runs in the gpu tests)."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from client_lib import Client  # noqa: E402
from client_lib.pacer import pause_modules  # noqa: E402
from client_lib.torch import Pacer  # noqa: E402
from tests.conftest import wait_for  # noqa: E402


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(8)),
                               torch.nn.Linear(64, 4))


def test_pause_points_split_the_parameters_into_similar_shares():
    model = _model()
    chosen = pause_modules(model, 8)
    assert len(chosen) == 9  # each block (one Linear) and the head; ReLUs have no parameters
    assert all(sum(p.numel() for p in m.parameters()) > 0 for m in chosen)
    assert pause_modules(model, 1) == [model]
    assert pause_modules(torch.nn.ReLU(), 4) == []


class _FakeClient:
    """What Pacer asks of a Client, without a daemon: no board, and a fence slot."""

    def __init__(self) -> None:
        self.pacing = None
        self._fence = None

    def set_fence(self, fence) -> None:
        self._fence = fence

    def pace_point(self) -> float:
        return 0.0


def test_points_run_in_forward_backward_and_the_optimizer_step_and_close_removes_them():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = _FakeClient()
    pacer = Pacer(client, model, opt, points=8)
    calls = []
    pacer.point = lambda: calls.append(1)  # the hooks call through the instance
    loss = model(torch.randn(4, 64)).sum()
    forward = len(calls)
    loss.backward()
    backward = len(calls) - forward
    opt.step()
    assert forward == pacer.points == 9 and backward == 9 and len(calls) == 19
    assert client._fence == pacer.fence
    pacer.close()
    assert client._fence is None
    calls.clear()
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert calls == []


def test_a_paced_trainer_stops_between_layers_while_inference_holds(start_daemon):
    d = start_daemon("--sharing", "corun", "--corun-duty", "pause")
    layers: list[float] = []
    stop = threading.Event()
    ready = threading.Event()

    def train() -> None:
        model = _model()

        def layer_done(*args) -> None:  # a layer's worth of work, timestamped
            layers.append(time.monotonic())
            time.sleep(0.0005)

        for m in model:
            m.register_forward_hook(layer_done)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with Client("trainer", workload="training", endpoint=d.endpoint) as client:
            pacer = Pacer(client, model, opt)
            with client.slice():
                ready.set()
                while not stop.is_set():
                    model(torch.randn(8, 64)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    client.yield_point()
            pacer.close()

    thread = threading.Thread(target=train)
    thread.start()
    try:
        assert ready.wait(10)
        wait_for(lambda: len(layers) > 20)
        with Client("ranker", workload="inference", endpoint=d.endpoint) as inf:
            with inf.slice():
                time.sleep(0.01)  # at most one layer more: the next point pauses it
                held_from = time.monotonic()
                time.sleep(0.15)
                held_to = time.monotonic()
        wait_for(lambda: layers[-1] > held_to)
    finally:
        stop.set()
        thread.join(10)
    assert not [t for t in layers if held_from < t < held_to]


class _PresentBoard:
    """A pace point whose board says a higher class is on the device (present) but not holding."""

    def pace(self):
        from client_lib.pace import Pace
        return Pace(1, False, 1000, 10_000)


class _Board:
    def __init__(self, present: int, armed: bool) -> None:
        self.present, self.armed = present, armed

    def pace(self):
        from client_lib.pace import Pace
        return Pace(self.present, False, 0 if self.armed else 1000, 10_000, self.armed)


@pytest.mark.parametrize("mps_priority, present, armed, bounded", [
    (True, 1, False, False),  # no pause can come (pacing left to MPS priority): the trainer runs free
    (True, 1, True, True),    # the board says a pause may come: keep the queue short
    (False, 1, False, True),  # time-sliced contexts: bounded while a higher class is on the device
    (False, 0, False, False),  # alone: never
])
def test_under_mps_priority_the_run_ahead_is_bounded_only_where_a_pause_can_come(mps_priority, present, armed,
                                                                                 bounded):
    from types import SimpleNamespace

    client = _FakeClient()
    client.welcome = SimpleNamespace(env={"CUDA_MPS_CLIENT_PRIORITY": "1"} if mps_priority else {})
    client.pacing = _Board(present, armed)
    pacer = Pacer(client, _model(), points=4)
    assert pacer.bound == ("pausable" if mps_priority else "present")
    calls = []
    pacer._cuda = True  # the decision, without a GPU: the bound itself is the gpu test below
    pacer._bound = lambda: calls.append(1)
    pacer.point()
    assert bool(calls) is bounded
    with pytest.raises(ValueError):
        Pacer(client, _model(), bound="always")


@pytest.mark.gpu
def test_on_cuda_the_run_ahead_is_bounded_while_a_higher_class_is_on_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(32))).to(device)
    x = torch.randn(8192, 4096, device=device)

    def drain_ms() -> tuple[float, float]:
        """(ms a forward took on the GPU, ms of it still queued when the CPU had issued it all)."""
        with torch.inference_mode():
            for _ in range(3):
                model(x)
            torch.cuda.synchronize()
            started = time.perf_counter()
            model(x)
            issued = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
        return (done - started) * 1e3, (done - issued) * 1e3

    total, unbounded = drain_ms()
    client = _FakeClient()
    client.pacing = _PresentBoard()
    pacer = Pacer(client, model, points=32, ahead_ms=2.0)
    _, bounded = drain_ms()
    pacer.close()
    layer_ms = total / 32
    print(f"queued after issue: {unbounded:.2f} ms unbounded, {bounded:.2f} ms bounded (layer {layer_ms:.2f} ms)")
    assert unbounded > 0.5 * total  # on its own the CPU ran far ahead of the GPU
    # Bounded: two layers (the least it keeps), the one running and the one issued after the last point.
    assert bounded < 5 * layer_ms and bounded < unbounded / 3
