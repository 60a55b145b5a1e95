"""PyTorch weight files (`torch.save`'s zip: `.pt`, `.bin`, `.pth`) read as tensors only, with
`torch.load(weights_only=True)`, so no pickle a file carries ever runs, and memory-mapped, so only
the tensors used are read. A family whose published checkpoint ships such files lists their keys
with `torch_file_keys` in its `Family.weight_files`; the fit check's shapes (`weight_shapes`) and
the features' fingerprint (`fingerprint`) then read them beside safetensors files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from .safetensors_folder import CheckpointError, tensor_shapes

SUFFIXES = (".pt", ".bin", ".pth")
TRAINING_STATE = "model_state_dict"  # a training checkpoint's weights (open_flamingo's)


def is_torch_file(f: Path) -> bool:
    return Path(f).suffix in SUFFIXES


def torch_tensors(f: Path) -> dict[str, torch.Tensor]:
    """The flat {key: tensor} a weight file holds (a training checkpoint's `model_state_dict`), on
    the CPU (memory-mapped where the file's format allows); anything else is a one-line
    CheckpointError."""
    try:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - every unreadable file becomes one line
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(
            f"{f} is not a PyTorch weight file of tensors only ({type(e).__name__}: {why})"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get(TRAINING_STATE), dict):
        obj = obj[TRAINING_STATE]
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise CheckpointError(f"{f} holds {type(obj).__name__}, not a flat dict of tensors")
    return dict(obj)


def torch_file_keys(files: Iterable[Path]) -> dict[str, Path]:
    """key -> the weight file holding it, over `files` (a key in two files is an error)."""
    out: dict[str, Path] = {}
    for f in files:
        for k in torch_tensors(f):
            if k in out:
                raise CheckpointError(f"{k} is in both {out[k].name} and {Path(f).name}")
            out[k] = Path(f)
    return out


def weight_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """key -> shape over safetensors and PyTorch weight files alike (`Family.weight_files`' map),
    no weights read."""
    torch_keys = {k: f for k, f in files.items() if is_torch_file(f)}
    out = tensor_shapes({k: f for k, f in files.items() if k not in torch_keys})
    by_file: dict[Path, list[str]] = {}
    for k, f in torch_keys.items():
        by_file.setdefault(f, []).append(k)
    for f, keys in by_file.items():
        out.update(_torch_shapes(f, keys))
    return out


def _torch_shapes(f: Path, keys: Iterable[str]) -> dict[str, tuple[int, ...]]:
    tensors = torch_tensors(f)
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise CheckpointError(f"{f} does not hold {missing[0]}")
    return {k: tuple(tensors[k].shape) for k in keys}


def torch_digest(tensors: dict[str, torch.Tensor], keys: list[str], update) -> None:
    """Feed (name, dtype, shape, bytes) of `keys` of a weight file's `tensors` (`torch_tensors`),
    in key order, to `update` (a hash's), as `fingerprint` does for a safetensors file. The bytes
    are handed over in place, not copied."""
    for k in sorted(keys):
        t = tensors[k]
        update(json.dumps([k, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode())
        update(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
