"""What finetuning asks of mPLUG-Owl3 (`surface.Finetunable`): its trainable groups, the Linears an
adapter may wrap, the vision tower split from the projector, the parameters behind each hyper
layer's visual K/V and checkpointed decoder layers (its saved weights: `saving`).

The names of the model's parts live here (and in the rest of this folder), so the training loop
asks for "the hyper set" or "the adapters" and never matches a parameter name itself.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from ..adapters import is_adapter, wrap_linears

# the Linears of every decoder layer's attention an adapter wraps: the visual v_kv_proj of a hyper
# layer too, and the Linear inside the 7B-240728 G1 `gate_proj = Sequential(Linear, Sigmoid)`
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "v_kv_proj", "gate_proj")
TRAINABLE = ("hyper", "all", "adapters")


def _hyper(name: str) -> bool:
    """v_kv_proj and the G1 gate (gate_proj for 7B-240728, else gate) of a hyper layer."""
    parts = (".self_attn.v_kv_proj.", ".self_attn.gate_proj.")
    return any(p in name for p in parts) or name.endswith(".self_attn.gate")


def _all(name: str) -> bool:
    """The language model and the projector; the vision tower stays frozen (its features are
    cached)."""
    return name.startswith(("language_model.", "vision2text_model."))


class Finetuning:
    """The methods of `Owl3Model` the training loop calls (mixed into the model)."""

    vision_model: nn.Module
    vision2text_model: nn.Module
    language_model: nn.Module

    # ---- trainable groups
    # ----------------------------------------------------------------------------------------------
    def trainable_parameters(self, which: str) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of a group, in the model's order: "hyper" (what makes the visual K/V
        and the G1 gate), "all" (language model + projector) or "adapters" (what `wrap_linears`
        added)."""
        if which == "adapters":
            own = {
                id(p)
                for _, m in self._slots()
                if is_adapter(m)
                for p in m.parameters()
                if not any(p is q for q in m.base.parameters())
            }
            pick: Callable[[str, nn.Parameter], bool] = lambda n, p: id(p) in own  # noqa: E731
        elif which in ("hyper", "all"):
            test = _hyper if which == "hyper" else _all
            pick = lambda n, p: test(n)  # noqa: E731
        else:
            raise ValueError(f"a trainable group is one of {', '.join(TRAINABLE)}, not {which!r}")
        return [(n, p) for n, p in self.named_parameters() if pick(n, p)]

    def projector_trains(self) -> bool:
        """Whether the projector is trained (then the step runs it with grad on cached tower
        features)."""
        return any(p.requires_grad for p in self.vision2text_model.parameters())

    # ---- adapters
    # ----------------------------------------------------------------------------------------------
    def _slots(self) -> Iterator[tuple[str, nn.Module]]:
        """(name, module) of every place an adapter may go, wrapped or not."""
        for owner, attr, name in self._places():
            yield name, getattr(owner, attr)

    def _places(self) -> Iterator[tuple[nn.Module, str, str]]:
        for name, mod in list(self.language_model.named_modules()):
            if not name.endswith("self_attn"):
                continue
            for t in ADAPTED:
                owner, attr, full = mod, t, f"language_model.{name}.{t}"
                if isinstance(getattr(mod, t, None), nn.Sequential):  # gate_proj: its Linear
                    owner, attr, full = getattr(mod, t), "0", full + ".0"
                if getattr(owner, attr, None) is not None:
                    yield owner, attr, full

    def lora_targets(self) -> Iterator[tuple[str, nn.Linear]]:
        """(name, Linear) of every attention projection not yet wrapped by an adapter."""
        for name, mod in self._slots():
            if isinstance(mod, nn.Linear):
                yield name, mod

    def wrap_linears(self, factory: Callable[[nn.Linear], nn.Module]) -> list[str]:
        """Put `factory(linear)` in place of every `lora_targets` Linear; returns their names. The
        module made keeps the Linear as `.base` and has `merged_weight()`, so the saved weights
        have it folded in under the Linear's own key."""
        return wrap_linears(self._places(), factory)

    # ---- vision
    # ----------------------------------------------------------------------------------------------
    @property
    def vision_dtype(self) -> torch.dtype:
        return self.vision_model.embeddings.patch_embedding.weight.dtype

    @property
    def vision_device(self) -> torch.device:
        return self.vision_model.embeddings.patch_embedding.weight.device

    def vision_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The tower's features of pixel_values (N, 3, S, S) (before the projector): what the
        training loop caches when the projector trains."""
        return self.vision_model(pixel_values.to(self.vision_device, self.vision_dtype))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The projector: tower features (N, P, H_vision) -> E (N, P, H), with grad."""
        return self.vision2text_model(features)

    # ---- recompute and checkpointing
    # ----------------------------------------------------------------------------------------------
    def visual_kv_parameters(self, layer: int) -> list[nn.Parameter]:
        """The parameters hyper layer `layer`'s visual K/V are made with (`visual_kv`): its input
        norm and v_kv_proj (with any adapter), where a recompute backward sends dK/dV."""
        blk = self.language_model.model.layers[layer]
        return [*blk.input_layernorm.parameters(), *blk.self_attn.v_kv_proj.parameters()]

    def checkpoint_layers(self, wrap: Callable[[Callable], Callable]) -> None:
        """Run every decoder layer through `wrap(its forward)` (e.g. under
        `torch.utils.checkpoint`); a layer already wrapped is left as it is."""
        for layer in self.language_model.model.layers:
            if getattr(layer, "_checkpointed", False):
                continue
            layer.forward = wrap(layer.forward)
            layer._checkpointed = True
