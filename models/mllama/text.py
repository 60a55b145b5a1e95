"""The Llama text model of Mllama (`language_model.*` keys) with its gated cross-attention layers.

The layers listed in `cross_attention_layers` attend to the visual tokens instead of the text: a
cross layer is RMSNorm -> cross-attention (per-head RMSNorm on q and k, no RoPE) -> residual scaled
by tanh(`cross_attn_attn_gate`) -> RMSNorm -> MLP, zeroed on masked-out rows -> residual scaled by
tanh(`cross_attn_mlp_gate`). The others are plain Llama layers with llama3-scaled RoPE.

Every layer runs on the step its forward hands it (`MllamaStep`) and attends through the step's
`AttentionHooks` (the engine's sharded attention, or lvx's local kernels: `attention(q, k, v) ->
(out, lse)`, GQA folded): the one forward of these layers, whether the engine runs them
(`MllamaVideoModel`) or a published-layout forward does (`MllamaModel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lvx_kernels.feed import REPLICATED, Feed

from ..steps import AttentionHooks, TextKVCache, VisualStep
from .config import MllamaTextConfig
from .cross import CrossVisibility

# called as cross_attn(q, k, v, visibility, layer) -> out (1, L, Hq, D)
CrossAttn = Callable[..., torch.Tensor]


@dataclass
class MllamaStep:
    """What one forward hands every layer, and every layer its attention hooks."""

    cos: torch.Tensor
    sin: torch.Tensor
    hooks: AttentionHooks
    cache: Optional[TextKVCache] = None
    visual: Optional[VisualStep] = None  # None: the cross layers are skipped (text only)
    feed: Feed = REPLICATED
    kept: Optional[torch.Tensor] = None  # (1, L, 1): 0 on masked-out rows; None: none is
    # which visual keys each row sees, for a cross-attention hook given the published mask
    visibility: Optional[CrossVisibility] = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: MllamaTextConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with llama3 scaling when the config asks for it (float32)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s or s.get("rope_type", s.get("type")) != "llama3":
        return inv
    old = s["original_max_position_embeddings"]
    low, high, factor = s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, H, D) rotated by cos/sin (B, L, D) (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, :, None] + torch.cat((-x2, x1), dim=-1) * sin[:, :, None]


class MLP(nn.Module):
    def __init__(self, cfg: MllamaTextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Projections(nn.Module):
    def __init__(self, cfg: MllamaTextConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def split(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.view(*t.shape[:2], heads, self.head_dim)


class SelfAttention(_Projections):
    """q, k, v and o of a self-attention layer (it runs in `SelfAttentionLayer`)."""


class CrossAttention(_Projections):
    def __init__(self, cfg: MllamaTextConfig):
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def visual_kv(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (B, S_kv, Hkv, D) of this layer from the projected visual tokens (B, S_kv, H)."""
        k = self.k_norm(self.split(self.k_proj(features), self.kv_heads))
        return k, self.split(self.v_proj(features), self.kv_heads)


class SelfAttentionLayer(nn.Module):
    def __init__(self, cfg: MllamaTextConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: MllamaStep, layer: int) -> torch.Tensor:
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = rope(attn.split(attn.q_proj(h), attn.heads), step.cos, step.sin)
        k = rope(attn.split(attn.k_proj(h), attn.kv_heads), step.cos, step.sin)
        v = attn.split(attn.v_proj(h), attn.kv_heads)
        if step.cache is not None:
            k, v = step.cache.update(layer, k, v)
        out, _ = step.hooks.text(q, k, v, step, layer)
        x = x + attn.o_proj(out.to(x.dtype).flatten(2))
        return x + self.mlp(self.post_attention_layernorm(x))


class CrossAttentionLayer(nn.Module):
    def __init__(self, cfg: MllamaTextConfig):
        super().__init__()
        self.cross_attn = CrossAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, step: MllamaStep, layer: int) -> torch.Tensor:
        attn = self.cross_attn
        if step.cache is not None:  # zero-width K/V: the layer's count of the tokens fed
            none = x.new_empty((*x.shape[:2], attn.kv_heads, 0))
            step.cache.update(layer, none, none)
        if step.visual is None:
            return x
        q = attn.q_norm(attn.split(attn.q_proj(self.input_layernorm(x)), attn.heads))
        out, _ = step.hooks.visual(q, step, layer)
        x = x + self.cross_attn_attn_gate.tanh() * attn.o_proj(out.to(x.dtype).flatten(2))
        h = self.mlp(self.post_attention_layernorm(x))
        if step.kept is not None:
            h = h * step.kept
        return x + self.cross_attn_mlp_gate.tanh() * h


class MllamaTextModel(nn.Module):
    def __init__(self, cfg: MllamaTextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size + 8, cfg.hidden_size)
        self.layers = nn.ModuleList(
            CrossAttentionLayer(cfg) if i in cfg.cross_attention_layers else SelfAttentionLayer(cfg)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, ids: torch.Tensor, step: MllamaStep, runs: Mapping[int, Callable] = {}
    ) -> torch.Tensor:
        """ids (1, L) -> hidden states (1, L, H) after the final norm; `runs[i]`, where given,
        runs layer i (`runs[i](layer, x, step, i)`: a checkpointed run for finetuning)."""
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            x = runs[i](layer, x, step, i) if i in runs else layer(x, step, i)
        return self.norm(x)


class MllamaForCausalLM(nn.Module):
    """`language_model.model` and `language_model.lm_head`, as the published keys nest them."""

    def __init__(self, cfg: MllamaTextConfig):
        super().__init__()
        self.model = MllamaTextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
