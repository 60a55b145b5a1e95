"""Distributed attention for lvx: block kernels returning (out, lse), the lse merge,
LV-XAttn (pass-Q ring cross-attention), decode combine, and the baselines."""

from lvx_app.attention.decode import decode_xattn
from lvx_app.attention.kernels import attention, attn_bwd, attn_fwd, available_backends
from lvx_app.attention.lv_xattn import lv_xattn, lv_xattn_with_lse
from lvx_app.attention.merge import merge, merge_, merge_many

__all__ = [
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
]
