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
from lvx_kernels.kernels import attention

from .config import TRAINED_POSITIONS, Owl3Config
from .layers import Fusing, RMSNorm, Rope, SwiGLU, rope_cos_sin

# called as text(q, k, v, step, layer) -> (out, lse): causal self-attention over the text cache
TextAttn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# called as visual(q, step, layer) -> (out, lse): attention to the layer's visual K/V
# (`step.visual.kv[layer]`) under the media mask (`step.visual.q_vis`, `step.visual.k_frame`)
VisualAttn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def default_text_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step, layer: int):
    """Local text self-attention: lvx_kernels.kernels.attention, causal bottom-right
    aligned."""
    return attention(q, k, v, causal=True)


def default_visual_attn(q: torch.Tensor, step, layer: int):
    """Local masked cross-attention to the layer's visual keys: query t sees key s iff k_frame[s] <
    q_vis[t]."""
    vis = step.visual
    k, v = vis.kv[layer]
    return attention(q, k, v, q_vis=vis.q_vis, k_frame=vis.k_frame)


@dataclass
class AttentionHooks:
    """The two attention callables every layer uses. Swap them to distribute attention
    (lvx_app/engine/parallelize.py); every rank must call `visual` in every hyper layer, also with
    an empty visual shard."""

    text: TextAttn = default_text_attn
    visual: VisualAttn = default_visual_attn


# Fewest tokens of room a text K/V buffer gets beyond what it must hold when it grows (tests shrink
# it).
MIN_KV_ROOM = 256


def kv_capacity(needed: int) -> int:
    """Buffer length for `needed` cached tokens: 1/8 more (at least MIN_KV_ROOM), so a question and
    its answer fit after the video prompt without a copy, and each copy buys room for many tokens
    (O(1) amortised)."""
    return needed + max(needed // 8, MIN_KV_ROOM)


class _LayerKV:
    """One layer's cached K/V, (B, S, kv_heads, D), in a buffer that grows by an eighth (no copy per
    token; doubling would keep two video prompts' worth of an hour's cache for the rest of the
    session)."""

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length + k.shape[1]
        if (
            self.k is None
            or n > self.k.shape[1]
            or self.k.dtype != k.dtype
            or self.k.device != k.device
        ):
            self._grow(kv_capacity(n), k, v)
        self.k[:, self.length : n] = k
        self.v[:, self.length : n] = v
        self.length = n
        return self.k[:, :n], self.v[:, :n]

    def _grow(self, cap: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New buffers of `cap` tokens, like k and v, holding what is cached."""
        new_k = k.new_empty((k.shape[0], cap, *k.shape[2:]))
        new_v = v.new_empty((v.shape[0], cap, *v.shape[2:]))
        if self.length:
            new_k[:, : self.length] = self.k[:, : self.length]
            new_v[:, : self.length] = self.v[:, : self.length]
        self.k, self.v = new_k, new_v

    def reserve(self, more: int) -> None:
        """Room for `more` tokens past the cached ones now, so they append in place (buffers that
        stay put, as a captured decode step needs)."""
        if self.k is not None and self.length + more > self.k.shape[1]:
            self._grow(self.length + more, self.k, self.v)


class TextKVCache:
    """Text K/V of every decoder layer (hyper layers included; visual K/V are never stored here).

    Keys are stored already rotated at their absolute positions. `length` is the number of cached
    tokens, which is also the position of the next token when positions are the default 0, 1, 2, ...
    The cache is for inference (stored tensors are detached copies).
    """

    def __init__(self, num_layers: int):
        self.layers = [_LayerKV() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return min(l.length for l in self.layers)

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's K/V of one layer; return all of that layer's K/V (views)."""
        if k.requires_grad or v.requires_grad:
            k, v = k.detach(), v.detach()
        return self.layers[layer_idx].append(k, v)

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's cached (k, v), (B, length, kv_heads, D) views; `update` of an empty cache
        restores them."""
        return [(l.k[:, : l.length], l.v[:, : l.length]) for l in self.layers]

    def reserve(self, more: int) -> None:
        """Room in every layer's buffer for `more` tokens past the cached ones."""
        for l in self.layers:
            l.reserve(more)

    def count_written(self, tokens: int = 1) -> None:
        """Count `tokens` more cached tokens that a step outside `update` wrote in place after the
        cached ones (a decode step on buffers that stay put)."""
        for l in self.layers:
            l.length += tokens

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (e.g. to drop a turn)."""
        for l in self.layers:
            l.length = min(l.length, length)


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
