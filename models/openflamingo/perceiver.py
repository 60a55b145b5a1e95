"""open_flamingo's `PerceiverResampler` (`perceiver.*` keys): `latents` (64 x width) attend to one
media's patch tokens and themselves in `depth` layers of attention and feed-forward, and a final
LayerNorm. `frame_embs` (per frame of a media) and `media_time_embs` (per media) exist only when
their maximum counts are configured (the released models have neither; lvx runs `frame_embs`
and refuses `media_time_embs`, which would tie a frame's tokens to its place in the prompt).

lvx gives every video frame its own media of one frame, as OpenFlamingo runs an image (and as the
LV-XAttn paper runs video): the perceiver resamples each frame alone into 64 visual tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import PerceiverConfig


def feed_forward(dim: int, mult: int) -> nn.Sequential:
    """open_flamingo's `FeedForward`: LayerNorm, Linear up, GELU, Linear down (no biases), keys
    `0`..`3`."""
    inner = int(dim * mult)
    return nn.Sequential(
        nn.LayerNorm(dim),
        nn.Linear(dim, inner, bias=False),
        nn.GELU(),
        nn.Linear(inner, dim, bias=False),
    )


class PerceiverAttention(nn.Module):
    def __init__(self, dim: int, dim_head: int, heads: int):
        super().__init__()
        self.heads, inner = heads, dim_head * heads
        self.norm_media = nn.LayerNorm(dim)
        self.norm_latents = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """x (N, tokens, dim), latents (N, latents, dim) -> (N, latents, dim): the latents attend
        to the media's tokens and to themselves."""
        x, latents = self.norm_media(x), self.norm_latents(latents)
        q = self.to_q(latents)
        k, v = self.to_kv(torch.cat((x, latents), dim=1)).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).flatten(2))


class PerceiverResampler(nn.Module):
    def __init__(self, dim: int, cfg: PerceiverConfig):
        super().__init__()
        self.latents = nn.Parameter(torch.zeros(cfg.num_latents, dim))
        if cfg.max_num_frames:
            self.frame_embs = nn.Parameter(torch.zeros(cfg.max_num_frames, dim))
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [PerceiverAttention(dim, cfg.dim_head, cfg.heads), feed_forward(dim, cfg.ff_mult)]
            )
            for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each media of one frame at media time 0 (N, tokens, dim) -> its latents (N, latents,
        dim)."""
        if hasattr(self, "frame_embs"):
            x = x + self.frame_embs[0]
        latents = self.latents.to(x.dtype).expand(x.shape[0], -1, -1)
        for attn, ff in self.layers:
            latents = attn(x, latents) + latents
            latents = ff(latents) + latents
        return self.norm(latents)
