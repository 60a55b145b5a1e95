"""LoRA adapters for finetuning, without peft: `LoRALinear` wraps one nn.Linear, `add_lora` wraps
the attention projections of the language model (the visual v_kv_proj of every hyper layer included,
and the Linear inside the 7B-240728 G1 `gate_proj = Sequential(Linear, Sigmoid)`, so its merged
weight keeps the official key `gate_proj.0.weight`).

Both the training loop (which creates the adapters) and the checkpoint writer (which merges them
into the official weights) use this module.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "v_kv_proj", "gate_proj")


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
        w = self.base.weight
        return (w.float() + self.scale * (self.lora_B.float() @ self.lora_A.float())).to(w.dtype)


def add_lora(
    model: nn.Module,
    rank: int,
    alpha: Optional[float] = None,
    targets: tuple[str, ...] = LORA_TARGETS,
) -> list[str]:
    """Wrap every `targets` Linear of the language model's attention in a `LoRALinear`; returns
    their names."""
    if rank < 1:
        raise ValueError("--lora must be a positive rank (e.g. --lora 16)")
    alpha = float(alpha if alpha is not None else 2 * rank)
    wrapped = []
    for name, mod in list(model.language_model.named_modules()):
        if not name.endswith("self_attn"):
            continue
        for t in targets:
            owner, attr = mod, t
            if isinstance(
                getattr(mod, t, None), nn.Sequential
            ):  # gate_proj: wrap its Linear, index 0
                owner, attr = getattr(mod, t), "0"
            lin = getattr(owner, attr, None)
            if isinstance(lin, nn.Linear):
                setattr(owner, attr, LoRALinear(lin, rank, alpha))
                wrapped.append(f"language_model.{name}.{t}" + (".0" if owner is not mod else ""))
    return wrapped
