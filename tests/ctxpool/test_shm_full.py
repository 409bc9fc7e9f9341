"""A /dev/shm too small for a model's weights: an error naming the size needed, never a SIGBUS.

Containers get a 64 MB /dev/shm by default. A segment there is sparse: ftruncate
succeeds whatever its size, and the first write past the free space kills the
writer with SIGBUS. Segments the preparer fills are reserved first
(``posix_fallocate``), which fails cleanly.
"""

from __future__ import annotations

import os

import pytest

from client_lib import tensors
from tests.private_shm import run_with_private_dev_shm

pytest.importorskip("torch")


def test_a_reserved_segment_larger_than_dev_shm_is_refused_with_the_size_needed():
    st = os.statvfs(tensors.SHM_DIR)
    if st.f_blocks == 0:
        pytest.skip(f"{tensors.SHM_DIR} has no size limit here")
    size = st.f_blocks * st.f_frsize + (1 << 20)  # more than the whole file system: refused at once
    before = set(os.listdir(tensors.SHM_DIR))
    with pytest.raises(tensors.SharedMemoryFull, match=rf"needs {size} bytes .* {tensors.SHM_DIR} has \d+ bytes free"):
        tensors.create_segment(size, "na-test-full", reserve=True)
    assert set(os.listdir(tensors.SHM_DIR)) - before == set()  # nothing left behind
    seg = tensors.create_segment(1 << 20, "na-test-full", reserve=True)
    try:
        fd = os.open(os.path.join(tensors.SHM_DIR, seg.name), os.O_RDONLY)
        try:
            assert os.fstat(fd).st_blocks * 512 >= 1 << 20  # allocated, not sparse
        finally:
            os.close(fd)
    finally:
        seg.close()
        seg.unlink()


_PREPARE_IN_A_TINY_SHM = r"""
import os, torch
from ctxpool import store
module = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 8 MiB of weights
try:
    store.place_in_shared_memory(module, None, "na-w-test-tiny")
    print("placed")
except store.ModelError as exc:
    print("refused", exc.code, exc.message)
print("left", sorted(os.listdir("/dev/shm")))
"""


def test_the_preparer_refuses_weights_that_do_not_fit_a_tiny_dev_shm_instead_of_dying():
    run = run_with_private_dev_shm("1m", _PREPARE_IN_A_TINY_SHM, timeout=120)
    assert run.returncode == 0, f"the preparer died (status {run.returncode}):\n{run.stderr[-2000:]}"
    refused, left = run.stdout.splitlines()[-2:]
    assert refused.startswith("refused E_MODEL"), run.stdout
    weights = 2 * (1024 * 1024 + 1024) * 4  # two weights and two biases, each 512-byte aligned already
    assert f"needs {weights} bytes" in refused and "/dev/shm has" in refused and "--shm-size" in refused
    assert left == "left []"  # the failed segment is gone


_PACK_INPUTS_IN_A_TINY_SHM = r"""
import os, torch
from client_lib import serving, tensors
try:
    with serving.Packed([torch.zeros(1 << 20)], "ipc:///tmp/na-none.sock"):  # 4 MiB of inputs
        print("packed")
except tensors.SharedMemoryFull as exc:
    print("refused", exc)
print("left", sorted(os.listdir("/dev/shm")))
"""


def test_a_clients_inputs_that_do_not_fit_a_tiny_dev_shm_are_refused_instead_of_killing_it():
    """Before: the input segment was sparse, and copying the inputs into it killed the
    client with SIGBUS. Now it is reserved first: SharedMemoryFull, naming the size."""
    run = run_with_private_dev_shm("1m", _PACK_INPUTS_IN_A_TINY_SHM, timeout=120)
    assert run.returncode == 0, f"the client died (status {run.returncode}):\n{run.stderr[-2000:]}"
    refused, left = run.stdout.splitlines()[-2:]
    assert refused.startswith("refused") and f"needs {4 << 20} bytes" in refused, run.stdout
    assert left == "left []"
