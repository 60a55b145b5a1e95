"""mPLUG-Owl3: vision tower + projector + Qwen2 with hyper layers.

`Owl3Model(config).state_dict()` has exactly the official checkpoint keys (reference mplug_owl3.md
§3) minus the vision keys the model never uses (last encoder layer, post_layernorm, head) and minus
`language_model.lm_head.weight` when embeddings are tied.

Typical single-process use:

    model = Owl3Model(cfg)                      # + load weights
    E = model.encode_images(pixel_values)       # (N, 729, H), once per video
    visual = model.prepare_visual(E, media_starts)
    cache = model.new_cache()
    # prefill; then one token per forward
    logits = model(input_ids, cache=cache, visual=visual, last_only=True)

Distributed use (the engine): each rank encodes its own slice of frames, calls
`prepare_visual(E_local, media_starts, frame_ids=global ids of the local frames)` and hands every
forward its distributed attention (`hooks=`, lvx_app/engine/parallelize.py) and how the ranks feed
its tokens (`feed=`), which the hooks get with every call; `decode_step` is the static decode's step
(lvx_app/engine/static_decode.py). `model.hooks` is the attention of a forward handed none.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

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
    frames_kv,
    local_frames,
)
from .config import Owl3Config
from .hyper import HyperAttention, frame_rope_positions, visible_frames, visual_kv
from .layers import Fusing
from .qwen2 import Qwen2Attention, Qwen2LM
from .training import Finetuning
from .vision import SiglipVisionTower, build_projector, frames_per_batch


class Owl3Model(Finetuning, nn.Module):
    def __init__(self, config: Owl3Config, hooks: Optional[AttentionHooks] = None):
        super().__init__()
        self.config = config
        self.vision_model = SiglipVisionTower(config.vision)
        self.vision2text_model = build_projector(config)
        self.language_model = Qwen2LM(
            config,
            lambda i: (
                HyperAttention(config, i) if config.is_hyper(i) else Qwen2Attention(config, i)
            ),
        )
        self.hooks = hooks or AttentionHooks()

    # ---- visual side
    # ----------------------------------------------------------------------------------------------
    def encode_frames(
        self, pixel_values: torch.Tensor, batch_size: Optional[int] = None
    ) -> FrameFeatures:
        """Video frames -> E (`encode_images`); the rows before the first frame see no more."""
        return FrameFeatures(self.encode_images(pixel_values, batch_size))

    @torch.no_grad()
    def encode_images(
        self, pixel_values: torch.Tensor, batch_size: Optional[int] = None
    ) -> torch.Tensor:
        """pixel_values (N, 3, S, S) (normalised to [-1, 1]) -> E (N, 729, H) in the model's dtype.

        Runs the SigLIP tower (output after all but its last layer) and the projector, `batch_size`
        images at a time to bound activation memory (default: `vision.frames_per_batch`, 16 frames
        at so400m shapes). No autograd (training the projector would call
        `vision2text_model(vision_model(px))` directly)."""
        p = self.vision_model.embeddings.patch_embedding.weight
        step = batch_size or frames_per_batch(self.config.vision)
        outs = [
            self.vision2text_model(self.vision_model(chunk.to(p.device, p.dtype)))
            for chunk in pixel_values.split(step)
        ]
        if not outs:
            return p.new_empty((0, self.config.vision.num_patches, self.config.hidden_size))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def visual_kv(self, layer_idx: int, e_local: torch.Tensor, frame_positions: torch.Tensor):
        """K/V of hyper layer `layer_idx` (0-based) for the frames in e_local (N, 729, H): each (1,
        N*729, n_kv, hd); K carries MI-RoPE at `frame_positions` (N,) (see `frame_rope_positions`).

        A pure function of (weights, E): cache it per layer, or recompute it from one copy of E."""
        if not self.config.is_hyper(layer_idx):
            raise ValueError(
                f"layer {layer_idx} is not a hyper layer "
                f"(hyper layers: {self.config.hyper_layer_indices})"
            )
        layer = self.language_model.model.layers[layer_idx]
        cfg = self.config
        return visual_kv(
            e_local,
            layer.input_layernorm.weight,
            cfg.rms_norm_eps,
            layer.self_attn.v_kv_proj,
            frame_positions,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.rope_theta,
        )

    def frame_rope_positions(self, media_starts: torch.Tensor) -> torch.Tensor:
        """MI-RoPE position per frame for this checkpoint's generation (G2 start_j, G1 start_j +
        1)."""
        return frame_rope_positions(media_starts, self.config.generation)

    def visible_frames(self, positions: torch.Tensor, media_starts: torch.Tensor) -> torch.Tensor:
        """q_vis per token for this checkpoint's generation (G2 #{t >= start_j}, G1 #{start_j <
        t})."""
        return visible_frames(positions, media_starts, self.config.generation)

    def prepare_visual(
        self,
        e_local: torch.Tensor,
        media_starts: torch.Tensor,
        frame_ids: Optional[torch.Tensor] = None,
        *,
        precompute: bool = True,
    ) -> VisualInputs:
        """The visual inputs of a request for the frames this process holds.

        e_local (N_local, 729, H): this process's frames; media_starts (N_total,): placeholder start
        of every frame of the request; frame_ids (N_local,): global indices of the local frames
        (default 0..N_local-1, i.e. the process holds all frames).
        precompute=True (inference): every hyper layer's K/V is computed now, without autograd, and
        reused by every forward and every decoded token. precompute=False (finetuning with
        recompute): only E is kept and each forward recomputes a layer's K/V when that layer runs
        (differentiable w.r.t. E and v_kv_proj)."""
        n, p, _ = e_local.shape
        starts, ids_host, k_frame = local_frames(n, p, media_starts, frame_ids, e_local.device)
        frame_ids = ids_host.to(e_local.device)
        positions = self.frame_rope_positions(starts.tensor)[frame_ids]
        make_kv = partial(self.visual_kv, frame_positions=positions)
        kv = frames_kv(make_kv, e_local, self.config.hyper_layer_indices, precompute)
        return VisualInputs(kv=kv, k_frame=k_frame, media_starts=starts)

    def _sees_at_start(self) -> bool:
        """Whether a token at a frame's placeholder start sees that frame (G2: t >= start_j)."""
        return self.config.generation == "g2"

    # ---- language side
    # ----------------------------------------------------------------------------------------------
    def fuse_projections(self) -> None:
        """Every decoder layer's q/k/v and gate/up projections as one matmul each, for forwards
        without autograd (the loader does it for inference; the parameters and their checkpoint
        keys stay as they are, as views of the fused weights)."""
        for module in self.language_model.modules():
            if isinstance(module, Fusing):
                module.fuse_projections()

    def new_cache(self) -> TextKVCache:
        return TextKVCache(self.config.num_hidden_layers)

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
        """The step a CUDA graph captures: one decoded token's logits (1, 1, V), its visual step
        already bound (`visual_step`: q_vis in a buffer of the caller's, None without frames), so
        nothing on the host is read or made per token. `cache`: anything with the text cache's
        `length`, `truncate` and `update` (the engine's writes at a device-side position)."""
        return self.language_model(
            input_ids,
            positions,
            hooks=hooks,
            cache=cache,
            visual=visual_step,
            last_only=True,
            feed=feed,
        )

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
        """Text forward -> logits (B, L, V) float in the model dtype ((B, 1, V) with last_only).

        input_ids (B, L); positions (B, L) absolute token indices, default cache.length + arange(L)
        (given on the host, the host knows which frames each token sees); cache: the text KV cache
        to extend (None = no cache, the tokens are the whole sequence); visual: frames to attend to
        in the hyper layers (B must be 1), None = text only; feed: how the ranks feed these tokens
        (for the attention hooks, `lvx_kernels.feed`); hooks: the attention this forward calls
        (default: the model's own, local attention)."""
        lm = self.language_model
        given, start = positions, cache.length if cache is not None else 0
        positions = lm.resolve_positions(input_ids, positions, cache)
        sees = self._sees_at_start()
        batch = input_ids.shape[0]
        step = bind_visual(visual, batch, positions, given, start, feed, self.visible_frames, sees)
        return lm(
            input_ids,
            positions,
            hooks=hooks or self.hooks,
            cache=cache,
            visual=step,
            last_only=last_only,
            feed=feed,
        )
