"""Grouped-query attention by row packing: the G query heads of each K/V head become G rows, so no
kernel sees a K/V copy.

Qwen2's convention: K/V head i serves query heads i·G … i·G+G−1. A query block (B, S, Hkv·G, D)
becomes (B, S·G, Hkv, D) with row s·G+g holding token s's query head i·G+g; every kernel then runs
with Hkv heads on the unrepeated K/V, and dK/dV come out with Hkv heads directly. lse (B, Hkv·G, S)
packs to (B, Hkv, S·G) the same way. Each packed row keeps its token's `q_vis` and causal position
(row r is token r // G).

A causal square (token i sees key j <= i) cannot run on packed rows: for it the G groups are folded
into the batch instead, (B, S·G, Hkv, D) -> (B·G, S, Hkv, D), with the K/V broadcast over the new
batch entries (a view when B == 1, the engine's only batch) for the kernels that take any batch
stride.
"""

from __future__ import annotations

from torch import Tensor


def pack_rows(x: Tensor, g: int) -> Tensor:
    """(B, S, Hkv·G, D) -> (B, S·G, Hkv, D), row s·G+g = query head i·G+g of token s."""
    if g == 1:
        return x
    b, s, h, d = x.shape
    return x.reshape(b, s, h // g, g, d).transpose(2, 3).reshape(b, s * g, h // g, d)


def unpack_rows(x: Tensor, g: int) -> Tensor:
    """Inverse of `pack_rows`: (B, S·G, Hkv, D) -> (B, S, Hkv·G, D)."""
    if g == 1:
        return x
    b, sg, hkv, d = x.shape
    return x.reshape(b, sg // g, g, hkv, d).transpose(2, 3).reshape(b, sg // g, hkv * g, d)


def pack_lse(lse: Tensor, g: int) -> Tensor:
    """(B, Hkv·G, S) -> (B, Hkv, S·G), matching `pack_rows`."""
    if g == 1:
        return lse
    b, h, s = lse.shape
    return lse.reshape(b, h // g, g, s).transpose(2, 3).reshape(b, h // g, s * g)


def unpack_lse(lse: Tensor, g: int) -> Tensor:
    """Inverse of `pack_lse`: (B, Hkv, S·G) -> (B, Hkv·G, S)."""
    if g == 1:
        return lse
    b, hkv, sg = lse.shape
    return lse.reshape(b, hkv, sg // g, g).transpose(2, 3).reshape(b, hkv * g, sg // g)


def fold(x: Tensor, g: int) -> Tensor:
    """Packed rows (B, S·G, Hkv, D) -> (B·G, S, Hkv, D): batch entry b·G+g holds query head i·G+g
    of every token."""
    b, sg, h, d = x.shape
    return x.reshape(b, sg // g, g, h, d).transpose(1, 2).reshape(b * g, sg // g, h, d)


def unfold(x: Tensor, g: int) -> Tensor:
    """Inverse of `fold`: (B·G, S, Hkv, D) -> packed rows (B, S·G, Hkv, D)."""
    bg, s, h, d = x.shape
    return x.reshape(bg // g, g, s, h, d).transpose(1, 2).reshape(bg // g, s * g, h, d)


def fold_lse(lse: Tensor, g: int) -> Tensor:
    """Packed lse (B, Hkv, S·G) -> (B·G, Hkv, S), matching `fold`."""
    b, h, sg = lse.shape
    return lse.reshape(b, h, sg // g, g).permute(0, 3, 1, 2).reshape(b * g, h, sg // g)


def unfold_lse(lse: Tensor, g: int) -> Tensor:
    """Inverse of `fold_lse`: (B·G, Hkv, S) -> (B, Hkv, S·G)."""
    bg, h, s = lse.shape
    return lse.reshape(bg // g, g, h, s).permute(0, 2, 3, 1).reshape(bg // g, h, s * g)


# backends whose kernels take a K/V batch of stride 0 (the others get the K/V copied per group)
STRIDED_BATCH = ("math", "cpu", "flash", "flash_attn")


def broadcast_kv(x: Tensor, g: int, backend: str) -> Tensor:
    """K or V (B, S, Hkv, D) for the G folded batch entries of each of its batch rows: (B·G, S, Hkv,
    D), a view for one batch row on a backend of `STRIDED_BATCH`."""
    wide = x.unsqueeze(1).expand(x.shape[0], g, *x.shape[1:]).reshape(-1, *x.shape[1:])
    return wide if backend in STRIDED_BATCH else wide.contiguous()
