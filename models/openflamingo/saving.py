"""OpenFlamingo's finetuned weights (`Family.save_weights`): every tensor of the model under its
own names (open_flamingo's `Flamingo` names: `vision_encoder.*`, `perceiver.*`,
`lang_encoder.*`), adapters merged into their Linears, in the base checkpoint's dtype. The app
writes them as `model.safetensors` beside the base's other files; `checkpoint` reads such a folder
whole, in place of the three published weight files."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..adapters import merged_state_dict
from .checkpoint import resolve_parts
from .folder_config import dtype_of
from .loader import layout_shapes


def save_weights(
    model: nn.Module, base: str | Path, dtype: Optional[torch.dtype] = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint made from `model` (the engine's OpenFlamingo model), adapters
    merged; `dtype` defaults to the one `base`'s trained part is stored in."""
    weights = merged_state_dict(model.flamingo, dtype or dtype_of(resolve_parts(base)))
    want = layout_shapes(model.config)
    if set(weights) != set(want):  # a key the loader would refuse: never write such a checkpoint
        odd = sorted(set(weights) ^ set(want))
        raise RuntimeError(f"{len(odd)} keys differ from the model's layout, e.g. {odd[0]}")
    return weights
