"""The published Llama-3.2-Vision checkpoint layout: its safetensors keys and their shapes, computed
from config.json (the module tree of `MllamaModel` carries the same names), and the check of a
folder's tensors against it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint_folder import COMMON_HUB_FILES, resolve_checkpoint
from ..safetensors_folder import CheckpointError, tensor_shapes
from .config import MllamaConfig

# the files of a hub repo Llama-3.2-Vision reads (its `Family.hub_files`)
# the image processor's settings: preprocessor_config.json, or processor_config.json where
# transformers 5 saved the folder
HUB_FILES = (*COMMON_HUB_FILES, "preprocessor_config.json", "processor_config.json")


def resolve_folder(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local Llama-3.2-Vision folder, or a hub id with the files it reads downloaded."""
    return resolve_checkpoint(path_or_id, revision, HUB_FILES)


def published_shapes(cfg: MllamaConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the published checkpoint with its shape."""
    from .modeling import MllamaModel  # the layout is the module tree's names

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
