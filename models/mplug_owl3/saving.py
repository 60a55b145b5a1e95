"""mPLUG-Owl3's finetuned weights in the published layout (`Family.save_weights`): adapters merged
into their Linears, and the vision weights the model never loads copied from the checkpoint it was
trained from, so the result is a complete official checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..adapters import merged_state_dict
from .loader import CheckpointInfo, inspect_checkpoint, load_tensors


def official_state_dict(
    model: nn.Module, dtype: Optional[torch.dtype] = None
) -> dict[str, torch.Tensor]:
    """The model's weights under the official keys, adapters merged (the module tree carries
    them)."""
    return merged_state_dict(model, dtype)


def _source_dtype(info: CheckpointInfo) -> torch.dtype:
    key = next(k for k in info.used_keys if k.endswith("embed_tokens.weight"))
    return load_tensors(info, [key])[key].dtype


def save_weights(
    model: nn.Module, base: str | Path, dtype: Optional[torch.dtype] = None
) -> dict[str, torch.Tensor]:
    """Every official key of a checkpoint made from `model`: its weights (adapters merged) and the
    vision weights it never loads, copied from `base`, the checkpoint it was trained from; `dtype`
    defaults to the base checkpoint's."""
    info = inspect_checkpoint(base)
    dtype = dtype or _source_dtype(info)
    weights = official_state_dict(model, dtype)
    extra = [k for k in info.ignored_keys if k not in weights and not k.endswith("lm_head.weight")]
    weights.update({k: v.to(dtype).contiguous() for k, v in load_tensors(info, extra).items()})
    return weights
