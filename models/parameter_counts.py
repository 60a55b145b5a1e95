"""Parameters of a model by part, counted the one way every family's `parameter_counts` uses: on
the meta device (nothing allocated), parameters only (a buffer such as a RoPE table is made, not
loaded, and is no weight)."""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

# the parts every family reports (`Family.parameter_counts`)
PARTS = ("vision", "projector", "language", "embedding")


def count_by_part(build: Callable[[], nn.Module], parts: Mapping[str, str]) -> dict[str, int]:
    """{part: parameters} of the model `build()` makes, on the meta device; `parts` maps each of
    PARTS to its submodule's path (the embedding table: a lookup, no FLOPs)."""
    if set(parts) != set(PARTS):
        raise ValueError(f"parts must be {PARTS}, not {tuple(parts)}")
    with torch.device("meta"):
        model = build()
    return {
        part: sum(p.numel() for p in model.get_submodule(path).parameters())
        for part, path in parts.items()
    }
