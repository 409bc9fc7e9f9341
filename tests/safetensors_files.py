"""A small writer of safetensors files, for the tests (the daemon only reads them:
:mod:`ctxpool.safetensors`, whose layout this writes)."""

from __future__ import annotations

import json
import struct

import torch

from ctxpool.safetensors import DTYPES, SafetensorsError

_CODES = {dtype: code for code, dtype in DTYPES.items()}


def save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file."""
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
