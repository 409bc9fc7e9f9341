"""A reader for the safetensors format, without the package. The format: 8 bytes
little-endian header length N, N bytes of JSON ``{name: {"dtype": "F32", "shape": [..], "data_offsets":
[begin, end]}, "__metadata__": {..}}``, then the raw little-endian tensor bytes, offsets counted from the
header's end. The file is mapped copy-on-write: reading copies nothing until the caller copies the tensors.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
from typing import BinaryIO

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file; the message says where it
    breaks, never with bytes or numbers read from the file before its header
    parsed (it may not be a safetensors file at all, nor the caller's to read)."""


def load_file(f: BinaryIO, name: str) -> dict[str, torch.Tensor]:
    """Tensors of the safetensors file open as ``f`` (``name`` for messages), zero-copy
    over a copy-on-write mapping of it. ``f`` may be closed once this returns."""
    if sys.byteorder != "little":
        raise SafetensorsError("safetensors data is little-endian; this machine is not")
    size_bytes = os.fstat(f.fileno()).st_size
    if size_bytes < 8:
        raise SafetensorsError(f"{name}: not a safetensors file (shorter than the 8-byte header length)")
    (header_bytes,) = struct.unpack("<Q", _read_exactly(f, 8, name))
    if header_bytes > min(MAX_HEADER_BYTES, size_bytes - 8):
        raise SafetensorsError(f"{name}: not a safetensors file (its header length does not fit the file)")
    try:
        header = json.loads(_read_exactly(f, header_bytes, name))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise SafetensorsError(f"{name}: not a safetensors file (the header is not JSON)") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{name}: not a safetensors file (the header is not a JSON object)")
    data_start = 8 + header_bytes
    data_bytes = size_bytes - data_start
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if data_bytes else None
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(name, key, info)
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        if end - begin != nbytes or not 0 <= begin <= end <= data_bytes:
            raise SafetensorsError(f"{name}: tensor {_shown(key)} has data_offsets that do not match its dtype "
                                   "and shape, or lie outside the data")
        try:
            out[key] = _tensor(mapped, dtype, shape, nbytes, data_start + begin)
        except (RuntimeError, ValueError, OverflowError):  # a shape torch cannot lay out
            raise SafetensorsError(f"{name}: tensor {_shown(key)} has a bad shape") from None
    return out


def _tensor(mapped: mmap.mmap | None, dtype: torch.dtype, shape: list[int], nbytes: int, offset: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)
    if offset % dtype.itemsize:
        raw = raw.clone()  # an unaligned tensor: copy to an aligned one rather than read it misaligned
    return raw.view(dtype).reshape(shape)


def _read_exactly(f: BinaryIO, n: int, name: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise SafetensorsError(f"{name}: not a safetensors file (it ends inside its header)")
    return data


def _shown(key: object) -> str:
    """A tensor name for a message: bounded (a header may hold a megabyte-long name)."""
    text = repr(key)
    return text if len(text) <= 80 else text[:77] + "..."


def _entry(name: str, key: str, info: object) -> tuple[torch.dtype, list[int], int, int]:
    if not isinstance(info, dict):
        raise SafetensorsError(f"{name}: entry {_shown(key)} is not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str) or code not in DTYPES:
        raise SafetensorsError(f"{name}: tensor {_shown(key)} has a dtype this reader does not support; "
                               f"supported: {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 2 ** 62 for d in shape):
        raise SafetensorsError(f"{name}: tensor {_shown(key)} has a bad shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise SafetensorsError(f"{name}: tensor {_shown(key)} has bad data_offsets")
    return DTYPES[code], shape, offsets[0], offsets[1]
