"""mPLUG-Owl3 with random weights at the benchmarks' two shapes: mPLUG-Owl3-7B-241101's (the
defaults of `Owl3Config`) and small ones that keep its 729 visual tokens per frame with a small
language model (the memory plan's RSS check, the small-shape benchmarks, the CPU rehearsal)."""

from __future__ import annotations

import dataclasses

import torch

from lvx_models.mplug_owl3.config import Owl3Config, SiglipVisionConfig

SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hyper_layers": [2, 4, 6, 8],
}
SMALL_VISION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
}


def small_config(base: Owl3Config | None = None) -> Owl3Config:
    """`base` (default: a 4,096-token vocabulary) with the small shapes."""
    base = base or Owl3Config(vocab_size=4096)
    return dataclasses.replace(base, **SMALL, vision=SiglipVisionConfig(**SMALL_VISION))


def model_config(shape: str) -> Owl3Config:
    """ "7b" (mPLUG-Owl3-7B-241101's config) or "small"."""
    return Owl3Config() if shape == "7b" else small_config()


def random_model(shape: str, device: torch.device, dtype: torch.dtype):
    """mPLUG-Owl3 at `shape` with random weights (the same in every process: seeded), allocated
    directly in `dtype` on `device` (built on meta and cast there, so the 7B never exists in float32
    on the GPU)."""
    from lvx_models.mplug_owl3.modeling import Owl3Model

    with torch.device("meta"):
        model = Owl3Model(model_config(shape))
    model = model.to(dtype).to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0 if "norm" in name else 0.0)
    model.fuse_projections()  # as the loader leaves a checkpoint
    return model.eval()
