"""LoRA adapters for finetuning, without peft: `LoRALinear` wraps one nn.Linear, `add_lora` has the
model put one on every Linear it names as a target (its attention projections, the visual K/V
projection included), so the model keeps its own layout and its saved weights have each adapter
merged under the Linear's own key (`merged_weight`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * x A^T B^T, with A ~ kaiming-uniform and B = 0 (the adapter starts
    as a no-op)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        w = base.weight
        # float32 master copies under bf16
        dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, device=w.device, dtype=dtype)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, device=w.device, dtype=dtype)
        )
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A, self.lora_B
        if not torch.is_autocast_enabled(x.device.type):
            a, b = a.to(x.dtype), b.to(x.dtype)
        return self.base(x) + F.linear(F.linear(x, a), b) * self.scale

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + scale * B A, summed in float32 (float64 for float64 weights, so a float64 model's
        merged weights are as exact as its forward)."""
        w = self.base.weight
        dt = torch.promote_types(w.dtype, torch.float32)
        return (w.to(dt) + self.scale * (self.lora_B.to(dt) @ self.lora_A.to(dt))).to(w.dtype)


def add_lora(model: Any, rank: int, alpha: Optional[float] = None) -> list[str]:
    """Wrap every Linear the model names as a LoRA target (`lora_targets`) in a `LoRALinear`;
    returns their names."""
    if rank < 1:
        raise ValueError("--lora must be a positive rank (e.g. --lora 16)")
    alpha = float(alpha if alpha is not None else 2 * rank)
    return model.wrap_linears(lambda linear: LoRALinear(linear, rank, alpha))
