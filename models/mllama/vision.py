"""Mllama's tiled vision encoder (`vision_model.*` keys), as the published weights expect it.

An image is up to `max_num_tiles` tiles of `image_size` pixels (1,601 tokens each: the patch grid
and a class token). Tile embeddings picked by the image's aspect-ratio id are added before the
class token (`pre_tile_positional_embedding`) and after the local layers
(`post_tile_positional_embedding`); the patch positions are a gated mix of one shared table and a
per-aspect-ratio table (`gated_positional_embedding`). Every tile of an image attends to every
other tile in both the local and the global (tanh-gated) layers. Each tile is padded to a multiple
of 8 tokens; as in the published implementation, only padding-to-padding pairs are masked (a real
token still sees the padding tokens and the empty tiles), which the weights were trained with.
The output concatenates the global layers' result with the local layers' outputs listed in
`intermediate_layers_indices` (1280 x 6 = 7680 features per token at 11B).

The published processor hands the tower `max_num_tiles` tiles, the image's real ones followed by
empty (all-zero) tiles, and lvx pads a video frame the same way (`Finetuning.vision_features`).
A pixel tensor with fewer tiles runs without the empty tiles (the first tiles' embeddings are
used): cheaper, but not what the published model computes, so only a benchmark does it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MllamaVisionConfig


class AspectRatioEmbedding(nn.Module):
    """A tanh-gated embedding per tile, picked by the image's aspect-ratio id."""

    def __init__(self, cfg: MllamaVisionConfig):
        super().__init__()
        self.max_tiles, self.hidden = cfg.max_num_tiles, cfg.hidden_size
        self.embedding = nn.Embedding(
            cfg.max_aspect_ratio_id + 1, cfg.max_num_tiles * cfg.hidden_size
        )
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:
        """x (N, T, P, D) + the first T tiles' embeddings of each image's aspect ratio."""
        e = self.embedding(ar_ids).view(-1, self.max_tiles, 1, self.hidden)[:, : x.shape[1]]
        return x + e * self.gate.tanh()


class GatedPositionalEmbedding(nn.Module):
    """(1 - tanh g) * one patch-position table + tanh g * the aspect ratio's per-tile table."""

    def __init__(self, cfg: MllamaVisionConfig):
        super().__init__()
        self.max_tiles, self.p, self.hidden = (
            cfg.max_num_tiles,
            cfg.patches_per_tile,
            cfg.hidden_size,
        )
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.zeros(self.p, self.hidden))
        self.tile_embedding = nn.Embedding(
            cfg.max_aspect_ratio_id + 1, cfg.max_num_tiles * self.p * self.hidden
        )

    def forward(self, x: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:
        x = x + (1 - self.gate.tanh()) * self.embedding.view(1, 1, self.p, self.hidden)
        tiles = self.tile_embedding(ar_ids).view(-1, self.max_tiles, self.p, self.hidden)
        return x + self.gate.tanh() * tiles[:, : x.shape[1]]


class VisionAttention(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig):
        super().__init__()
        d, self.heads = cfg.hidden_size, cfg.attention_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))


class VisionMLP(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionLayer(nn.Module):
    """Pre-norm encoder layer; a global layer scales its attention and MLP by tanh gates."""

    def __init__(self, cfg: MllamaVisionConfig, gated: bool):
        super().__init__()
        self.self_attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1))
            self.gate_ffn = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), bias)
        x = x + (self.gate_attn.tanh() * h if self.gated else h)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (self.gate_ffn.tanh() * h if self.gated else h)


class VisionEncoder(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig, num_layers: int, gated: bool):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg, gated) for _ in range(num_layers))


def padding_bias(
    tile_mask: torch.Tensor, real: int, padded: int, dtype: torch.dtype
) -> torch.Tensor:
    """(N, 1, T*padded, T*padded) additive bias: the dtype's lowest value where both the query and
    the key are padding (a padding token, or any token of an empty tile), else 0."""
    pad = (1 - tile_mask.to(dtype))[:, :, None].repeat(1, 1, padded)  # (N, T, padded)
    pad[:, :, real:] = 1
    pad = pad.flatten(1)[..., None]
    return (pad @ pad.transpose(-1, -2) * torch.finfo(dtype).min)[:, None]


class MllamaVisionModel(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, d, cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.gated_positional_embedding = GatedPositionalEmbedding(cfg)
        self.pre_tile_positional_embedding = AspectRatioEmbedding(cfg)
        self.post_tile_positional_embedding = AspectRatioEmbedding(cfg)
        self.layernorm_pre = nn.LayerNorm(d)
        self.layernorm_post = nn.LayerNorm(d)
        self.transformer = VisionEncoder(cfg, cfg.num_hidden_layers, gated=False)
        self.global_transformer = VisionEncoder(cfg, cfg.num_global_layers, gated=True)

    def forward(
        self,
        pixels: torch.Tensor,
        ar_ids: torch.Tensor,
        ar_mask: torch.Tensor,
        keep: int | None = None,
    ) -> torch.Tensor:
        """pixels (N, T, C, H, W), ar_ids (N,), ar_mask (N, T) -> (N, keep, P, vision_output_dim):
        the features of the first `keep` tiles (all T by default); every tile runs, since the
        others attend to it."""
        n, t = pixels.shape[:2]
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixels.flatten(0, 1).to(w.device, w.dtype))
        x = self.pre_tile_positional_embedding(
            x.flatten(2).transpose(1, 2).view(n, t, -1, w.shape[0]), ar_ids
        )
        cls = self.class_embedding.to(x.dtype).expand(n, t, 1, -1)
        x = self.gated_positional_embedding(torch.cat([cls, x], dim=2), ar_ids)
        x = self.layernorm_pre(x)
        p = x.shape[2]
        padded = p + (8 - p % 8) % 8
        x = F.pad(x, (0, 0, 0, padded - p)).view(n, t * padded, -1)
        if bool((ar_mask == ar_mask[:1]).all()):  # frames alike: one bias for the batch
            ar_mask = ar_mask[:1]
        bias = padding_bias(ar_mask, p, padded, x.dtype)
        kept = {}  # the local layers' outputs the published model concatenates
        for i, layer in enumerate(self.transformer.layers):
            x = layer(x, bias)
            if i in self.cfg.intermediate_layers_indices:
                kept[i] = x
        x = self.layernorm_post(x)
        x = self.post_tile_positional_embedding(x.view(n, t, padded, -1), ar_ids).view(
            n, t * padded, -1
        )
        for layer in self.global_transformer.layers:
            x = layer(x, bias)
        keep, order = t if keep is None else keep, self.cfg.intermediate_layers_indices
        inter = torch.stack([kept[i].view(n, t, padded, -1)[:, :keep] for i in order], dim=-1)
        inter = inter.flatten(-2)
        return torch.cat([x.view(n, t, padded, -1)[:, :keep], inter], dim=-1)[:, :, :p]
