"""The MPT text model (`lang_encoder.transformer.*` keys, MPT's names): `wte`, `blocks.{i}` (each
open_flamingo's `FlamingoLayer`: its `gated_cross_attn_layer` (`cross.py`) or none, then the MPT
block `decoder_layer`: `norm_1`, `attn.Wqkv`, `attn.q_ln`/`k_ln` where `qk_ln`, `attn.out_proj`,
`norm_2`, `ffn.up_proj`, `ffn.down_proj`), `norm_f`; the logits are the final hidden states times
`wte` (tied, as both released MPTs are).

ALiBi: no positions in the embeddings; head h of every layer adds slope_h * (key position - query
position) to its scores (slopes 2^(-alibi_bias_max * (h+1) / H), MPT's `gen_slopes`). Softmax needs
the bias only up to a constant per query row, so this equals MPT's published bias
slope_h * (key position - last position). The attention hooks get the slopes with the forward's
step (`step.alibi`) and the kernels add the bias from the same global positions the causal mask is
made of, so the engine's sharded text attention adds it exactly as one process does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lvx_kernels.feed import REPLICATED, Feed

from ..steps import AttentionHooks, TextKVCache
from .config import MptConfig


@dataclass
class FlamingoStep:
    """What one forward hands every layer, and every layer its attention hooks."""

    hooks: AttentionHooks
    cache: Optional[TextKVCache] = None
    visual: Any = None  # a `VisualStep`; None: no frames (the cross layers' attention adds 0)
    feed: Feed = REPLICATED
    alibi: Optional[torch.Tensor] = None  # (heads,) float32 ALiBi slopes of the text attention


def alibi_slopes(heads: int, bias_max: int) -> torch.Tensor:
    """MPT's ALiBi slopes (float32), as `gen_slopes` makes them (for a head count that is not a
    power of two: the slopes of the next power, odd ones first)."""
    n = 2 ** math.ceil(math.log2(heads))
    m = torch.arange(1, n + 1, dtype=torch.float32) * (bias_max / n)
    slopes = 1.0 / torch.pow(2, m)
    if n != heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:heads]
    return slopes


def layer_norm(width: int, cfg: MptConfig) -> nn.LayerNorm:
    return nn.LayerNorm(width, eps=cfg.layer_norm_eps, bias=not cfg.no_bias)


class MptAttention(nn.Module):
    def __init__(self, cfg: MptConfig):
        super().__init__()
        d, bias = cfg.d_model, not cfg.no_bias
        self.cfg, self.heads = cfg, cfg.n_heads
        self.Wqkv = nn.Linear(d, 3 * d, bias=bias)
        if cfg.qk_ln:
            self.q_ln = layer_norm(d, cfg)
            self.k_ln = layer_norm(d, cfg)
        self.out_proj = nn.Linear(d, d, bias=bias)

    def forward(self, h: torch.Tensor, step: FlamingoStep, layer: int) -> torch.Tensor:
        qkv = self.Wqkv(h)
        if self.cfg.clip_qkv:
            qkv = qkv.clamp(min=-self.cfg.clip_qkv, max=self.cfg.clip_qkv)
        q, k, v = qkv.chunk(3, dim=-1)
        if self.cfg.qk_ln:
            q, k = self.q_ln(q), self.k_ln(k)
        if self.cfg.softmax_scale is not None:  # the kernels scale by 1 / sqrt(head size)
            q = q * (self.cfg.softmax_scale * math.sqrt(self.cfg.head_dim))
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in (q, k, v))
        if step.cache is not None:
            k, v = step.cache.update(layer, k, v)
        out, _ = step.hooks.text(q, k, v, step, layer)
        return self.out_proj(out.to(h.dtype).flatten(2))


class MptMLP(nn.Module):
    def __init__(self, cfg: MptConfig):
        super().__init__()
        d, bias = cfg.d_model, not cfg.no_bias
        self.up_proj = nn.Linear(d, cfg.expansion_ratio * d, bias=bias)
        self.down_proj = nn.Linear(cfg.expansion_ratio * d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class MptBlock(nn.Module):
    def __init__(self, cfg: MptConfig):
        super().__init__()
        self.norm_1 = layer_norm(cfg.d_model, cfg)
        self.attn = MptAttention(cfg)
        self.norm_2 = layer_norm(cfg.d_model, cfg)
        self.ffn = MptMLP(cfg)

    def forward(self, x: torch.Tensor, step: FlamingoStep, layer: int) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), step, layer)
        return x + self.ffn(self.norm_2(x))


class FlamingoLayer(nn.Module):
    """open_flamingo's `FlamingoLayer`: the gated cross-attention (if any) runs before the
    decoder block."""

    def __init__(self, cross: Optional[nn.Module], block: MptBlock):
        super().__init__()
        self.gated_cross_attn_layer = cross
        self.decoder_layer = block

    def forward(self, x: torch.Tensor, step: FlamingoStep, layer: int) -> torch.Tensor:
        if self.gated_cross_attn_layer is not None:
            x = self.gated_cross_attn_layer(x, step, layer)
        return self.decoder_layer(x, step, layer)


class MptTransformer(nn.Module):
    def __init__(self, cfg: MptConfig, cross: Callable[[int], Optional[nn.Module]]):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            FlamingoLayer(cross(i), MptBlock(cfg)) for i in range(cfg.n_layers)
        )
        self.norm_f = layer_norm(cfg.d_model, cfg)
        slopes = alibi_slopes(cfg.n_heads, cfg.alibi_bias_max) if cfg.alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    def forward(
        self, ids: torch.Tensor, step: FlamingoStep, runs: Mapping[int, Callable] = {}
    ) -> torch.Tensor:
        """ids (1, L) -> hidden states (1, L, d_model) after `norm_f`; `runs[i]`, where given,
        runs block i (`runs[i](layer, x, step, i)`: a checkpointed run for finetuning)."""
        x = self.wte(ids)
        for i, layer in enumerate(self.blocks):
            x = runs[i](layer, x, step, i) if i in runs else layer(x, step, i)
        return self.norm_f(x)


class MptForCausalLM(nn.Module):
    """`lang_encoder`: the MPT transformer and its tied head."""

    def __init__(self, cfg: MptConfig, cross: Callable[[int], Optional[nn.Module]]):
        super().__init__()
        self.transformer = MptTransformer(cfg, cross)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        head = getattr(self, "lm_head", None)
        return head(x) if head is not None else F.linear(x, self.transformer.wte.weight)
