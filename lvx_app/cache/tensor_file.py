"""Reading a safetensors file's tensors without the safetensors extension's per-tensor leak.

`safetensors.torch.load_file` (0.8) keeps a few small Python objects alive for every tensor it
returns, so a server that reads cache entries all day grows without bound. The format is simple
(an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the bytes): the file is read once and each tensor is a view of those bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    """Every tensor of the safetensors file at `path`, on the CPU (ValueError when the file is not
    one: a short or inconsistent header, an unknown dtype, a byte range outside the file)."""
    raw = bytearray(Path(path).read_bytes())
    if len(raw) < 8:
        raise ValueError("shorter than a safetensors header")
    size = int.from_bytes(raw[:8], "little")
    if size > len(raw) - 8:
        raise ValueError("header longer than the file")
    header = json.loads(raw[8 : 8 + size])
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    data = memoryview(raw)[8 + size :]
    return {name: _tensor(name, info, data) for name, info in header.items()}


def _tensor(name: str, info: dict, data: memoryview) -> torch.Tensor:
    dtype = DTYPES.get(info.get("dtype"))
    start, end = info.get("data_offsets", (0, -1))
    shape = [int(n) for n in info.get("shape", ())]
    if dtype is None:
        raise ValueError(f"{name}: unknown dtype {info.get('dtype')!r}")
    count = 1
    for n in shape:
        count *= n
    if not 0 <= start <= end <= len(data) or end - start != count * dtype.itemsize:
        raise ValueError(f"{name}: byte range {start}..{end} does not fit its shape {shape}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    chunk = data[start:end]
    if start % dtype.itemsize:  # a misaligned tensor: copied to bytes of its own
        chunk = bytearray(chunk)
    return torch.frombuffer(chunk, dtype=dtype).reshape(shape)
