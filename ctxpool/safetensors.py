"""A reader (and a small writer) for the safetensors format, without the package.

The format: 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}``,
then the raw little-endian tensor bytes; offsets count from the end of the
header. The file is mapped copy-on-write, so reading costs no copy until the
caller copies the tensors somewhere (the model store copies them into shared
memory once).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file; the message says where it breaks."""


def load(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, zero-copy over a copy-on-write mapping of it."""
    if sys.byteorder != "little":
        raise SafetensorsError("safetensors data is little-endian; this machine is not")
    with open(path, "rb") as f:
        size_bytes = os.fstat(f.fileno()).st_size
        if size_bytes < 8:
            raise SafetensorsError(f"{path}: {size_bytes} bytes is too short for a safetensors header")
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        if header_bytes > min(MAX_HEADER_BYTES, size_bytes - 8):
            raise SafetensorsError(f"{path}: header length {header_bytes} does not fit a file of {size_bytes} bytes "
                                   "(not a safetensors file?)")
        try:
            header = json.loads(f.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{path}: header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: header is not a JSON object")
        data_start = 8 + header_bytes
        data_bytes = size_bytes - data_start
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if data_bytes else None
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(path, name, info)
        nbytes = _element_bytes(dtype)
        for dim in shape:
            nbytes *= dim
        if end - begin != nbytes or not 0 <= begin <= end <= data_bytes:
            raise SafetensorsError(f"{path}: tensor {name!r} {info['dtype']}{shape} needs {nbytes} bytes but "
                                   f"data_offsets are [{begin}, {end}) in {data_bytes} bytes of data")
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=data_start + begin)
        if (data_start + begin) % _element_bytes(dtype):
            raw = raw.clone()  # an unaligned tensor: copy to an aligned one rather than read it misaligned
        out[name] = raw.view(dtype).reshape(shape)
    return out


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _entry(path: str, name: str, info: object) -> tuple[torch.dtype, list[int], int, int]:
    if not isinstance(info, dict):
        raise SafetensorsError(f"{path}: entry {name!r} is not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has dtype {code!r}; supported: {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SafetensorsError(f"{path}: tensor {name!r} has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise SafetensorsError(f"{path}: tensor {name!r} has bad data_offsets {offsets!r}")
    return DTYPES[code], shape, offsets[0], offsets[1]


def save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file (for tests, benchmarks and tools)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    blobs = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _CODES:
            raise SafetensorsError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors code here")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() \
            if tensor.numel() else b""
        header[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # as the reference writer does: data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
