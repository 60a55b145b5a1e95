"""Grouped-query attention by row packing: the G query heads of each K/V head become G rows, so no
kernel sees a K/V copy.

Qwen2's convention: K/V head i serves query heads i·G … i·G+G−1. A query block (B, S, Hkv·G, D)
becomes (B, S·G, Hkv, D) with row s·G+g holding token s's query head i·G+g; every kernel then runs
with Hkv heads on the unrepeated K/V, and dK/dV come out with Hkv heads directly. lse (B, Hkv·G, S)
packs to (B, Hkv, S·G) the same way. Each packed row keeps its token's `q_vis` and causal position
(row r is token r // G).
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
