"""The CLIP vision tower as open_clip builds it (`VisionTransformer`, the CLIP model's `.visual`),
by its key names: `conv1`, `class_embedding`, `positional_embedding`, `ln_pre`,
`transformer.resblocks.{i}` (`ln_1`, `attn.in_proj_weight`/`in_proj_bias`, `attn.out_proj`, `ln_2`,
`mlp.c_fc`, `mlp.c_proj`), `ln_post`, `proj`.

OpenFlamingo takes the tower's patch tokens (`output_tokens = True`, the second output): every
token but the class token after `ln_post`, before `proj` (`proj` makes the pooled CLIP embedding,
which OpenFlamingo never uses; it is kept so the published weights load by name). The `openai`
weights run QuickGELU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class SelfAttention(nn.Module):
    """`nn.MultiheadAttention`'s parameters (fused in-projection), run as plain attention."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, w))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        w = cfg.width
        self.ln_1 = nn.LayerNorm(w, eps=cfg.layer_norm_eps)
        self.attn = SelfAttention(w, cfg.heads)
        self.ln_2 = nn.LayerNorm(w, eps=cfg.layer_norm_eps)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(w, cfg.intermediate_size))
        self.mlp.add_module("gelu", QuickGELU() if cfg.quick_gelu else nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(cfg.intermediate_size, w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.resblocks = nn.ModuleList(ResidualAttentionBlock(cfg) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x)
        return x


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        w, p = cfg.width, cfg.patch_size
        self.cfg = cfg
        self.conv1 = nn.Conv2d(cfg.channels, w, kernel_size=p, stride=p, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(w))
        self.positional_embedding = nn.Parameter(torch.zeros(cfg.tokens, w))
        self.ln_pre = nn.LayerNorm(w, eps=cfg.layer_norm_eps)
        self.transformer = Transformer(cfg)
        self.ln_post = nn.LayerNorm(w, eps=cfg.layer_norm_eps)
        self.proj = nn.Parameter(torch.zeros(w, cfg.output_dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixel values (N, 3, S, S) -> patch tokens (N, grid**2, width), as open_flamingo reads
        them (after `ln_post`, the class token dropped, no `proj`)."""
        x = self.conv1(pixels.to(self.conv1.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.transformer(self.ln_pre(x))
        return self.ln_post(x)[:, 1:]
