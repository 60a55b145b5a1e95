"""What finetuning asks of Llama-3.2-Vision (`surface.Finetunable`), as mPLUG-Owl3's `training`
gives it: trainable groups, the Linears an adapter may wrap, the vision tower split from the
projector (one tile a frame, padded with empty tiles as published), the parameters behind each
cross layer's visual K/V and checkpointed decoder layers (its saved weights: `saving`).

The "hyper" group is the analogue of mPLUG-Owl3's (v_kv_proj and the gate): what makes a cross
layer's visual K/V (k_proj, v_proj and the per-head k_norm) and the two tanh gates that mix its
result in. The query side (q_proj, q_norm) and o_proj are left out: in mPLUG-Owl3 they are the
text attention's own, so its hyper group never trains them either.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from ..adapters import is_adapter, wrap_linears
from .text import CrossAttentionLayer

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj")  # of every self- and cross-attention
TRAINABLE = ("hyper", "all", "adapters")
PREFIX = "mllama.language_model.model.layers"  # the layers' names in the engine's model


class Finetuning:
    """The methods of `MllamaVideoModel` the training loop calls (mixed into the model)."""

    mllama: nn.Module
    _runs: dict[int, Callable]  # layer -> its checkpointed run (`checkpoint_layers`)

    def _decoder_layers(self) -> nn.ModuleList:
        return self.mllama.language_model.model.layers

    def _cross_layers(self) -> Iterator[tuple[int, CrossAttentionLayer]]:
        for i, layer in enumerate(self._decoder_layers()):
            if isinstance(layer, CrossAttentionLayer):
                yield i, layer

    # ---- trainable groups
    # ----------------------------------------------------------------------------------------------
    def _hyper(self) -> set[int]:
        """ids of every cross layer's K/V-making parameters and its two gates."""
        own: set[int] = set()
        for i, layer in self._cross_layers():
            own |= {id(p) for p in self.visual_kv_parameters(i)}
            own |= {id(layer.cross_attn_attn_gate), id(layer.cross_attn_mlp_gate)}
        return own

    def _adapters(self) -> set[int]:
        return {
            id(p)
            for _, m in self._slots()
            if is_adapter(m)
            for p in m.parameters()
            if not any(p is q for q in m.base.parameters())
        }

    def trainable_parameters(self, which: str) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of a group, in the model's order: "hyper" (what makes the visual K/V,
        and the gates), "all" (language model + projector: the vision tower's features are cached)
        or "adapters" (what `wrap_linears` added)."""
        if which == "all":
            parts = ("mllama.language_model.", "mllama.multi_modal_projector.")
            return [(n, p) for n, p in self.named_parameters() if n.startswith(parts)]
        if which not in TRAINABLE:
            raise ValueError(f"a trainable group is one of {', '.join(TRAINABLE)}, not {which!r}")
        own = self._hyper() if which == "hyper" else self._adapters()
        return [(n, p) for n, p in self.named_parameters() if id(p) in own]

    def projector_trains(self) -> bool:
        """Whether the projector is trained (then the step runs it with grad on cached tower
        features)."""
        return any(p.requires_grad for p in self.mllama.multi_modal_projector.parameters())

    # ---- adapters
    # ----------------------------------------------------------------------------------------------
    def _places(self) -> Iterator[tuple[nn.Module, str, str]]:
        """(owner, attribute, name) of every attention projection of the language model."""
        for i, layer in enumerate(self._decoder_layers()):
            part = "cross_attn" if isinstance(layer, CrossAttentionLayer) else "self_attn"
            owner = getattr(layer, part)
            for t in ADAPTED:
                yield owner, t, f"{PREFIX}.{i}.{part}.{t}"

    def _slots(self) -> Iterator[tuple[str, nn.Module]]:
        for owner, attr, name in self._places():
            yield name, getattr(owner, attr)

    def lora_targets(self) -> Iterator[tuple[str, nn.Linear]]:
        """(name, Linear) of every attention projection not yet wrapped by an adapter."""
        for name, mod in self._slots():
            if isinstance(mod, nn.Linear):
                yield name, mod

    def wrap_linears(self, factory: Callable[[nn.Linear], nn.Module]) -> list[str]:
        """Put `factory(linear)` in place of every `lora_targets` Linear; returns their names (the
        saved weights fold each back in under its Linear's key)."""
        return wrap_linears(self._places(), factory)

    # ---- vision
    # ----------------------------------------------------------------------------------------------
    @property
    def vision_dtype(self) -> torch.dtype:
        return self.mllama.vision_model.patch_embedding.weight.dtype

    @property
    def vision_device(self) -> torch.device:
        return self.mllama.vision_model.patch_embedding.weight.device

    def vision_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The tower's features of frames (N, 3, S, S), one tile each, before the projector:
        (N, P, vision_output_dim), what the training loop caches when the projector trains. A
        frame runs as the published processor hands the tower a one-tile image: followed by
        empty tiles up to `max_num_tiles`, which its tokens attend to; only its own tile's
        features are kept."""
        return self.tile_features(pixel_values, keep=1)[:, 0].contiguous()

    def tile_features(self, pixel_values: torch.Tensor, keep: int) -> torch.Tensor:
        """The first `keep` tiles' tower features (N, keep, P, vision_output_dim) of frames run
        as one-tile images padded with the published empty tiles (`vision_features`)."""
        n, dev = pixel_values.shape[0], self.vision_device
        tiles = self.mllama.vision_model.cfg.max_num_tiles
        ar_ids = torch.ones(n, dtype=torch.int64, device=dev)  # a (1, 1) tile grid: id 1
        ar_mask = torch.zeros(n, tiles, dtype=torch.int64, device=dev)
        ar_mask[:, 0] = 1
        shape = (n, tiles, *pixel_values.shape[1:])
        pixels = torch.zeros(shape, dtype=self.vision_dtype, device=dev)
        pixels[:, 0] = pixel_values
        return self.mllama.vision_model(pixels, ar_ids, ar_mask, keep=keep)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The projector: tower features (N, P, vision_output_dim) -> E (N, P, H), with grad."""
        return self.mllama.multi_modal_projector(features)

    # ---- recompute and checkpointing
    # ----------------------------------------------------------------------------------------------
    def visual_kv_parameters(self, layer: int) -> list[nn.Parameter]:
        """What cross layer `layer`'s visual K/V are made with (`CrossAttention.visual_kv`: k_proj,
        then the per-head k_norm, and v_proj; no RoPE), adapters included: where a recompute
        backward sends dK/dV."""
        attn = self._decoder_layers()[layer].cross_attn
        return [*attn.k_proj.parameters(), *attn.v_proj.parameters(), *attn.k_norm.parameters()]

    def checkpoint_layers(self, wrap: Callable[[Callable], Callable]) -> None:
        """Run every decoder layer through `wrap(its run)` (e.g. under `torch.utils.checkpoint`);
        a layer already wrapped is left as it is. The forward runs a layer as
        `run(layer, x, step, index)`."""
        for i, _ in enumerate(self._decoder_layers()):
            if i not in self._runs:
                self._runs[i] = wrap(self._layer)
