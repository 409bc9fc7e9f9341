"""Shared-memory tensor transport (client_lib.tensors)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from client_lib import protocol as p
from client_lib import tensors as T


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                   torch.uint8, torch.int32, torch.int64, torch.bool])
def test_torch_round_trip_every_dtype(dtype):
    t = (torch.randn(4, 5, 3) * 10).to(dtype)
    seg, refs = T.pack([t, t[:, 1]])  # the second is not contiguous
    seg.close()
    out = T.take(refs)
    assert torch.equal(out[0], t) and torch.equal(out[1], t[:, 1])
    assert out[0].dtype == dtype
    assert not _exists(seg.name)  # take() unlinked what it read


def test_numpy_round_trip_and_alignment():
    arrays = [np.arange(7, dtype=np.int16), np.ones((3, 3), dtype=np.float64), np.array(True)]
    seg, refs = T.pack(arrays)
    seg.close()
    assert all(r.offset % T.ALIGN_BYTES == 0 for r in refs)
    assert [r.shape for r in refs] == [[7], [3, 3], []]
    out = T.take(refs, like="numpy")
    for a, b in zip(arrays, out):
        np.testing.assert_array_equal(a, b)


def test_empty_tensors_need_no_segment():
    seg, refs = T.pack([torch.empty(0, 3)])
    assert seg is None and refs[0].shm == "" and refs[0].shape == [0, 3]
    assert T.take(refs)[0].shape == (0, 3)


def test_views_are_zero_copy():
    seg, refs = T.pack([torch.zeros(4)])
    try:
        segments = T.attach_all(refs)
        view = T.views(refs, segments)[0]
        view += 5  # writes through to the segment
        del view
        for s in segments.values():
            s.close()
        assert torch.equal(T.take(refs, unlink=False)[0], torch.full((4,), 5.0))
    finally:
        seg.close()
        seg.unlink()


def test_refs_that_lie_are_refused():
    seg, refs = T.pack([torch.zeros(4)])
    try:
        segments = T.attach_all(refs)
        outside = p.TensorRef(dtype="float32", shape=[1024], shm=seg.name, offset=0, nbytes=4096)
        with pytest.raises(T.TensorTransportError, match="outside segment"):
            T.views([outside], segments)
        wrong_size = p.TensorRef(dtype="float32", shape=[4], shm=seg.name, offset=0, nbytes=15)
        with pytest.raises(T.TensorTransportError, match="needs 16"):
            T.views([wrong_size], segments)
        with pytest.raises(T.TensorTransportError, match="unknown dtype"):
            T.views([p.TensorRef(dtype="object", shape=[1], shm=seg.name, nbytes=8)], segments)
        for s in segments.values():
            s.close()
    finally:
        seg.close()
        seg.unlink()
    with pytest.raises(T.TensorTransportError, match="already unlinked"):
        T.attach_all(refs)
    with pytest.raises(T.TensorTransportError, match="bad shared-memory segment name"):
        T.attach_segment("../etc/passwd")


def test_unsupported_dtype_is_named():
    with pytest.raises(T.TensorTransportError, match="<U1 cannot cross"):
        T.pack([np.array(["a"])])


def test_segments_are_group_shared_and_untracked(tmp_path):
    seg = T.create_segment(128, group=os.getegid())
    try:
        mode = stat.S_IMODE(os.stat(os.path.join("/dev/shm", seg.name)).st_mode)
        assert mode == 0o660
        # A process that maps the segment and exits must not unlink it (the
        # resource tracker of multiprocessing would).
        code = f"from client_lib import tensors as T; s = T.attach_segment({seg.name!r}); s.buf[0] = 7; s.close()"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert _exists(seg.name) and seg.buf[0] == 7
    finally:
        seg.close()
        seg.unlink()
    assert not T.unlink_segment(seg.name)  # idempotent: already gone
