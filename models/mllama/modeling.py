"""Mllama end to end: pixels -> vision encoder -> projector -> visual K/V of each cross layer; ids
-> the text model -> logits. The module tree has the published checkpoint's key names
(`vision_model.*`, `multi_modal_projector.*`, `language_model.model.*`,
`language_model.lm_head.*`)."""

from __future__ import annotations

import torch
from torch import nn

from ..steps import AttentionHooks, TextKVCache, VisualStep
from .config import MllamaConfig
from .cross import CrossVisibility, local_cross_attn
from .text import CrossAttentionLayer, CrossAttn, MllamaForCausalLM, MllamaStep
from .vision import MllamaVisionModel


class MllamaModel(nn.Module):
    def __init__(self, cfg: MllamaConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_model = MllamaVisionModel(cfg.vision)
        self.multi_modal_projector = nn.Linear(cfg.vision.vision_output_dim, cfg.text.hidden_size)
        self.language_model = MllamaForCausalLM(cfg.text)

    @property
    def cross_layers(self) -> list[int]:
        layers = self.language_model.model.layers
        return [i for i, layer in enumerate(layers) if isinstance(layer, CrossAttentionLayer)]

    def visual_features(
        self, pixels: torch.Tensor, ar_ids: torch.Tensor, ar_mask: torch.Tensor
    ) -> torch.Tensor:
        """Projected visual tokens of a batch of images or frames: pixels (N, T, C, H, W) ->
        (N * T * P, hidden), image-major, then tile, then patch (the keys' order)."""
        out = self.multi_modal_projector(self.vision_model(pixels, ar_ids, ar_mask))
        return out.flatten(0, 2)

    def visual_kv(self, features: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each cross layer's K, V (1, S_kv, Hkv, D) from the projected visual tokens (S_kv, H)."""
        layers = self.language_model.model.layers
        return {i: layers[i].cross_attn.visual_kv(features[None]) for i in self.cross_layers}

    def published_visual(
        self,
        pixels: torch.Tensor | None = None,
        ar_ids: torch.Tensor | None = None,
        ar_mask: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> tuple[dict, CrossVisibility] | None:
        """(each cross layer's K/V, which keys each row sees) of the processor's pixels (1, N, T,
        C, H, W), aspect-ratio ids (1, N) and mask (1, N, T) under its `cross_mask` (1, L, N, T);
        None without pixels."""
        if pixels is None:
            return None
        kv = self.visual_kv(self.visual_features(pixels[0], ar_ids[0], ar_mask[0]))
        return kv, CrossVisibility.from_token_mask(cross_mask[0], self.cfg.vision.patches_per_tile)

    def forward(
        self,
        ids: torch.Tensor,
        pixels: torch.Tensor | None = None,
        ar_ids: torch.Tensor | None = None,
        ar_mask: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
        cache: TextKVCache | None = None,
        cross_attn: CrossAttn = local_cross_attn,
        visual: tuple[dict, CrossVisibility] | None = None,
    ) -> torch.Tensor:
        """Logits (1, L, vocab) of ids (1, L) after what the cache holds, through the layers'
        one forward, under the published cross-attention mask (any pattern of images and text).

        With the processor's pixels, aspect ratios and `cross_mask` the visual K/V are made here
        (`published_visual`); `visual`: the cross layers' K/V made elsewhere (for the frames this
        process holds) with which keys each of this forward's rows sees; neither: text only.
        `cross_attn(q, k, v, visibility, layer)` is each cross layer's attention."""
        made = self.published_visual(pixels, ar_ids, ar_mask, cross_mask)
        kv, vis = made or visual or (None, None)
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        dtype = self.language_model.lm_head.weight.dtype
        cos, sin = self.language_model.model.rope_tables(positions, dtype)

        def visual_attn(q: torch.Tensor, step: MllamaStep, layer: int):
            k, v = step.visual.kv[layer]
            return cross_attn(q, k, v, step.visibility, layer), None

        step = MllamaStep(cos, sin, AttentionHooks(visual=visual_attn), cache, visibility=vis)
        if kv is not None:
            step.visual = VisualStep(kv, k_frame=None, q_vis=None)  # the mask is `visibility`
            step.kept = (~vis.masked_out).to(dtype).to(ids.device)[None, :, None]
        return self.language_model.lm_head(self.language_model.model(ids, step))

    def new_cache(self) -> TextKVCache:
        return TextKVCache(self.cfg.text.num_hidden_layers)

    @torch.no_grad()
    def greedy(
        self, ids: torch.Tensor, max_new_tokens: int, stop: set[int] = frozenset(), **inputs
    ) -> list[int]:
        """Greedy tokens after the prompt ids (1, L) with its visual inputs (`forward`'s
        keywords), on a text cache, until a stop id or `max_new_tokens`; a decoded token sees what
        the prompt's last row sees."""
        cross_attn = inputs.pop("cross_attn", local_cross_attn)
        visual = inputs.pop("visual", None) or self.published_visual(**inputs)
        cache = self.new_cache()
        logits = self(ids, cache=cache, cross_attn=cross_attn, visual=visual)
        if visual is not None:
            visual = (visual[0], visual[1].last_row(1))
        tokens: list[int] = []
        while len(tokens) < max_new_tokens:
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if token in stop:
                break
            token_ids = torch.tensor([[token]], device=ids.device)
            logits = self(token_ids, cache=cache, cross_attn=cross_attn, visual=visual)
        return tokens
