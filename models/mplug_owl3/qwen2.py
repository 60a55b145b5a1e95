"""The Qwen2 decoder of mPLUG-Owl3 (`language_model.*` keys), with an explicit text KV cache.

Attention goes through injectable callables (`AttentionHooks`), so the engine can run it distributed
without this package importing torch.distributed. Every attention call returns (out, lse) in the
layout q (B, L, heads, D), k/v (B, S, kv_heads, D) -> out (B, L, heads, D), lse float32 (B, heads,
L). A hook gets the forward's `StepContext` and the calling layer's index with its tensors: what it
needs to know of the forward (how the ranks feed its tokens, its visual inputs) travels with it.

Text causality is by order: every cached token precedes every new token, and the new tokens are
causal among themselves (bottom-right aligned causal mask). That is what makes a second prefill on
top of a cache correct (the official code builds a top-left mask from `arange(q_len)` and gets it
wrong). Positions (for RoPE and for which frames a token sees) are absolute token indices.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lvx_kernels.feed import REPLICATED, Feed

from ..steps import AttentionHooks, TextKVCache
from .config import TRAINED_POSITIONS, Owl3Config
from .layers import Fusing, RMSNorm, Rope, SwiGLU, rope_cos_sin


@dataclass
class StepContext:
    """What one forward hands to every layer, and every layer to its attention hooks."""

    rope: Rope  # the forward's positions' cos/sin, in the model's dtype
    hooks: AttentionHooks
    cache: Optional[TextKVCache] = None
    visual: Any = None  # hyper.VisualStep or None; only hyper layers read it
    feed: Feed = REPLICATED  # how the ranks feed this forward's tokens


class Qwen2Attention(Fusing):
    """GQA self-attention with qkv bias and rotate-half RoPE; q, k and v in one matmul once fused
    (`fuse_projections`, the loader does it)."""

    FUSED = (("q_proj", "k_proj", "v_proj"),)

    def __init__(self, config: Owl3Config, layer_idx: int):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(h, self.num_heads * hd)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)

    def project(self, x: torch.Tensor, ctx: StepContext):
        """q (B, L, heads, D) RoPE'd; k, v of all cached + new tokens (B, S, kv_heads, D).

        q, k and v come side by side as heads of one (B, L, heads + 2 kv_heads, D) tensor, and q
        and k are rotated together."""
        b, l, _ = x.shape
        qkv = self.fused_call(self.FUSED[0], x)
        if qkv is None:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        rotated = self.num_heads + self.num_kv_heads
        qkv = qkv.view(b, l, rotated + self.num_kv_heads, self.head_dim)
        q, k = ctx.rope.apply(qkv[:, :, :rotated]).split((self.num_heads, self.num_kv_heads), 2)
        v = qkv[:, :, rotated:]
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_idx, k, v)
        return q, k, v

    def output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output (B, L, heads, D), in x's dtype: (B, L, hidden)."""
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return self.o_proj(out.flatten(2))  # L may be 0

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q, k, v = self.project(x, ctx)
        out, _ = ctx.hooks.text(q, k, v, ctx, self.layer_idx)
        return self.output(out, x)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: Owl3Config, layer_idx: int, self_attn: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """`language_model.model`: embed_tokens, layers, norm. `make_attention(i)` builds layer i's
    self_attn."""

    def __init__(self, config: Owl3Config, make_attention: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen2DecoderLayer(config, i, make_attention(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen2LM(nn.Module):
    """`language_model`: `.model` plus `.lm_head` (no `lm_head` parameter at all when embeddings are
    tied, so the state dict has exactly the keys a tied checkpoint stores)."""

    def __init__(
        self, config: Owl3Config, make_attention: Optional[Callable[[int], nn.Module]] = None
    ):
        super().__init__()
        self.config = config
        self.model = Qwen2Model(config, make_attention or (lambda i: Qwen2Attention(config, i)))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._warned_positions = False

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def resolve_positions(
        self,
        input_ids: torch.Tensor,
        positions: Optional[torch.Tensor],
        cache: Optional[TextKVCache],
    ) -> torch.Tensor:
        """Default positions continue the cache: cache.length, cache.length + 1, ... Warns once past
        32768."""
        b, l = input_ids.shape
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + l, device=input_ids.device).expand(b, l)
            last = start + l - 1
        else:  # read where the caller keeps them (the engine: on the host), then moved
            empty = self._warned_positions or positions.numel() == 0  # a rank without tokens
            last = None if empty else int(positions.max())
            positions = positions.to(input_ids.device).expand(b, l)
        if not self._warned_positions and last is not None and last >= TRAINED_POSITIONS:
            self._warned_positions = True
            warnings.warn(
                f"prompt reaches position {last}, beyond the {TRAINED_POSITIONS} positions "
                "mPLUG-Owl3 was trained on; answers may degrade (use fewer frames or a lower fps)",
                stacklevel=3,
            )
        return positions

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        hooks: AttentionHooks,
        cache: Optional[TextKVCache] = None,
        visual: Any = None,
        last_only: bool = False,
        feed: Feed = REPLICATED,
    ) -> torch.Tensor:
        """input_ids (B, L), absolute positions (B, L) -> logits (B, L, V) (or (B, 1, V) with
        last_only). `feed`: how the ranks feed these tokens, for the attention hooks."""
        cfg = self.config
        if (
            cache is not None
        ):  # a forward interrupted half-way (e.g. Ctrl-C while streaming) left some layers longer
            cache.truncate(cache.length)
        dtype = self.model.embed_tokens.weight.dtype
        rope = Rope(*rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype), dtype)
        ctx = StepContext(rope, hooks, cache, visual, feed)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, ctx)
        if last_only:
            x = x[:, -1:]
        return F.linear(self.model.norm(x), self.output_weight)
