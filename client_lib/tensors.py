"""Tensors across processes without pickling: POSIX shared memory plus
msgspec metadata (:class:`client_lib.protocol.TensorRef`).

A sender packs its tensors into one new segment (64-byte aligned, C order)
and sends the refs; the receiver maps the segment and reads zero-copy views.
Whoever the protocol names as owner unlinks the segment: the client owns its
input segment and, once answered, the output segment the worker made.

Segments are not tracked by :mod:`multiprocessing`'s resource tracker, which
would unlink a segment when the process that merely mapped it exits. Their
mode is 0660 and, where the creator may, their group is that of the daemon's
socket, so a client and the daemon's workers (different users, one group)
can both map them.

Neither torch nor numpy is required to import this module; each function
uses whichever the caller's tensors are.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
from typing import Any, Sequence

from client_lib import protocol as p

try:  # CPython's own binding of shm_open/shm_unlink (what multiprocessing uses)
    import _posixshmem
except ImportError:  # pragma: no cover - not on Linux
    _posixshmem = None

ALIGN_BYTES = 64
MAX_NAME_CHARS = 200
_counter = itertools.count(1)

# Element sizes of the dtypes that may cross; names are torch's without "torch.".
DTYPE_BYTES = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
    "complex64": 8, "complex128": 16,
}


class TensorTransportError(ValueError):
    """A tensor that cannot cross (unsupported dtype, bad ref, missing segment)."""


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
            try:
                self._mmap.close()
            except BufferError:
                pass

    def unlink(self) -> None:
        """Remove the name (the memory goes when the last mapping does). Idempotent."""
        unlink_segment(self.name)

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size} bytes)"


def _shm_open(name: str, flags: int, mode: int) -> int:
    if _posixshmem is not None:
        return _posixshmem.shm_open("/" + name, flags, mode)
    return os.open(os.path.join("/dev/shm", name), flags, mode)  # pragma: no cover


def unlink_segment(name: str) -> bool:
    """Remove a segment by name; False if it was already gone."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        else:  # pragma: no cover
            os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        return False
    return True


def segment_name(prefix: str = "na") -> str:
    """A fresh segment name: prefix, pid, a counter and randomness (never reused)."""
    return f"{prefix}-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"


def create_segment(nbytes: int, prefix: str = "na", *, name: str | None = None, group: int | None = None) -> Segment:
    """A new segment of ``nbytes`` (at least 1), mode 0660, group ``group`` if given and allowed."""
    name = name or segment_name(prefix)
    if not name or "/" in name or len(name) > MAX_NAME_CHARS:
        raise TensorTransportError(f"bad shared-memory segment name {name!r}")
    size = max(1, int(nbytes))
    fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
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


def attach_segment(name: str) -> Segment:
    """Map an existing segment; :class:`TensorTransportError` if there is none."""
    if not name or "/" in name or len(name) > MAX_NAME_CHARS:
        raise TensorTransportError(f"bad shared-memory segment name {name!r}")
    try:
        fd = _shm_open(name, os.O_RDWR, 0)
    except FileNotFoundError:
        raise TensorTransportError(f"no shared-memory segment {name!r} (already unlinked?)") from None
    except PermissionError:
        raise TensorTransportError(f"shared-memory segment {name!r} is not readable by uid {os.geteuid()} "
                                   "(the client and the daemon must share the socket's group)") from None
    size = os.fstat(fd).st_size
    return Segment(name, fd, size)


def socket_group(endpoint_path: str | None) -> int | None:
    """The group of the daemon's socket file: the group segments should carry."""
    if not endpoint_path:
        return None
    try:
        return os.stat(endpoint_path).st_gid
    except OSError:
        return None


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
    n = DTYPE_BYTES[dtype]
    for d in shape:
        if d < 0:
            raise TensorTransportError(f"negative dimension in shape {list(shape)}")
        n *= d
    return n


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


# ------------------------------------------------------------ pack/read


def pack(tensors: Sequence[Any], prefix: str = "na", *, group: int | None = None) -> tuple[Segment | None, list[p.TensorRef]]:
    """Copy CPU tensors (torch or numpy) into one new segment. Returns the
    segment (None when every tensor is empty) and one ref per tensor. The
    caller closes the segment; the protocol says who unlinks it."""
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
    seg = create_segment(offset, prefix, group=group)
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


def _check(ref: p.TensorRef, seg: Segment) -> None:
    expected = _nbytes(ref.dtype, ref.shape) if ref.dtype in DTYPE_BYTES else -1
    if expected < 0:
        raise TensorTransportError(f"unknown dtype {ref.dtype!r}")
    if ref.nbytes != expected:
        raise TensorTransportError(f"tensor ref says {ref.nbytes} bytes but {ref.dtype}{ref.shape} needs {expected}")
    if ref.offset < 0 or ref.offset + ref.nbytes > seg.size:
        raise TensorTransportError(f"tensor ref [{ref.offset}, +{ref.nbytes}) lies outside segment "
                                   f"{seg.name!r} of {seg.size} bytes")


def attach_all(refs: Sequence[p.TensorRef]) -> dict[str, Segment]:
    """Map every segment the refs name (once each)."""
    segments: dict[str, Segment] = {}
    try:
        for ref in refs:
            if ref.shm and ref.shm not in segments:
                segments[ref.shm] = attach_segment(ref.shm)
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
        seg = segments.get(ref.shm)
        if seg is None:
            raise TensorTransportError(f"segment {ref.shm!r} is not attached")
        _check(ref, seg)
        raw = torch.frombuffer(seg.buf, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
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
        seg = segments.get(ref.shm)
        if seg is None:
            raise TensorTransportError(f"segment {ref.shm!r} is not attached")
        _check(ref, seg)
        out.append(np.ndarray(ref.shape, dtype=ref.dtype, buffer=seg.buf, offset=ref.offset))
    return out


def take(refs: Sequence[p.TensorRef], *, like: str = "torch", unlink: bool = True) -> list:
    """Copy tensors out of their segments, then close and (by default) unlink
    those segments: how a client reads outputs it now owns."""
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
                seg.unlink()


def discard(refs: Sequence[p.TensorRef]) -> None:
    """Unlink the segments the refs name, without reading them."""
    for name in {r.shm for r in refs if r.shm}:
        unlink_segment(name)
