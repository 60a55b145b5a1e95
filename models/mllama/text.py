"""The Llama text model of Mllama (`language_model.*` keys) with its gated cross-attention layers.

The layers listed in `cross_attention_layers` attend to the visual tokens instead of the text: a
cross layer is RMSNorm -> cross-attention (per-head RMSNorm on q and k, no RoPE) -> residual scaled
by tanh(`cross_attn_attn_gate`) -> RMSNorm -> MLP, zeroed on masked-out rows -> residual scaled by
tanh(`cross_attn_mlp_gate`). The others are plain Llama layers with llama3-scaled RoPE.

Text attention and cross-attention go through lvx's kernels (`attention(q, k, v) -> (out, lse)`,
GQA folded); the cross-attention through a callable (`cross_attn`) the caller may replace, so a
sharded one receives each layer's query, its K/V and the forward's visibility.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lvx_kernels.kernels import attention

from .config import MllamaTextConfig
from .cross import CrossVisibility, local_cross_attn

# called as cross_attn(q, k, v, visibility, layer) -> out (1, L, Hq, D)
CrossAttn = Callable[..., torch.Tensor]


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
    def forward(self, x: torch.Tensor, step: "TextStep", layer: int) -> torch.Tensor:
        q = rope(self.split(self.q_proj(x), self.heads), step.cos, step.sin)
        k = rope(self.split(self.k_proj(x), self.kv_heads), step.cos, step.sin)
        v = self.split(self.v_proj(x), self.kv_heads)
        if step.cache is not None:
            k, v = step.cache.append(layer, k, v)
        out = attention(q, k, v, causal=True)[0]
        return self.o_proj(out.flatten(2))


class CrossAttention(_Projections):
    def __init__(self, cfg: MllamaTextConfig):
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def visual_kv(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (B, S_kv, Hkv, D) of this layer from the projected visual tokens (B, S_kv, H)."""
        k = self.k_norm(self.split(self.k_proj(features), self.kv_heads))
        return k, self.split(self.v_proj(features), self.kv_heads)

    def forward(self, x: torch.Tensor, step: "TextStep", layer: int) -> torch.Tensor:
        q = self.q_norm(self.split(self.q_proj(x), self.heads))
        k, v = step.visual_kv[layer]
        return self.o_proj(step.cross_attn(q, k, v, step.visibility, layer).flatten(2))


class SelfAttentionLayer(nn.Module):
    def __init__(self, cfg: MllamaTextConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: "TextStep", layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, layer)
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

    def forward(self, x: torch.Tensor, step: "TextStep", layer: int) -> torch.Tensor:
        h = self.cross_attn(self.input_layernorm(x), step, layer)
        x = x + self.cross_attn_attn_gate.tanh() * h
        h = self.mlp(self.post_attention_layernorm(x))
        kept = (~step.visibility.masked_out).to(h.dtype).to(h.device)[None, :, None]
        return x + self.cross_attn_mlp_gate.tanh() * (h * kept)


@dataclass
class TextCache:
    """Text K/V of every self-attention layer (rotated at their positions) and the visual K/V of
    every cross layer, with what the next token sees. Inference only (stored tensors are
    detached)."""

    text: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    visual_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    visibility: CrossVisibility | None = None
    tokens: int = 0  # how many tokens were fed (the next token's position); `advance` alone sets it

    def advance(self, fed: int, visual_kv=None, visibility: CrossVisibility | None = None) -> None:
        """After a forward of `fed` tokens: count them, keep the visual K/V it made (detached) and
        what its last row saw."""
        self.tokens += fed
        if visual_kv is not None:
            self.visual_kv = {i: (k.detach(), v.detach()) for i, (k, v) in visual_kv.items()}
        if visibility is not None:
            self.visibility = visibility

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        k, v = k.detach(), v.detach()
        if layer in self.text:
            k = torch.cat([self.text[layer][0], k], dim=1)
            v = torch.cat([self.text[layer][1], v], dim=1)
        self.text[layer] = (k, v)
        return k, v


@dataclass
class TextStep:
    """What every layer of one forward needs: RoPE of its positions, the cache, the visual K/V per
    cross layer and which of them each row sees, and the cross-attention to run."""

    cos: torch.Tensor
    sin: torch.Tensor
    cache: TextCache | None
    visual_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
    visibility: CrossVisibility | None
    cross_attn: CrossAttn = local_cross_attn


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

    def forward(self, ids: torch.Tensor, step: TextStep) -> torch.Tensor:
        """ids (1, L) -> hidden states (1, L, H) after the final norm. Cross layers are skipped
        when the step has no visual K/V (text only)."""
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, CrossAttentionLayer) and not step.visual_kv:
                continue
            x = layer(x, step, i)
        return self.norm(x)


class MllamaForCausalLM(nn.Module):
    """`language_model.model` and `language_model.lm_head`, as the published keys nest them."""

    def __init__(self, cfg: MllamaTextConfig):
        super().__init__()
        self.model = MllamaTextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
