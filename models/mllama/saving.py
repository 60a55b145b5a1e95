"""Llama-3.2-Vision's finetuned weights in the published layout (`Family.save_weights`): the model
holds every published key (`vision_model.*`, `multi_modal_projector.*`, `language_model.*`), so
they are its own weights with the adapters merged into their Linears, in the base checkpoint's
dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

from ..adapters import merged_state_dict
from ..safetensors_folder import CheckpointError, safetensors_files
from .checkpoint import published_shapes, resolve_folder

# safetensors header dtypes -> torch
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
PROBE = "language_model.model.embed_tokens.weight"  # whose dtype the checkpoint is stored in


def stored_dtype(base: str | Path) -> torch.dtype:
    """The dtype the checkpoint `base` stores its weights in (one header read, no weights)."""
    files = safetensors_files(resolve_folder(base))
    with safe_open(str(files[PROBE]), framework="pt") as f:
        name = f.get_slice(PROBE).get_dtype()
    if name not in DTYPES:
        raise CheckpointError(f"{PROBE} is stored as {name}, a dtype lvx does not write")
    return DTYPES[name]


def save_weights(
    model: nn.Module, base: str | Path, dtype: Optional[torch.dtype] = None
) -> dict[str, torch.Tensor]:
    """Every published key of a checkpoint made from `model` (an `MllamaVideoModel`), adapters
    merged; `dtype` defaults to the one `base`, the checkpoint it was trained from, is stored in."""
    weights = merged_state_dict(model.mllama, dtype or stored_dtype(base))
    want = published_shapes(model.config)
    if set(weights) != set(want):  # a key the loader would refuse: never write such a checkpoint
        odd = sorted(set(weights) ^ set(want))
        raise RuntimeError(f"{len(odd)} keys differ from the published layout, e.g. {odd[0]}")
    return weights
