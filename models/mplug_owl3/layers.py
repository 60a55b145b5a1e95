"""Small building blocks shared by the language model and the hyper layers: RMSNorm, RoPE, SwiGLU,
and the fused projections a decoded token runs through (one matmul where the weights allow)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Qwen2 RMSNorm: normalise in float32, cast back to the input dtype, then scale by the
    weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 (what `torch.promote_types(dtype, float32)` gives for the
    float dtypes, without an op)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Functional RMSNorm (used on the visual stream with a hyper layer's own input_layernorm
    weight): one fused op where x and the weight are float32 (float64), as the official code
    computes it; a narrower x is normalised in float32 and cast back before the scale."""
    wide = _wide(x.dtype)
    if x.dtype == wide and weight.dtype == wide:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.to(wide), (x.shape[-1],), eps=eps).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (shape positions.shape + (head_dim,)) for any integer positions.

    NeoX rotate-half layout: inv_freq_i = theta^(-2i/d), angles = cat(freqs, freqs). Computed on the
    fly, so there is no table and no 32768 limit (the official code indexes a table of
    max_position_embeddings rows). Angles are float32 like the official code (and HF Qwen2); float64
    models pass dtype=torch.float64 for exact tests.
    """
    dtype = _wide(dtype)
    inv_freq = 1.0 / (
        theta
        ** (
            torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).to(dtype)
            / head_dim
        )
    )
    freqs = positions.to(dtype)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(D/2) * _signed_sin(sin),
    exactly (a negation rounds the same before or after a product)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class Rope:
    """One forward's RoPE, shared by every layer: cos and the signed sin of its positions, shaped
    (B, L, 1, D) and cast once to the dtype the layers rotate in, so rotating a (B, L, heads, D)
    tensor is four ops with no per-head reshape."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
        cos, sin = cos.unsqueeze(-2), _signed_sin(sin).unsqueeze(-2)
        self.cos = cos if cos.dtype == dtype else cos.to(dtype)
        self.sin = sin if sin.dtype == dtype else sin.to(dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, L, heads, D) rotated at the forward's positions (Qwen2's text RoPE)."""
        return x * self.cos + x.roll(x.shape[-1] // 2, -1) * self.sin


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fp32: bool = False
) -> torch.Tensor:
    """Rotate x (B, L, heads, D) by cos/sin (B, L, D) (broadcast over heads).

    fp32=False: cos/sin are cast to x's dtype and applied in it (Qwen2's text RoPE).
    fp32=True: applied in cos's dtype (float32, or float64) and cast back (the official MI-RoPE on
    visual keys).
    """
    if not fp32:
        return Rope(cos, sin, x.dtype).apply(x)
    return Rope(cos, sin, cos.dtype).apply(x.to(cos.dtype)).to(x.dtype)


class FusedLinear:
    """Several bias-alike `nn.Linear`s as one: their weights (and biases) are row blocks of one
    tensor, and the Linears' parameters become views of it, so the checkpoint's keys and loading
    stay as they are (a copy into a Linear's weight writes the fused one) and one matmul computes
    every output. It serves only while the Linears are the ones fused and hold those views."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.weight = torch.cat([l.weight.detach() for l in linears])
        biased = linears[0].bias is not None
        self.bias = torch.cat([l.bias.detach() for l in linears]) if biased else None
        rows = [l.weight.shape[0] for l in linears]
        for l, w in zip(linears, self.weight.split(rows)):
            l.weight = nn.Parameter(w, requires_grad=l.weight.requires_grad)
        if biased:
            for l, b in zip(linears, self.bias.split(rows)):
                l.bias = nn.Parameter(b, requires_grad=l.bias.requires_grad)
        self._pointers = self._held()

    def _held(self) -> tuple[int, ...]:
        params = [l.weight for l in self.linears]
        params += [l.bias for l in self.linears if l.bias is not None]
        return tuple(p.data_ptr() for p in params)

    def serves(self, *linears: nn.Module) -> bool:
        """Whether one matmul on the fused weight still equals `linears` (the modules in place now)
        without autograd: the same modules, their parameters still views of it (checked in eager
        code; a compiled step trusts it, as `_apply` and loading re-fuse)."""
        if torch.is_grad_enabled() or any(a is not b for a, b in zip(linears, self.linears)):
            return False
        return torch.compiler.is_compiling() or self._held() == self._pointers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def can_fuse(*linears: nn.Module) -> bool:
    """Whether `linears` are plain Linears on one device and dtype, with biases alike, loaded."""
    if not all(type(l) is nn.Linear for l in linears):
        return False
    weights = [l.weight for l in linears]
    alike = {(w.device, w.dtype, w.shape[1], l.bias is None) for w, l in zip(weights, linears)}
    return len(alike) == 1 and not weights[0].is_meta


class Fusing(nn.Module):
    """A module whose Linears may be fused (`fuse_projections`); moving or casting it (`_apply`) or
    loading weights by assignment fuses them again from the new parameters."""

    FUSED: tuple[tuple[str, ...], ...] = ()  # groups of Linear attribute names fused together

    def __init__(self) -> None:
        super().__init__()
        self.fused: dict[tuple[str, ...], FusedLinear] = {}
        self.register_load_state_dict_post_hook(Fusing._after_load)

    def fuse_projections(self) -> None:
        """Fuse every group of `FUSED` that can be (a no-op for the others)."""
        self.fused = {}
        for names in self.FUSED:
            linears = [getattr(self, n) for n in names]
            if can_fuse(*linears):
                self.fused[names] = FusedLinear(*linears)

    def fused_call(self, names: tuple[str, ...], x: torch.Tensor) -> Optional[torch.Tensor]:
        """The group's outputs side by side from one matmul, or None where the fused weight does
        not serve (autograd on, a Linear replaced, parameters moved)."""
        fused = self.fused.get(names)
        if fused is None or not fused.serves(*(getattr(self, n) for n in names)):
            return None
        return fused(x)

    @staticmethod
    def _after_load(module: "Fusing", _keys) -> None:
        if module.fused:  # weights assigned, not copied, are no longer views of the fused ones
            module.fuse_projections()

    def _apply(self, fn, recurse=True):
        was = bool(self.fused)
        self.fused = {}  # the old views would pin the old tensors
        out = super()._apply(fn, recurse)
        if was:
            self.fuse_projections()
        return out


class SwiGLU(Fusing):
    """Qwen2 MLP: down(silu(gate(x)) * up(x)), no biases; gate and up in one matmul once fused."""

    FUSED = (("gate_proj", "up_proj"),)

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.fused_call(self.FUSED[0], x)
        if both is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = both.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
