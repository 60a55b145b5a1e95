"""Mllama end to end: pixels -> vision encoder -> projector -> visual K/V of each cross layer; ids
-> the text model -> logits. The module tree has the published checkpoint's key names
(`vision_model.*`, `multi_modal_projector.*`, `language_model.model.*`,
`language_model.lm_head.*`)."""

from __future__ import annotations

import torch
from torch import nn

from .config import MllamaConfig
from .cross import CrossVisibility, local_cross_attn
from .text import CrossAttentionLayer, CrossAttn, MllamaForCausalLM, TextCache, TextStep
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

    def forward(
        self,
        ids: torch.Tensor,
        pixels: torch.Tensor | None = None,
        ar_ids: torch.Tensor | None = None,
        ar_mask: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
        cache: TextCache | None = None,
        cross_attn: CrossAttn = local_cross_attn,
        visual: tuple[dict, CrossVisibility] | None = None,
    ) -> torch.Tensor:
        """Logits (1, L, vocab) of ids (1, L) after what the cache holds.

        With the processor's pixels (1, N, T, C, H, W), aspect-ratio ids (1, N) and mask (1, N, T)
        and `cross_mask` (1, L, N, T) the visual K/V
        are made (and kept in the cache); without them the cache's visual K/V serve, and every new
        row sees what the last row of the forward that made them saw. `visual`: the cross layers'
        K/V made elsewhere (`visual_kv`, for the frames this process holds) with this forward's
        visibility, instead of pixels."""
        start = cache.tokens if cache is not None else 0
        kv, vis = visual if visual is not None else (None, None)
        if pixels is not None:
            kv = self.visual_kv(self.visual_features(pixels[0], ar_ids[0], ar_mask[0]))
            vis = CrossVisibility.from_token_mask(cross_mask[0], self.cfg.vision.patches_per_tile)
        elif cache is not None and cache.visual_kv:
            kv, vis = cache.visual_kv, cache.visibility.last_row(ids.shape[1])
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        dtype = self.language_model.lm_head.weight.dtype
        cos, sin = self.language_model.model.rope_tables(positions, dtype)
        step = TextStep(cos, sin, cache, kv, vis, cross_attn)
        hidden = self.language_model.model(ids, step)
        if cache is not None:
            made = pixels is not None or visual is not None
            cache.advance(ids.shape[1], kv if made else None, vis)
        return self.language_model.lm_head(hidden)

    @torch.no_grad()
    def greedy(
        self, ids: torch.Tensor, max_new_tokens: int, stop: set[int] = frozenset(), **inputs
    ) -> list[int]:
        """Greedy tokens after the prompt ids (1, L) with its visual inputs (`forward`'s
        keywords), on a text cache, until a stop id or `max_new_tokens`."""
        cache = TextCache()
        logits = self(ids, cache=cache, **inputs)
        cross_attn = inputs.get("cross_attn", local_cross_attn)
        tokens: list[int] = []
        while len(tokens) < max_new_tokens:
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if token in stop:
                break
            token_ids = torch.tensor([[token]], device=ids.device)
            logits = self(token_ids, cache=cache, cross_attn=cross_attn)
        return tokens
