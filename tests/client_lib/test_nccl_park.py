"""NCCL's communicators through a park (issue 23 part 5): a Yielder suspends the NCCL process
groups' communicators with the state and resumes the same ones at the unpark, where torch's
backend can (PyTorch 2.12 over NCCL 2.29.7's ncclCommSuspend); where it cannot it says why once
and leaves them. Here the groups are stand-ins recording the calls: this machine has no NCCL,
and the GPU machine's torch 2.11 has no suspend (bench.suspend reports what it found there)."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from client_lib.nccl import Communicators, nccl_groups  # noqa: E402
from client_lib.torch import Yielder  # noqa: E402


class FakeBackend:
    def __init__(self, log: list, name: str, held: int = 64 << 20, fail: str | None = None) -> None:
        self.log, self.name, self.held, self.fail = log, name, held, fail

    def suspend(self) -> None:
        if self.fail == "suspend":
            raise RuntimeError("NCCL communicator not initialized on this device")
        self.log.append(("suspend", self.name))
        self.held = 0

    def resume(self) -> None:
        if self.fail == "resume":
            raise RuntimeError("ncclCommResume failed: unhandled cuda error")
        self.log.append(("resume", self.name))
        self.held = 64 << 20

    def memory_stats(self) -> dict:
        return {"device_bytes": self.held}


class FakeGroup:
    def __init__(self, backend) -> None:
        self.backend = backend
        self.devices: list = []

    def _get_backend(self, device):
        self.devices.append(device)
        return self.backend


def test_a_park_suspends_every_group_and_the_unpark_resumes_them_after_the_state_is_back():
    calls: list = []
    groups = [FakeGroup(FakeBackend(calls, "world")), FakeGroup(FakeBackend(calls, "tp"))]
    model = torch.nn.Linear(64, 64)
    weight = model.weight.detach().clone()
    yielder = Yielder(modules=[model], process_groups=lambda: groups)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    released = yielder.park()
    assert calls == [("suspend", "world"), ("suspend", "tp")] and yielder.nccl_suspended == 2
    assert released == state_bytes + 2 * (64 << 20) == yielder.bytes_parked  # the communicators' memory counts
    assert groups[0].devices == [torch.device("cpu")]  # the state's device
    yielder.unpark()
    assert calls[2:] == [("resume", "world"), ("resume", "tp")] and yielder.nccl_suspended == 0
    assert torch.equal(model.weight, weight)


def test_where_the_backend_cannot_suspend_the_park_says_why_once_and_leaves_them(caplog):
    class Old:  # torch 2.11's ProcessGroupNCCL: no suspend
        pass

    model = torch.nn.Linear(8, 8)
    yielder = Yielder(modules=[model], process_groups=lambda: [FakeGroup(Old()), FakeGroup(Old())])
    with caplog.at_level(logging.INFO, logger="client_lib.nccl"):
        yielder.park()
        yielder.unpark()
        yielder.park()
    assert yielder.nccl_suspended == 0 and "PyTorch 2.12" in yielder.nccl_note
    assert sum("cannot suspend" in r.getMessage() for r in caplog.records) == 1
    yielder.unpark()


def test_a_group_with_no_communicator_yet_is_skipped_and_a_failed_resume_is_raised_after_the_state():
    calls: list = []
    fresh = FakeGroup(FakeBackend(calls, "lazy", fail="suspend"))
    broken = FakeGroup(FakeBackend(calls, "broken", fail="resume"))
    live = FakeGroup(FakeBackend(calls, "live"))
    model = torch.nn.Linear(8, 8)
    weight = model.weight.detach().clone()
    yielder = Yielder(modules=[model], process_groups=lambda: [fresh, broken, live])
    yielder.park()
    assert yielder.nccl_suspended == 2  # the lazy one had nothing to release
    with pytest.raises(RuntimeError, match="ncclCommResume failed"):
        yielder.unpark()
    assert not yielder.parked and torch.equal(model.weight, weight)  # the state is back all the same
    assert ("resume", "live") in calls  # the others were resumed


def test_process_groups_false_leaves_them_and_no_torch_distributed_means_no_groups():
    calls: list = []
    yielder = Yielder(modules=[torch.nn.Linear(4, 4)], process_groups=False)
    yielder.park()
    yielder.unpark()
    assert calls == [] and yielder.nccl_suspended == 0 and yielder.nccl_note is None
    assert nccl_groups() == []  # torch.distributed is not initialised in this process
    assert Communicators(lambda: []).suspend(torch.device("cpu")) == 0


def test_the_groups_are_read_from_this_torch_and_a_gloo_group_is_not_nccls(tmp_path):
    """The registry the groups are read from exists in this torch (a renamed one would make every
    park skip NCCL silently): a gloo world group is found there, and is not an NCCL group."""
    import subprocess
    import sys

    code = ("import torch.distributed as dist\n"
            "from client_lib.nccl import nccl_groups, process_groups\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
            "print(len(process_groups()), len(nccl_groups()))\n"
            "dist.destroy_process_group()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1", "0"]


@pytest.mark.gpu
def test_on_one_gpu_a_live_nccl_group_goes_through_a_park(tmp_path):
    """One GPU, one rank: an NCCL world group with a live communicator (an all-reduce made it), a
    park and an unpark of a model beside it, and an all-reduce after. Where torch can suspend
    communicators, their memory is released while parked; where it cannot (torch before 2.12, as
    on the lent GPU machines), the note says so. What was found goes to NODEAGENT_RESULTS_DIR
    (nccl_park.json) when set. Several GPUs (several ranks parking together) are not run here."""
    import json
    import os
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    code = f"""
import json, torch, torch.distributed as dist
from client_lib.torch import Yielder
dist.init_process_group("nccl", init_method="file://{tmp_path}/store", rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
model = torch.nn.Linear(4096, 4096, device="cuda")
y = Yielder(modules=[model], keep_addresses=False, verify=False)
free_before = torch.cuda.mem_get_info()[0]
released = y.park()
free_parked = torch.cuda.mem_get_info()[0]
suspended, note = y.nccl_suspended, y.nccl_note
y.unpark()
dist.all_reduce(x)
torch.cuda.synchronize()
print(json.dumps({{"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "suspended": suspended, "note": note, "bytes_parked": released,
                  "freed_on_device": free_parked - free_before, "all_reduce_after": float(x[0])}}))
dist.destroy_process_group()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MASTER_ADDR": "127.0.0.1"})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    out_dir = os.environ.get("NODEAGENT_RESULTS_DIR")
    if out_dir:
        with open(os.path.join(out_dir, "nccl_park.json"), "w") as f:
            json.dump(result, f, indent=2)
    assert result["all_reduce_after"] == 1.0  # the group works after the unpark, suspended or not
    assert result["suspended"] == 1 or "PyTorch 2.12" in (result["note"] or "")
