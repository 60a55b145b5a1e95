"""The rows of a video prompt before its first frame, for a family that opens them to more keys
than the frames' resident K/V (`ModelConfig.header_visual_tokens_per_frame`).

Llama-3.2-Vision's chat header sees no image; transformers then opens its cross-attention to every
key of every image, the empty tiles' included, and drops only the layer's MLP output for it (Meta's
reference zeroes the attention output too; lvx follows transformers, which users compare with).
lvx keeps only a frame's own tile as visual K/V, so these rows are prefilled on their own, fed
whole on every rank, with this visual attention: each cross layer's resident K/V of the rank's
frames, then the K/V of their header features (the empty tiles, `encode_frames`), made a few frames
at a time from the host that holds them, the partials merged, then merged over the ranks in one
collective (`combine_partials`, as a decoded token's). Nothing of it stays: the header features are
dropped once the header's text K/V are in the cache.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lvx_app.attention.decode_xattn import combine_partials
from lvx_kernels.kernels import attn_fwd
from lvx_kernels.merge import acc_dtype, merge_
from lvx_models.api import ModelConfig


def header_chunk_frames(cfg: ModelConfig) -> int:
    """Frames whose header K/V one step makes: the config's float32 work of a chunk."""
    extra = cfg.header_visual_tokens_per_frame - cfg.visual_tokens_per_frame
    return max(1, cfg.visual_kv_chunk_bytes // max(1, extra * cfg.hidden_size * 8))


class HeaderAttention:
    """The visual attention hook of the header rows (every one sees every key): the layer's
    K/V of this rank's frames (`kv`, the visual inputs' mapping), and of their `header_features`
    (N, T', H), on any device, over `group`."""

    def __init__(self, model, kv, header_features: torch.Tensor, device, group=None) -> None:
        self.model, self.kv, self.features = model, kv, header_features
        self.device, self.group = device, group
        self.chunk = header_chunk_frames(model.config)

    @torch.no_grad()
    def __call__(self, q: torch.Tensor, step, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = attn_fwd(q, *self.kv[layer])
        out = out.to(acc_dtype(q))
        for chunk in self.features.split(self.chunk):
            k, v = self.model.visual_kv(layer, chunk.to(self.device))
            merge_(out, lse, *attn_fwd(q, k, v))
        out, lse = combine_partials(out, lse, group=self.group)
        return out.to(q.dtype), lse


def prefill_header(conversation, model, header_features: torch.Tensor, ids: torch.Tensor) -> None:
    """Feed the header's `ids` whole on every rank of the conversation (a `Conversation`), its
    cross layers attending through `HeaderAttention` to the video it shows and `header_features`."""
    attn = conversation.attn
    header = HeaderAttention(
        model,
        conversation.visual.kv,
        header_features,
        conversation.info.device,
        attn.group if attn is not None else None,
    )
    conversation.prefill(ids, whole=True, hooks=replace(conversation.hooks, visual=header))
