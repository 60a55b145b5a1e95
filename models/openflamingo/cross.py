"""open_flamingo's gated cross-attention block (`GatedCrossAttentionBlock`, keys
`lang_encoder.transformer.blocks.{i}.gated_cross_attn_layer.*`): `attn` (`MaskedCrossAttention`:
`norm`, `to_q`, `to_kv`, `to_out`, no biases, `cross_heads` heads of `cross_dim_head`), `attn_gate`,
`ff` (LayerNorm, Linear, GELU, Linear) and `ff_gate`:

    x = x + tanh(attn_gate) * attn(x, frames);  x = x + tanh(ff_gate) * ff(x)

Which frames a text row sees is the media mask the attention hooks are handed (`q_vis`, `k_frame`):
lvx's default is every frame whose `<image>` is at or before the row (open_flamingo's
`only_attend_immediate_media=False`); a row that sees no frame gets no attention output, as
open_flamingo's published masking gives it. The feed-forward runs on every row, frames or not.
"""

from __future__ import annotations

import torch
from torch import nn

from .perceiver import feed_forward


class MaskedCrossAttention(nn.Module):
    def __init__(self, dim: int, dim_visual: int, dim_head: int, heads: int):
        super().__init__()
        self.heads, inner = heads, dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim_visual, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def visual_kv(self, media: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (1, S, heads, dim_head) of visual tokens media (1, S, dim_visual)."""
        k, v = self.to_kv(media).chunk(2, dim=-1)
        return k.unflatten(-1, (self.heads, -1)), v.unflatten(-1, (self.heads, -1))


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, dim: int, dim_visual: int, dim_head: int, heads: int, ff_mult: int):
        super().__init__()
        self.attn = MaskedCrossAttention(dim, dim_visual, dim_head, heads)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ff = feed_forward(dim, ff_mult)
        self.ff_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, step, layer: int) -> torch.Tensor:
        """x (1, L, dim) through the block, its attention through `step.hooks.visual` (no frames:
        `step.visual` None, the attention adds nothing)."""
        if step.visual is not None:
            attn = self.attn
            q = attn.to_q(attn.norm(x)).unflatten(-1, (attn.heads, -1))
            out, _ = step.hooks.visual(q, step, layer)
            x = x + attn.to_out(out.to(x.dtype).flatten(2)) * self.attn_gate.tanh()
        return x + self.ff(x) * self.ff_gate.tanh()
