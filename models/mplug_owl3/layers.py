"""Small building blocks shared by the language model and the hyper layers: RMSNorm, RoPE,
SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Qwen2 RMSNorm: normalise in float32, cast back to the input dtype, then scale by the
    weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Functional RMSNorm (used on the visual stream with a hyper layer's own input_layernorm
    weight)."""
    dtype = x.dtype
    x32 = x.to(torch.promote_types(dtype, torch.float32))  # float32 (float64 stays float64)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (shape positions.shape + (head_dim,)) for any integer positions.

    NeoX rotate-half layout: inv_freq_i = theta^(-2i/d), angles = cat(freqs, freqs). Computed on the
    fly, so there is no table and no 32768 limit (the official code indexes a table of
    max_position_embeddings rows). Angles are float32 like the official code (and HF Qwen2); float64
    models pass dtype=torch.float64 for exact tests.
    """
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (
        theta
        ** (
            torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).to(dtype)
            / head_dim
        )
    )
    freqs = positions.to(dtype)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fp32: bool = False
) -> torch.Tensor:
    """Rotate x (B, L, heads, D) by cos/sin (B, L, D) (broadcast over heads).

    fp32=False: cos/sin are cast to x's dtype and applied in it (Qwen2's text RoPE).
    fp32=True: applied in cos's dtype (float32, or float64) and cast back (the official MI-RoPE on
    visual keys).
    """
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if fp32:
        xf = x.to(cos.dtype)
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class SwiGLU(nn.Module):
    """Qwen2 MLP: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
