"""Llama-3.2-Vision as the engine runs it: the same surface as mPLUG-Owl3's model (`encode_images`,
`prepare_visual`, `visual_kv`, `new_cache`, and a `forward` that calls the attention hooks it is
handed), over the weights of one `MllamaModel`.

A video is its frames as consecutive `<|image|>`s, one tile each (`frame_prep`), which the vision
tower runs beside `max_num_tiles - 1` empty tiles as the published processor pads a one-tile image;
only the frame's own tile becomes resident visual keys. Every row sees a prefix of the frames: the
row at frame j's `<|image|>` and every later row see frames 0..j (q_vis = #{starts <= t}); a
decoded token sees them all. Rows before the first `<|image|>` are masked out as transformers
computes them: they attend to every tile of every frame, the empty tiles' included, and their
cross layer's MLP output is dropped (Meta's reference zeroes their attention as well). The engine
prefills those rows on their own, over the header features `encode_frames` gives (every tile's),
before the rest of the prompt; here they attend to every frame (q_vis = the number of frames) of
the visual inputs they are handed, and the model knows them from the positions, not the hooks. A
cross layer has no self-attention: its place in the text cache keeps count of the tokens with
zero-width K/V, so every layer's count is the conversation's length.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from lvx_kernels.feed import REPLICATED, Feed
from lvx_kernels.masks import Indices, device_tensor

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
from .config import MllamaConfig
from .modeling import MllamaModel
from .text import MllamaStep
from .training import Finetuning

# frames per vision-tower call in `encode_images` (bounds its activations)
FRAMES_PER_BATCH = 8


def visible_frames(positions: torch.Tensor, media_starts: torch.Tensor) -> torch.Tensor:
    """q_vis per token: #{j : start_j <= t}, or every frame for a row before the first start (a
    masked-out row attends to all of them)."""
    starts = media_starts.to(positions.device, torch.int64).contiguous()
    flat = positions.reshape(-1).to(torch.int64).contiguous()
    seen = torch.searchsorted(starts, flat, right=True)
    seen = torch.where(seen == 0, starts.numel(), seen)
    return seen.view(positions.shape)


class MllamaVideoModel(Finetuning, nn.Module):
    def __init__(self, mllama: MllamaModel, hooks: Optional[AttentionHooks] = None):
        super().__init__()
        self.mllama = mllama
        self.config: MllamaConfig = mllama.cfg
        self.hooks = hooks or AttentionHooks()
        self._runs: dict[int, Callable] = {}  # checkpointed layers' runs (`checkpoint_layers`)

    @property
    def dtype(self) -> torch.dtype:
        return self.mllama.language_model.lm_head.weight.dtype

    # ---- visual side -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(
        self, pixel_values: torch.Tensor, batch_size: Optional[int] = None
    ) -> torch.Tensor:
        """Frames as one tile each (N, 3, S, S) -> projected visual tokens of that tile (N, P, H)
        (`vision_features`: the tower runs it with the published empty tiles)."""
        w = self.mllama.multi_modal_projector.weight
        outs = [
            self.project(self.vision_features(chunk))
            for chunk in pixel_values.split(batch_size or FRAMES_PER_BATCH)
        ]
        if not outs:
            return w.new_empty((0, self.config.vision.num_patches, self.config.hidden_size))
        return torch.cat(outs)

    @torch.no_grad()
    def encode_frames(
        self, pixel_values: torch.Tensor, batch_size: Optional[int] = None
    ) -> FrameFeatures:
        """Frames (N, 3, S, S) -> E of their own tile (N, P, H), as `encode_images` gives it, and
        the header features: their empty tiles' ((N, (max_num_tiles - 1) * P, H)), which the rows
        before the first frame attend to besides E (the published model opens them to every
        tile)."""
        tiles = self.config.vision.max_num_tiles
        own, empty = [], []
        for chunk in pixel_values.split(batch_size or FRAMES_PER_BATCH):
            every = self.tile_features(chunk, keep=tiles)
            own.append(self.project(every[:, 0].contiguous()))
            empty.append(self.project(every[:, 1:]).flatten(1, 2))
        if not own:
            e = self.encode_images(pixel_values)
            return FrameFeatures(e, e.new_empty((0, (tiles - 1) * e.shape[1], e.shape[2])))
        return FrameFeatures(torch.cat(own), torch.cat(empty))

    def visual_kv(self, layer_idx: int, e_local: torch.Tensor, frame_positions=None):
        """K/V of cross layer `layer_idx` for the frames in e_local (N, P, H): each (1, N*P, Hkv,
        D); no RoPE on visual keys (positions are ignored)."""
        if layer_idx not in self.config.cross_layer_indices:
            raise ValueError(
                f"layer {layer_idx} is not a cross-attention layer "
                f"({self.config.cross_layer_indices})"
            )
        layer = self.mllama.language_model.model.layers[layer_idx]
        return layer.cross_attn.visual_kv(e_local.reshape(1, -1, e_local.shape[-1]))

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
        """The visual inputs of a request for the frames this process holds (as mPLUG-Owl3's):
        every cross layer's K/V now (precompute), or made from E when a layer runs."""
        layers = self.config.cross_layer_indices
        return frames_visual(self.visual_kv, e_local, layers, media_starts, frame_ids, precompute)

    # ---- language side ---------------------------------------------------------------------------
    def fuse_projections(self) -> None:
        """Nothing to fuse: the projections stay separate."""

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
        (default: after the cache), as mPLUG-Owl3's forward: the text attention and the cross
        layers' attention to `visual` through the hooks; without visual inputs the cross layers
        are skipped (a text-only forward, as published)."""
        lm = self.mllama.language_model
        given = positions
        positions, start = forward_positions(input_ids, positions, cache)
        cos, sin = lm.model.rope_tables(positions, self.dtype)
        step = MllamaStep(cos, sin, hooks or self.hooks, cache, feed=feed)
        batch, sees = input_ids.shape[0], True  # a row at a frame's <|image|> sees that frame
        step.visual = bind_visual(
            visual, batch, positions, given, start, feed, visible_frames, sees
        )
        q_vis = step.visual.q_vis if step.visual is not None else None
        if step.visual is not None and not (isinstance(q_vis, Indices) and q_vis.low is not None):
            first = device_tensor(visual.media_starts)[:1].to(positions.device)
            step.kept = (positions >= first).to(self.dtype)[..., None]
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
        already bound (a decoded token sees every frame), nothing made on the host per token."""
        cos, sin = self.mllama.language_model.model.rope_tables(positions.view(1, -1), self.dtype)
        step = MllamaStep(cos, sin, hooks, cache, visual_step, feed)
        return self._layers(input_ids, step, True)

    def _layers(self, input_ids: torch.Tensor, step: MllamaStep, last_only: bool) -> torch.Tensor:
        lm = self.mllama.language_model
        x = lm.model(input_ids, step, self._runs)
        return lm.lm_head(x[:, -1:] if last_only else x)

    def _layer(self, layer, x: torch.Tensor, step: MllamaStep, i: int) -> torch.Tensor:
        """One layer's run (`checkpoint_layers` wraps it)."""
        return layer(x, step, i)
