"""The published Llama-3.2-Vision checkpoint layout: its safetensors keys and their shapes, computed
from config.json (the module tree of `MllamaModel` carries the same names), and the check of a
folder's tensors against it."""

from __future__ import annotations

from pathlib import Path

import torch

from ..safetensors_folder import CheckpointError, tensor_shapes
from .config import MllamaConfig
from .modeling import MllamaModel


def published_shapes(cfg: MllamaConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the published checkpoint with its shape."""
    with torch.device("meta"):
        model = MllamaModel(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


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
    for key, shape in tensor_shapes(files).items():  # each file's header read once
        if shape != want[key]:
            raise CheckpointError(
                f"{key} is {shape} in the checkpoint, config.json implies {want[key]}"
            )
