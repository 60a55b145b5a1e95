"""OpenFlamingo as the engine runs it: the surface every family's model has (`encode_images`,
`prepare_visual`, `visual_kv`, `new_cache`, and a `forward` that calls the attention hooks it is
handed), over the weights of one `OpenFlamingoModel`.

A video is its frames as consecutive `<image>`s, each frame a media of one frame (as the LV-XAttn
paper runs OpenFlamingo on video): the CLIP tower's patch tokens of a frame become its 64 perceiver
latents, and those the K/V of every gated cross layer (8 heads of 64 in the released models; the
text attention has its own heads). A row sees the frames whose `<image>` is at or before it
(q_vis = #{starts <= t}, open_flamingo's `media_locations.cumsum`); a decoded token sees them all.
A row before the first `<image>` sees none: its attention adds nothing, as published. The MPT text
attention carries ALiBi: the forward's step hands the hooks its slopes (`FlamingoStep.alibi`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from lvx_kernels.feed import REPLICATED, Feed

from ..steps import (
    AttentionHooks,
    FrameFeatures,
    TextKVCache,
    VisualInputs,
    VisualStep,
    bind_visual,
    forward_positions,
    frames_visual,
)
from .config import OpenFlamingoConfig
from .modeling import OpenFlamingoModel
from .mpt import FlamingoStep

# frames per vision-tower call in `encode_images` (bounds its activations)
FRAMES_PER_BATCH = 8


def visible_frames(positions: torch.Tensor, media_starts: torch.Tensor) -> torch.Tensor:
    """q_vis per token: #{j : start_j <= t} (an `<image>` sees its own frame)."""
    starts = media_starts.to(positions.device, torch.int64).contiguous()
    flat = positions.reshape(-1).to(torch.int64).contiguous()
    return torch.searchsorted(starts, flat, right=True).view(positions.shape)


class OpenFlamingoVideoModel(nn.Module):
    def __init__(self, flamingo: OpenFlamingoModel, hooks: Optional[AttentionHooks] = None):
        super().__init__()
        self.flamingo = flamingo
        self.config: OpenFlamingoConfig = flamingo.cfg
        self.hooks = hooks or AttentionHooks()
        self._runs: dict[int, Callable] = {}  # checkpointed blocks' runs (finetuning)

    @property
    def dtype(self) -> torch.dtype:
        return self.flamingo.lang_encoder.transformer.wte.weight.dtype

    # ---- visual side -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_frames(
        self, pixel_values: torch.Tensor, batch_size: Optional[int] = None
    ) -> FrameFeatures:
        """Video frames -> E (`encode_images`); no row before the first frame sees a frame."""
        return FrameFeatures(self.encode_images(pixel_values, batch_size))

    def encode_images(
        self, pixel_values: torch.Tensor, batch_size: Optional[int] = None
    ) -> torch.Tensor:
        """Frames (N, 3, S, S) -> their perceiver latents (N, 64, vision width)."""
        outs = [
            self.flamingo.media_tokens(chunk)
            for chunk in pixel_values.split(batch_size or FRAMES_PER_BATCH)
        ]
        if not outs:
            w = self.flamingo.perceiver.latents
            return w.new_empty((0, *w.shape))
        return torch.cat(outs)

    def visual_kv(self, layer_idx: int, e_local: torch.Tensor, frame_positions=None):
        """K/V of the cross layer before block `layer_idx` for the frames in e_local (N, 64, W):
        each (1, N * 64, cross heads, cross head size); no positions on visual keys."""
        return self.flamingo.visual_kv(layer_idx, e_local)

    def visible_frames(self, positions: torch.Tensor, media_starts: torch.Tensor) -> torch.Tensor:
        return visible_frames(positions, media_starts)

    def prepare_visual(
        self,
        e_local: torch.Tensor,
        media_starts: torch.Tensor,
        frame_ids: Optional[torch.Tensor] = None,
        *,
        precompute: bool = True,
    ) -> VisualInputs:
        """The visual inputs of a request for the frames this process holds: every cross layer's
        K/V now (precompute), or made from E when a layer runs."""
        layers = self.config.cross_layer_indices
        return frames_visual(self.visual_kv, e_local, layers, media_starts, frame_ids, precompute)

    # ---- language side ---------------------------------------------------------------------------
    def fuse_projections(self) -> None:
        """Nothing to fuse: MPT's q, k and v are one projection already."""

    def new_cache(self) -> TextKVCache:
        return TextKVCache(self.config.num_hidden_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        cache: Optional[TextKVCache] = None,
        visual: Optional[VisualInputs] = None,
        last_only: bool = False,
        feed: Feed = REPLICATED,
        hooks: Optional[AttentionHooks] = None,
    ) -> torch.Tensor:
        """Logits (1, L, V) ((1, 1, V) with last_only) of input_ids (1, L) at `positions` (1, L)
        (default: after the cache): the text attention (with ALiBi) and the cross layers'
        attention to `visual` through the hooks; without visual inputs the cross layers'
        attention adds nothing and their feed-forward still runs, as for rows before any frame."""
        given = positions
        positions, start = forward_positions(input_ids, positions, cache)
        step = self._step(hooks or self.hooks, cache, feed)
        step.visual = bind_visual(
            visual, input_ids.shape[0], positions, given, start, feed, visible_frames, True
        )
        return self._layers(input_ids, step, last_only)

    def decode_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        hooks: AttentionHooks,
        cache,
        visual_step: Optional[VisualStep],
        feed: Feed = REPLICATED,
    ) -> torch.Tensor:
        """The step a CUDA graph captures: one decoded token's logits (1, 1, V) with its visual step
        already bound (a decoded token sees every frame); ALiBi needs no positions here (the text
        hook's keys are the cache's, in position order)."""
        step = self._step(hooks, cache, feed)
        step.visual = visual_step
        return self._layers(input_ids, step, True)

    def _step(self, hooks: AttentionHooks, cache, feed: Feed) -> FlamingoStep:
        alibi = self.flamingo.lang_encoder.transformer.alibi_slopes
        return FlamingoStep(hooks, cache, feed=feed, alibi=alibi)

    def _layers(self, input_ids: torch.Tensor, step: FlamingoStep, last_only: bool):
        lm = self.flamingo.lang_encoder
        x = lm.transformer(input_ids, step, self._runs)
        return lm.logits(x[:, -1:] if last_only else x)

    def _layer(self, layer, x: torch.Tensor, step: FlamingoStep, i: int) -> torch.Tensor:
        """One block's run (a checkpointed run wraps it)."""
        return layer(x, step, i)
