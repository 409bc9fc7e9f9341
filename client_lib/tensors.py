"""Tensors across processes without pickling: POSIX shared memory plus msgspec metadata
(:class:`client_lib.protocol.TensorRef`), read as zero-copy views; whoever the protocol names as
owner unlinks the segment. Detail: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import mmap
import os
import secrets
import stat
from typing import Any, Sequence

from client_lib import protocol as p

try:  # CPython's own binding of shm_open/shm_unlink (what multiprocessing uses)
    import _posixshmem
except ImportError:  # pragma: no cover - not on Linux
    _posixshmem = None

ALIGN_BYTES = 64
MAX_NAME_CHARS = 200
SHM_DIR = "/dev/shm"
_HAVE_SHM_DIR = os.path.isdir(SHM_DIR)
_counter = itertools.count(1)

# Element sizes of the dtypes that may cross; names are torch's without "torch.".
DTYPE_BYTES = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
    "complex64": 8, "complex128": 16,
}


class TensorTransportError(ValueError):
    """A tensor that cannot cross (unsupported dtype, bad ref, missing segment)."""


class SegmentAccessError(TensorTransportError):
    """A segment the requester may not name: another user's, a symlink, not a plain segment."""


class Segment:
    """One mapped POSIX shared-memory segment. ``buf`` is writable."""

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name = name
        self.size = size
        try:
            self._mmap = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    def close(self) -> None:
        """Unmap. Views still alive keep the mapping until they are gone."""
        try:
            self.buf.release()
        except BufferError:
            return  # a tensor still views it; the mapping goes with the last view
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()

    def unlink(self) -> None:
        """Remove the name (the memory goes when the last mapping does). Idempotent."""
        unlink_segment(self.name)

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size} bytes)"


def _shm_open(name: str, flags: int, mode: int) -> int:
    if _posixshmem is not None and not _HAVE_SHM_DIR:  # pragma: no cover - not Linux
        return _posixshmem.shm_open("/" + name, flags, mode)
    # What glibc's shm_open does, with the flags spelled out: never through a symlink.
    return os.open(os.path.join(SHM_DIR, name), flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", "..") \
            or len(name) > MAX_NAME_CHARS:
        raise TensorTransportError(f"bad shared-memory segment name {str(name)[:MAX_NAME_CHARS]!r}")


def unlink_segment(name: str) -> bool:
    """Remove a segment by name; False if it was already gone."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        else:  # pragma: no cover
            os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return False
    return True


def segment_name(prefix: str = "na") -> str:
    """A fresh segment name: prefix, pid, a counter and randomness (never reused)."""
    return f"{prefix}-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"


class SharedMemoryFull(TensorTransportError):
    """/dev/shm cannot hold a segment of the size asked for (see ``create_segment(reserve=True)``)."""


def _reserve(fd: int, name: str, size: int) -> None:
    """Allocate the segment's pages now: on a full tmpfs a write into a sparse segment is a
    SIGBUS that kills the writer, while posix_fallocate fails cleanly with ENOSPC."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            return  # a file system that cannot reserve (EOPNOTSUPP, ...): best effort, as before
        try:
            st = os.statvfs(SHM_DIR)
            room = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
        except OSError:
            room = "too little room"
        raise SharedMemoryFull(
            f"shared memory is too small: segment {name} needs {size} bytes ({size / 2**20:.1f} MiB) and "
            f"{SHM_DIR} has {room}; give this process a larger {SHM_DIR} (docker run --shm-size, "
            f"a Kubernetes emptyDir with medium Memory, or mount -o remount,size=... {SHM_DIR})") from None


def create_segment(nbytes: int, prefix: str = "na", *, name: str | None = None, group: int | None = None,
                   owner: int | None = None, reserve: bool = False) -> Segment:
    """A new segment of ``nbytes`` (at least 1), mode 0600. ``owner``: a uid to give it
    to (a root worker making a client's output: the client may then unlink it);
    ``group``: where the creator may, share it with that group (mode 0660) instead;
    ``reserve``: allocate its memory now, :class:`SharedMemoryFull` if it does not fit."""
    name = name or segment_name(prefix)
    _check_name(name)
    size = max(1, int(nbytes))
    fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        if reserve:
            _reserve(fd, name, size)
        if owner is not None:
            with contextlib.suppress(PermissionError):  # not root: share it through the group, if any
                if owner != os.geteuid():
                    os.fchown(fd, owner, -1)
                group = None  # the owner reads it; nobody else needs to
        if group is not None and group != os.getegid():
            try:
                os.fchown(fd, -1, group)
            except PermissionError:
                group = None
        if group is not None:
            os.fchmod(fd, 0o660)
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise
    return Segment(name, fd, size)


def _open_checked(name: str, flags: int, owner_uid: int | None) -> tuple[int, os.stat_result]:
    """Open an existing segment (never through a symlink) and, with ``owner_uid``,
    refuse it unless that uid owns it (uid 0 too: who may name any passes None). The check is on the
    opened descriptor, so a name swapped meanwhile cannot pass it. Non-blocking:
    a FIFO planted under the name must not hang the opener."""
    _check_name(name)
    try:
        fd = _shm_open(name, flags | os.O_NONBLOCK, 0)
    except FileNotFoundError:
        raise TensorTransportError(f"no shared-memory segment {name!r} (already unlinked?)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SegmentAccessError(f"shared-memory segment {name!r} is a symbolic link; name the segment "
                                     "itself") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise SegmentAccessError(f"shared-memory segment {name!r} is not readable by uid {os.geteuid()} "
                                     "(the client and the daemon must share the socket's group)") from None
        raise TensorTransportError(f"shared-memory segment {name!r} cannot be opened: "
                                   f"{os.strerror(exc.errno or 0)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SegmentAccessError(f"{name!r} is not a shared-memory segment")
        if owner_uid is not None and st.st_uid != owner_uid:
            raise SegmentAccessError(f"shared-memory segment {name!r} does not belong to uid {owner_uid}; "
                                     "name only segments your own user created")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def attach_segment(name: str, *, owner_uid: int | None = None) -> Segment:
    """Map an existing segment; :class:`TensorTransportError` if there is none,
    :class:`SegmentAccessError` if it is a symlink or (with ``owner_uid``) not that uid's."""
    fd, st = _open_checked(name, os.O_RDWR, owner_uid)
    return Segment(name, fd, st.st_size)


def check_owner(refs: Sequence[p.TensorRef], owner_uid: int | None) -> None:
    """Raise unless every segment the refs name exists and belongs to ``owner_uid`` (None: anyone)."""
    for name in dict.fromkeys(r.shm for r in refs if r.shm):
        fd, _ = _open_checked(name, os.O_RDONLY, owner_uid)
        os.close(fd)


def unlink_if_owned(name: str, owner_uid: int) -> bool:
    """Unlink ``name`` only if it is a segment ``owner_uid`` owns (uid 0: only root's); True if
    unlinked. What a root daemon cleaning up after a peer uses: never another user's."""
    try:
        fd, _ = _open_checked(name, os.O_RDONLY, owner_uid)
    except TensorTransportError:
        return False
    os.close(fd)
    try:
        return unlink_segment(name)
    except PermissionError:
        return False


def socket_group(endpoint_path: str | None) -> int | None:
    """The group of the daemon's socket file."""
    if not endpoint_path:
        return None
    try:
        return os.stat(endpoint_path).st_gid
    except OSError:
        return None


def share_group(endpoint_path: str | None) -> int | None:
    """The group a client's segments need so that the daemon can map them: None
    (mode 0600) when the daemon is root or this user; else the socket's group."""
    if not endpoint_path:
        return None
    try:
        st = os.stat(endpoint_path)
    except OSError:
        return None
    return None if st.st_uid in (0, os.geteuid()) else st.st_gid


# ---------------------------------------------------------------- dtypes


def dtype_name(dtype: Any) -> str:
    """Wire name of a torch or numpy dtype ("float32", ...)."""
    text = str(dtype)
    name = text[6:] if text.startswith("torch.") else text
    if name not in DTYPE_BYTES:
        raise TensorTransportError(f"dtype {text} cannot cross processes; use one of {sorted(DTYPE_BYTES)}")
    return name


def torch_dtype(name: str):
    import torch

    if name not in DTYPE_BYTES:
        raise TensorTransportError(f"unknown dtype {name!r}")
    return getattr(torch, name)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    if any(d < 0 for d in shape):
        raise TensorTransportError(f"negative dimension in shape {list(shape)}")
    return DTYPE_BYTES[dtype] * math.prod(shape)


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


# ------------------------------------------------------------ pack/read


def pack(tensors: Sequence[Any], prefix: str = "na", *, group: int | None = None,
         owner: int | None = None, reserve: bool = False) -> tuple[Segment | None, list[p.TensorRef]]:
    """Copy CPU tensors (torch or numpy) into one new segment (``group``,
    ``owner`` and ``reserve`` as :func:`create_segment`). Returns the segment (None when every
    tensor is empty) and one ref per tensor. The caller closes the segment; the
    protocol says who unlinks it."""
    metas = []
    offset = 0
    for t in tensors:
        if _is_torch(t):
            if t.device.type != "cpu":
                t = t.detach().to("cpu")
            t = t.detach().contiguous()
        else:
            import numpy as np

            t = np.asarray(t, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        name = dtype_name(t.dtype)
        shape = [int(d) for d in t.shape]
        nbytes = _nbytes(name, shape)
        metas.append((t, name, shape, offset, nbytes))
        offset = _align(offset + nbytes)
    if not any(m[4] for m in metas):
        return None, [p.TensorRef(dtype=n, shape=s) for _, n, s, _, _ in metas]
    seg = create_segment(offset, prefix, group=group, owner=owner, reserve=reserve)
    try:
        refs = []
        for t, name, shape, off, nbytes in metas:
            if nbytes:
                _write(seg, t, off, nbytes)
            refs.append(p.TensorRef(dtype=name, shape=shape, shm=seg.name if nbytes else "",
                                    offset=off, nbytes=nbytes))
    except BaseException:
        seg.close()
        seg.unlink()
        raise
    return seg, refs


def _write(seg: Segment, t: Any, offset: int, nbytes: int) -> None:
    dst = seg.buf[offset:offset + nbytes]
    if _is_torch(t):
        import torch

        # Through uint8 bytes: bfloat16 and bool have no buffer-protocol format of their own.
        src = t.reshape(-1).view(torch.uint8) if t.numel() else t
        torch.frombuffer(dst, dtype=torch.uint8, count=nbytes).copy_(src)
    else:
        dst[:] = t.reshape(-1).view("uint8").data


def _segment_of(ref: p.TensorRef, segments: dict[str, Segment]) -> Segment:
    """The mapped segment ``ref`` lies in, once its dtype, size and bounds are checked."""
    seg = segments.get(ref.shm)
    if seg is None:
        raise TensorTransportError(f"segment {ref.shm!r} is not attached")
    if ref.dtype not in DTYPE_BYTES:
        raise TensorTransportError(f"unknown dtype {ref.dtype!r}")
    expected = _nbytes(ref.dtype, ref.shape)
    if ref.nbytes != expected:
        raise TensorTransportError(f"tensor ref says {ref.nbytes} bytes but {ref.dtype}{ref.shape} needs {expected}")
    if ref.offset < 0 or ref.offset + ref.nbytes > seg.size:
        raise TensorTransportError(f"tensor ref [{ref.offset}, +{ref.nbytes}) lies outside segment "
                                   f"{seg.name!r} of {seg.size} bytes")
    return seg


def attach_all(refs: Sequence[p.TensorRef], *, owner_uid: int | None = None) -> dict[str, Segment]:
    """Map every segment the refs name (once each); with ``owner_uid``, only that uid's."""
    segments: dict[str, Segment] = {}
    try:
        for ref in refs:
            if ref.shm and ref.shm not in segments:
                segments[ref.shm] = attach_segment(ref.shm, owner_uid=owner_uid)
    except BaseException:
        for seg in segments.values():
            seg.close()
        raise
    return segments


def views(refs: Sequence[p.TensorRef], segments: dict[str, Segment]) -> list:
    """Zero-copy torch tensors over mapped segments (keep them open meanwhile)."""
    import torch

    out = []
    for ref in refs:
        dtype = torch_dtype(ref.dtype)
        if not ref.nbytes:
            out.append(torch.empty(ref.shape, dtype=dtype))
            continue
        raw = torch.frombuffer(_segment_of(ref, segments).buf, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
        out.append(raw.view(dtype).reshape(ref.shape))
    return out


def arrays(refs: Sequence[p.TensorRef], segments: dict[str, Segment]) -> list:
    """Zero-copy numpy arrays over mapped segments (keep them open meanwhile)."""
    import numpy as np

    out = []
    for ref in refs:
        if ref.dtype == "bfloat16":
            raise TensorTransportError("numpy has no bfloat16; read this output as torch")
        if not ref.nbytes:
            out.append(np.empty(ref.shape, dtype=ref.dtype))
            continue
        out.append(np.ndarray(ref.shape, dtype=ref.dtype, buffer=_segment_of(ref, segments).buf, offset=ref.offset))
    return out


def take(refs: Sequence[p.TensorRef], *, like: str = "torch", unlink: bool = True) -> list:
    """Copy tensors out of their segments, then close and (by default) unlink
    those segments: how a client reads outputs it now owns. A segment this
    user may not unlink (an older daemon made it) is left to the daemon."""
    segments = attach_all(refs)
    try:
        if like == "torch":
            return [t.clone() for t in views(refs, segments)]
        if like == "numpy":
            return [a.copy() for a in arrays(refs, segments)]
        raise ValueError(f"like must be 'torch' or 'numpy', got {like!r}")
    finally:
        for seg in segments.values():
            seg.close()
            if unlink:
                with contextlib.suppress(PermissionError):
                    seg.unlink()


def discard(refs: Sequence[p.TensorRef], *, owner_uid: int | None = None) -> None:
    """Unlink the segments the refs name, without reading them; with ``owner_uid``,
    only those that uid owns (a peer's inputs: never another user's segment)."""
    for name in {r.shm for r in refs if r.shm}:
        if owner_uid is None:
            unlink_segment(name)
        else:
            unlink_if_owned(name, owner_uid)
