"""The published Llama-3.2-Vision checkpoint layout: its safetensors keys and their shapes, computed
from config.json (the module tree of `MllamaModel` carries the same names), and the check of a
folder's tensors against it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import MllamaConfig
from .modeling import MllamaModel


class CheckpointError(RuntimeError):
    """A checkpoint folder that is not the published layout (one line naming what is wrong)."""


def published_shapes(cfg: MllamaConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the published checkpoint with its shape."""
    with torch.device("meta"):
        model = MllamaModel(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def safetensors_files(d: Path) -> dict[str, Path]:
    """key -> file, from `model.safetensors.index.json` when there is one, else the one file."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: d / f for k, f in weight_map.items()}
    single = d / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{d} holds no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def check_layout(files: dict[str, Path], cfg: MllamaConfig) -> None:
    """Raise a CheckpointError for a missing, unknown or misshapen key."""
    want = published_shapes(cfg)
    missing = sorted(set(want) - set(files))
    if missing:
        raise CheckpointError(
            f"checkpoint lacks {len(missing)} keys of the layout, e.g. {missing[0]}"
        )
    unknown = sorted(set(files) - set(want))
    if unknown:
        raise CheckpointError(
            f"checkpoint has {len(unknown)} keys the layout lacks, e.g. {unknown[0]}"
        )
    for key, path in files.items():
        with safe_open(str(path), "pt") as f:
            shape = tuple(f.get_slice(key).get_shape())
        if shape != want[key]:
            raise CheckpointError(
                f"{key} is {shape} in the checkpoint, config.json implies {want[key]}"
            )
