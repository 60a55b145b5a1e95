"""What finetuning asks of OpenFlamingo (`surface.Finetunable`), as the other families give it:
trainable groups, the Linears an adapter may wrap, the vision tower split from the perceiver (the
tower's patch tokens are what the training loop caches; the perceiver is the projector), the
parameters behind each cross layer's visual K/V and checkpointed blocks (its saved weights:
`saving`).

The "hyper" group is the analogue of mPLUG-Owl3's (v_kv_proj and the gate): what makes a cross
layer's visual K/V (`attn.to_kv`) and the two tanh gates that mix its result in. "all" is what
open_flamingo trains and more: everything but the vision tower (the perceiver, every cross layer
and the whole MPT model).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from ..adapters import is_adapter, wrap_linears
from .cross import GatedCrossAttentionBlock
from .video_model import OpenFlamingoVideoModel

# the attention projections an adapter may wrap: MPT's self-attention, the cross layers' attention
SELF_ADAPTED = ("Wqkv", "out_proj")
CROSS_ADAPTED = ("to_q", "to_kv", "to_out")
TRAINABLE = ("hyper", "all", "adapters")
PREFIX = "flamingo.lang_encoder.transformer.blocks"  # the blocks' names in the engine's model


class Finetuning:
    """The methods of the engine's OpenFlamingo model the training loop calls (mixed in)."""

    flamingo: nn.Module
    _runs: dict[int, Callable]

    def _blocks(self) -> nn.ModuleList:
        return self.flamingo.lang_encoder.transformer.blocks

    def _cross_layers(self) -> Iterator[tuple[int, GatedCrossAttentionBlock]]:
        for i, block in enumerate(self._blocks()):
            if block.gated_cross_attn_layer is not None:
                yield i, block.gated_cross_attn_layer

    # ---- trainable groups ------------------------------------------------------------------------
    def _hyper(self) -> set[int]:
        """ids of every cross layer's K/V-making parameters and its two gates."""
        own: set[int] = set()
        for i, layer in self._cross_layers():
            own |= {id(p) for p in self.visual_kv_parameters(i)}
            own |= {id(layer.attn_gate), id(layer.ff_gate)}
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
        and the gates), "all" (the perceiver and the language model with its cross layers: the
        tower's features are cached) or "adapters" (what `wrap_linears` added)."""
        if which == "all":
            parts = ("flamingo.perceiver.", "flamingo.lang_encoder.")
            return [(n, p) for n, p in self.named_parameters() if n.startswith(parts)]
        if which not in TRAINABLE:
            raise ValueError(f"a trainable group is one of {', '.join(TRAINABLE)}, not {which!r}")
        own = self._hyper() if which == "hyper" else self._adapters()
        return [(n, p) for n, p in self.named_parameters() if id(p) in own]

    def projector_trains(self) -> bool:
        """Whether the perceiver is trained (then the step runs it with grad on cached tower
        features)."""
        return any(p.requires_grad for p in self.flamingo.perceiver.parameters())

    # ---- adapters --------------------------------------------------------------------------------
    def _places(self) -> Iterator[tuple[nn.Module, str, str]]:
        """(owner, attribute, name) of every attention projection of the language model."""
        for i, block in enumerate(self._blocks()):
            cross = block.gated_cross_attn_layer
            if cross is not None:
                for t in CROSS_ADAPTED:
                    yield cross.attn, t, f"{PREFIX}.{i}.gated_cross_attn_layer.attn.{t}"
            for t in SELF_ADAPTED:
                yield block.decoder_layer.attn, t, f"{PREFIX}.{i}.decoder_layer.attn.{t}"

    def _slots(self) -> Iterator[tuple[str, nn.Module]]:
        for owner, attr, name in self._places():
            yield name, getattr(owner, attr)

    def lora_targets(self) -> Iterator[tuple[str, nn.Linear]]:
        """(name, Linear) of every attention projection not yet wrapped by an adapter."""
        for name, mod in self._slots():
            if isinstance(mod, nn.Linear):
                yield name, mod

    def wrap_linears(self, factory: Callable[[nn.Linear], nn.Module]) -> list[str]:
        """Put `factory(linear)` in place of every `lora_targets` Linear; returns their names."""
        return wrap_linears(self._places(), factory)

    # ---- vision ----------------------------------------------------------------------------------
    @property
    def vision_dtype(self) -> torch.dtype:
        return self.flamingo.vision_encoder.conv1.weight.dtype

    @property
    def vision_device(self) -> torch.device:
        return self.flamingo.vision_encoder.conv1.weight.device

    def vision_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The tower's patch tokens of frames (N, 3, S, S): (N, patches, width), what the training
        loop caches when the perceiver trains."""
        return self.flamingo.vision_encoder(pixel_values.to(self.vision_device, self.vision_dtype))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The perceiver: tower features (N, patches, width) -> E (N, 64, width), with grad."""
        return self.flamingo.perceiver(features)

    # ---- recompute and checkpointing -------------------------------------------------------------
    def visual_kv_parameters(self, layer: int) -> list[nn.Parameter]:
        """What the cross layer before block `layer` makes its visual K/V with (`attn.to_kv`, an
        adapter included): where a recompute backward sends dK/dV."""
        cross = self._blocks()[layer].gated_cross_attn_layer
        return list(cross.attn.to_kv.parameters())

    def checkpoint_layers(self, wrap: Callable[[Callable], Callable]) -> None:
        """Run every block through `wrap(its run)` (e.g. under `torch.utils.checkpoint`); a block
        already wrapped is left as it is. The forward runs a block as `run(layer, x, step, i)`."""
        for i, _ in enumerate(self._blocks()):
            if i not in self._runs:
                self._runs[i] = wrap(self._layer)


class FinetunableFlamingo(Finetuning, OpenFlamingoVideoModel):
    """The engine's OpenFlamingo model with the finetuning methods."""
