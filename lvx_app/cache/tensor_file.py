"""Reading a safetensors file's tensors without the safetensors extension's per-tensor leak.

`safetensors.torch.load_file` (0.8) keeps a few small Python objects alive for every tensor it
returns, so a server that reads cache entries all day grows without bound. The format is simple
(an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the bytes): each tensor's bytes are read straight into a new tensor of its own.

A tensor of its own, not a view of the file's bytes: PyTorch's allocator puts every tensor on a
64-byte boundary, and CPU kernels (MKL, oneDNN) round differently on data at another alignment, so
a view at the offset a tensor happens to have in the file (which moves with the header's length)
would give results that differ in the last bits from those of the tensor as it was made: a
finetuning run resumed on cached features would not repeat the uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at `path`, on the CPU, each in memory of its own
    (ValueError when the file is not one: a short or inconsistent header, an unknown dtype, a byte
    range outside the file)."""
    with open(path, "rb") as f:
        length = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        size = int.from_bytes(head, "little")
        if size > length - 8:
            raise ValueError("header longer than the file")
        header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        tensors = {}
        for name, info in header.items():
            tensor, start = _empty(name, info, length - 8 - size)
            f.seek(8 + size + start)
            _read_into(f, tensor)
            tensors[name] = tensor
    return tensors


def _empty(name: str, info: dict, data_bytes: int) -> tuple[torch.Tensor, int]:
    """(a new tensor of the dtype and shape `info` names, where its bytes start in the data)."""
    dtype = DTYPES.get(info.get("dtype"))
    start, end = info.get("data_offsets", (0, -1))
    shape = [int(n) for n in info.get("shape", ())]
    if dtype is None:
        raise ValueError(f"{name}: unknown dtype {info.get('dtype')!r}")
    count = 1
    for n in shape:
        count *= n
    if not 0 <= start <= end <= data_bytes or end - start != count * dtype.itemsize:
        raise ValueError(f"{name}: byte range {start}..{end} does not fit its shape {shape}")
    return torch.empty(shape, dtype=dtype), start


def _read_into(f: BinaryIO, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return
    target = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    if f.readinto(target) != len(target):
        raise ValueError("the file ends inside a tensor")
