"""client_lib.torch.Pacer while a CUDA graph is captured (issue 33, defect 4): the run-ahead bound
and the fence make no CUDA call, which would invalidate the capture. On cpu, with a fake capture
state and fake events standing in for CUDA's (the gpu test in tests/client_lib/test_pacer.py runs the bound)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from client_lib.pace import Pace  # noqa: E402
from client_lib.torch import Pacer  # noqa: E402


class _Board:
    """A pace point whose board says a higher class holds the device and lower classes may run."""

    def pace(self) -> Pace:
        return Pace(1, True, 1000, 10_000)


class _Client:
    def __init__(self) -> None:
        self.pacing = _Board()
        self._fence = None

    def set_fence(self, fence) -> None:
        self._fence = fence

    def pace_point(self) -> float:
        return 0.0


class _FakeCuda:
    """The CUDA calls the bound and the fence make, counted; ``capturing`` is the stream's state."""

    def __init__(self, monkeypatch) -> None:
        self.capturing = False
        self.calls: list[str] = []
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                fake.calls.append("Event")

            def record(self, stream=None) -> None:
                fake.calls.append("record")

            def query(self) -> bool:
                fake.calls.append("query")
                return False

            def synchronize(self) -> None:
                fake.calls.append("synchronize")

            def elapsed_time(self, other) -> float:
                fake.calls.append("elapsed_time")
                return 1.0

        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.calls.append("device-synchronize"))


def _pacer(cuda: _FakeCuda) -> Pacer:
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    client = _Client()
    pacer = Pacer(client, model, points=4, ahead_ms=1.0, bound="present")
    pacer._cuda = True  # as on a GPU: the fakes above answer its CUDA calls
    return pacer


def test_while_a_graph_is_captured_the_bound_makes_no_cuda_call_and_resumes_after(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    pacer = _pacer(cuda)
    cuda.capturing = True
    for _ in range(8):  # more points than the bound lets queue: outside a capture it would wait
        pacer.point()
    assert cuda.calls == []
    assert pacer.bounded_s == 0.0
    cuda.capturing = False
    for _ in range(8):
        pacer.point()
    assert {"record", "query", "synchronize"} <= set(cuda.calls)  # the same points, bounded again


def test_while_a_graph_is_captured_the_fence_does_not_synchronise(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    pacer = _pacer(cuda)
    cuda.capturing = True
    pacer.fence()
    assert cuda.calls == []
    cuda.capturing = False
    pacer.fence()
    assert cuda.calls == ["device-synchronize"]


@pytest.mark.gpu
def test_on_cuda_a_graph_captured_beside_a_higher_class_captures_and_replays():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8))).to(device)
    pacer = Pacer(_Client(), model, points=8, ahead_ms=1.0, bound="present")  # bounded: events at each point
    x = torch.randn(64, 256, device=device)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up torch.cuda.graph asks for, bounded as ever
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # its points fire on the capturing stream
            out = model(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out, model(x))
    assert pacer.points == 8
    pacer.close()
