"""OpenFlamingo end to end: pixels -> the CLIP tower's patch tokens -> the perceiver's 64 latents
per frame -> each gated cross layer's visual K/V; ids -> the MPT text model with its cross layers ->
logits.

The module tree has open_flamingo's `Flamingo` state-dict names (the first name of each tensor;
`Flamingo.state_dict()` also lists every decoder block again under `lang_encoder.old_decoder_blocks`
and every cross layer under `lang_encoder.gated_cross_attn_layers`: the same tensors). Key map:

    published file                                   lvx key
    checkpoint.pt (open_flamingo's trainable part)   the same names:
      perceiver.*                                      perceiver.*
      lang_encoder.transformer.wte.weight              lang_encoder.transformer.wte.weight
      lang_encoder.transformer.blocks.{i}.             lang_encoder.transformer.blocks.{i}.
        gated_cross_attn_layer.*                         gated_cross_attn_layer.*
    the CLIP model's vision tower (open_clip)        vision_encoder.* (`visual.X` -> X)
    the MPT language model (MPT's names)             lang_encoder.transformer.X, where X is
      transformer.wte.weight                           wte.weight (rows: checkpoint.pt's, which
                                                         holds the added tokens)
      transformer.blocks.{i}.X                         blocks.{i}.decoder_layer.X
      transformer.norm_f.weight                        norm_f.weight

MPT-1B's own files (`mosaic_gpt`) name a block's parts `ln_1`, `attn.{Wqkv,q_ln,k_ln,out_proj}`,
`ln_2`, `mlp.mlp_up`, `mlp.mlp_down` and the final norm `ln_f`: `norm_1`, `attn.*`, `norm_2`,
`ffn.up_proj`, `ffn.down_proj`, `norm_f` here (`MOSAIC_GPT_NAMES`).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import OpenFlamingoConfig
from .cross import GatedCrossAttentionBlock
from .mpt import MptForCausalLM
from .perceiver import PerceiverResampler
from .vision import VisionTransformer

# a `mosaic_gpt` block's or model's key part -> MPT's (the names this tree uses)
MOSAIC_GPT_NAMES = {
    "ln_1.": "norm_1.",
    "ln_2.": "norm_2.",
    "mlp.mlp_up.": "ffn.up_proj.",
    "mlp.mlp_down.": "ffn.down_proj.",
    "ln_f.": "norm_f.",
}


class OpenFlamingoModel(nn.Module):
    def __init__(self, cfg: OpenFlamingoConfig):
        super().__init__()
        if cfg.perceiver.max_num_media:
            raise ValueError("media time embeddings are not supported (no release has them)")
        self.cfg = cfg
        self.vision_encoder = VisionTransformer(cfg.vision)
        self.perceiver = PerceiverResampler(cfg.vision.width, cfg.perceiver)
        crosses = set(cfg.cross_layer_indices)

        def cross(i: int) -> GatedCrossAttentionBlock | None:
            if i not in crosses:
                return None
            return GatedCrossAttentionBlock(
                cfg.text.d_model,
                cfg.vision.width,
                cfg.cross_dim_head,
                cfg.cross_heads,
                cfg.cross_ff_mult,
            )

        self.lang_encoder = MptForCausalLM(cfg.text, cross)

    def cross_layer(self, i: int) -> GatedCrossAttentionBlock:
        layer = self.lang_encoder.transformer.blocks[i].gated_cross_attn_layer
        if layer is None:
            raise ValueError(f"block {i} has no cross layer ({self.cfg.cross_layer_indices})")
        return layer

    def media_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """Frames (N, 3, S, S) -> the perceiver's visual tokens (N, latents, vision width): each
        frame a media of one frame."""
        return self.perceiver(self.vision_encoder(pixels))

    def visual_kv(self, i: int, media: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross layer i's K, V (1, N * latents, heads, dim_head) of visual tokens (N, latents,
        width), frame-major as open_flamingo flattens them."""
        return self.cross_layer(i).attn.visual_kv(media.reshape(1, -1, media.shape[-1]))
