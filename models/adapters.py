"""What every family's finetuning shares about adapters: which module is one, and a state dict with
each folded into its Linear, so a family's saved weights keep the published keys."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn


def is_adapter(module: nn.Module) -> bool:
    """A module an adapter factory made: it wraps its Linear as `.base` and folds itself into the
    Linear's weight with `merged_weight()`."""
    return isinstance(getattr(module, "base", None), nn.Linear) and hasattr(module, "merged_weight")


def merged_state_dict(
    model: nn.Module, dtype: Optional[torch.dtype] = None
) -> dict[str, torch.Tensor]:
    """The module's weights under its own keys, adapters merged (`merged_weight()` for their
    Linear's weight, their own tensors dropped), detached, on CPU, contiguous."""
    out: dict[str, torch.Tensor] = {}
    adapters = {name: m for name, m in model.named_modules() if is_adapter(m)}
    for key, t in model.state_dict().items():
        owner = next((n for n in adapters if key.startswith(n + ".")), None)
        if owner is not None:
            rest = key[len(owner) + 1 :]
            if not rest.startswith("base."):
                continue
            key = f"{owner}.{rest.removeprefix('base.')}"
            if rest == "base.weight":
                t = adapters[owner].merged_weight()
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[key] = t.to("cpu").contiguous()
    return out


def wrap_linears(
    places: Iterable[tuple[nn.Module, str, str]], factory: Callable[[nn.Linear], nn.Module]
) -> list[str]:
    """Put `factory(linear)` in place of each Linear at (owner, attribute, name); returns the names
    of those wrapped (a place already wrapped is left as it is)."""
    wrapped = []
    for owner, attr, name in list(places):
        lin = getattr(owner, attr)
        if isinstance(lin, nn.Linear):
            setattr(owner, attr, factory(lin))
            wrapped.append(name)
    return wrapped
