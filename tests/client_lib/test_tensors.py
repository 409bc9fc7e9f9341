"""Shared-memory tensor transport (client_lib.tensors)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from client_lib import protocol as p
from client_lib import tensors as T
from tests.conftest import REPO


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
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
        assert _exists(seg.name) and seg.buf[0] == 7
    finally:
        seg.close()
        seg.unlink()
    assert not T.unlink_segment(seg.name)  # idempotent: already gone


# ------------------------------------------- segments named by someone else


@pytest.fixture
def segment():
    seg = T.create_segment(64, prefix="na-test-t")
    seg.buf[:4] = b"mine"
    seg.close()
    yield seg.name
    T.unlink_segment(seg.name)


def test_a_segment_of_another_user_is_refused_by_its_opened_fd(segment):
    me, other = os.geteuid(), os.geteuid() + 1
    T.attach_segment(segment, owner_uid=me).close()
    T.check_owner([p.TensorRef(dtype="uint8", shape=[4], shm=segment, nbytes=4)], me)
    with pytest.raises(T.SegmentAccessError, match=f"does not belong to uid {other}"):
        T.attach_segment(segment, owner_uid=other)
    with pytest.raises(T.SegmentAccessError):
        T.attach_all([p.TensorRef(dtype="uint8", shape=[4], shm=segment, nbytes=4)], owner_uid=other)
    T.attach_segment(segment, owner_uid=None).close()  # who may name any (the daemon's ROOT) passes None
    if me == 0:  # and uid 0 is checked as any other uid: a container's root is uid 0 too (issue 32)
        theirs = T.create_segment(8, prefix="na-test-t", owner=65534)
        theirs.close()
        try:
            with pytest.raises(T.SegmentAccessError, match="does not belong to uid 0"):
                T.attach_segment(theirs.name, owner_uid=0)
            assert not T.unlink_if_owned(theirs.name, 0) and _exists(theirs.name)
        finally:
            T.unlink_segment(theirs.name)
    # Cleaning up after a peer: never a segment it does not own.
    assert not T.unlink_if_owned(segment, other) and _exists(segment)
    T.discard([p.TensorRef(dtype="uint8", shape=[4], shm=segment, nbytes=4)], owner_uid=other)
    assert _exists(segment)
    assert T.unlink_if_owned(segment, me) and not _exists(segment)


def test_symlinks_and_fifos_are_not_segments(segment):
    link, fifo = T.segment_name("na-test-link"), T.segment_name("na-test-fifo")
    os.symlink(os.path.join(T.SHM_DIR, segment), os.path.join(T.SHM_DIR, link))
    os.mkfifo(os.path.join(T.SHM_DIR, fifo))
    try:
        for owner in (None, os.geteuid()):
            with pytest.raises(T.SegmentAccessError, match="symbolic link"):
                T.attach_segment(link, owner_uid=owner)
            with pytest.raises(T.SegmentAccessError, match="not a shared-memory segment"):
                T.attach_segment(fifo, owner_uid=owner)  # and without hanging on it
        with pytest.raises(T.SegmentAccessError):
            T.check_owner([p.TensorRef(dtype="uint8", shape=[1], shm=fifo, nbytes=1)], os.geteuid())
        assert not T.unlink_if_owned(link, os.geteuid()) and os.path.islink(os.path.join(T.SHM_DIR, link))
        with pytest.raises(FileExistsError):
            T.create_segment(8, name=link)  # never created through a symlink either
    finally:
        os.unlink(os.path.join(T.SHM_DIR, link))
        os.unlink(os.path.join(T.SHM_DIR, fifo))
    for bad in ("", ".", "..", "a/b", "x\0y", "n" * 201):
        with pytest.raises(T.TensorTransportError, match="bad shared-memory segment name"):
            T.attach_segment(bad)


def test_a_segment_made_for_another_user_is_theirs_and_private():
    if os.geteuid() != 0:
        pytest.skip("giving a segment to another user needs root")
    seg = T.create_segment(16, prefix="na-test-for", owner=65534, group=os.getegid())
    try:
        st = os.stat(os.path.join(T.SHM_DIR, seg.name))
        assert st.st_uid == 65534 and stat.S_IMODE(st.st_mode) == 0o600  # not shared with the group
        T.attach_segment(seg.name, owner_uid=65534).close()
    finally:
        seg.close()
        seg.unlink()


def test_share_group_only_when_a_non_root_daemon_of_another_user_needs_it(tmp_path):
    sock = tmp_path / "agent.sock"
    sock.write_text("")
    assert T.share_group(str(sock)) is None  # the daemon is this user (or root): 0600 will do
    assert T.share_group(None) is None and T.share_group(str(tmp_path / "absent")) is None
    if os.geteuid() == 0:
        os.chown(sock, 0, 61_999)
        assert T.share_group(str(sock)) is None  # a root daemon reads 0600 segments
        os.chown(sock, 65534, 61_999)
        assert T.share_group(str(sock)) == 61_999
    seg, refs = T.pack([torch.ones(2)])
    try:
        assert stat.S_IMODE(os.stat(os.path.join(T.SHM_DIR, seg.name)).st_mode) == 0o600
    finally:
        seg.close()
        seg.unlink()


def test_take_reads_what_it_may_not_unlink_and_leaves_it():
    """An output an older daemon made (root's, shared through the socket's group): the
    client still gets its tensors, and leaves the segment to the daemon."""
    from tests.nonroot import require_root, run_as_nobody, share_with_socket_group

    require_root()
    seg, refs = T.pack([np.arange(6, dtype=np.int32)])
    try:
        share_with_socket_group(os.path.join(T.SHM_DIR, seg.name), 0o660)
        code = ("import sys, msgspec; from client_lib import tensors as T, protocol as p\n"
                "refs = msgspec.json.decode(sys.argv[2], type=list[p.TensorRef])\n"
                "print(T.take(refs, like='numpy')[0].tolist())")
        done = run_as_nobody(code, "ipc://unused", msgspec.json.encode(refs).decode())
        assert done.returncode == 0 and done.stdout.strip() == "[0, 1, 2, 3, 4, 5]", done.stderr
        assert _exists(seg.name)  # not its to unlink
    finally:
        seg.close()
        seg.unlink()
