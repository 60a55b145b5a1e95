"""Distributed attention for lvx: block kernels returning (out, lse), the lse merge,
LV-XAttn (pass-Q ring cross-attention), decode combine, and the baselines."""

from lvx_app.attention.allgather import allgather_xattn
from lvx_app.attention.decode import decode_xattn
from lvx_app.attention.kernels import attention, attn_bwd, attn_fwd, available_backends
from lvx_app.attention.lv_xattn import lv_xattn, lv_xattn_with_lse
from lvx_app.attention.merge import merge, merge_, merge_many
from lvx_app.attention.ring import ring_self_attn, ring_xattn, zigzag_indices, zigzag_shard, zigzag_unshard
from lvx_app.attention.ulysses import ulysses_supported, ulysses_xattn

__all__ = [
    "allgather_xattn",
    "attention",
    "attn_bwd",
    "attn_fwd",
    "available_backends",
    "decode_xattn",
    "lv_xattn",
    "lv_xattn_with_lse",
    "merge",
    "merge_",
    "merge_many",
    "ring_self_attn",
    "ring_xattn",
    "ulysses_supported",
    "ulysses_xattn",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]
