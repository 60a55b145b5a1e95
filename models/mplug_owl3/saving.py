"""mPLUG-Owl3's finetuned weights in the published layout (`Family.save_weights`): adapters merged
into their Linears, and the vision weights the model never loads copied from the checkpoint it was
trained from, so the result is a complete official checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .loader import CheckpointInfo, inspect_checkpoint, load_tensors
from .training import is_adapter


def official_state_dict(
    model: nn.Module, dtype: Optional[torch.dtype] = None
) -> dict[str, torch.Tensor]:
    """The model's weights under the official keys, adapters merged (`merged_weight()` for their
    Linear's weight, their own tensors dropped), detached, on CPU, contiguous."""
    out: dict[str, torch.Tensor] = {}
    adapters = {name: m for name, m in model.named_modules() if is_adapter(m)}
    for key, t in model.state_dict().items():
        owner = next((n for n in adapters if key.startswith(n + ".")), None)
        if owner is not None:
            rest = key[len(owner) + 1 :]
            if not rest.startswith("base."):
                continue
            key = f"{owner}.{rest.removeprefix('base.')}"
            if rest == "base.weight":
                t = adapters[owner].merged_weight()
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[key] = t.to("cpu").contiguous()
    return out


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
