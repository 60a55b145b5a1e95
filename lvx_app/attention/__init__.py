"""Attention as the product runs it: block kernels returning (out, lse), the lse merge, LV-XAttn
(pass-Q ring cross-attention), the decode combine (what the engine's gather schedule runs for
queries every rank holds) and the ring-or-gather choice.

The baselines it is measured against live beside the product, in `scripts/baselines/`."""

from lvx_app.attention.backends import available_backends
from lvx_app.attention.decode_xattn import Carry, decode_xattn
from lvx_app.attention.kernels import attention, attn_bwd, attn_fwd, check_inputs
from lvx_app.attention.lv_xattn import (
    lv_xattn,
    lv_xattn_backward,
    lv_xattn_forward,
    lv_xattn_with_lse,
)
from lvx_app.attention.merge import merge, merge_, merge_many, merge_seen
from lvx_app.attention.schedule import SCHEDULES, choose_schedule

__all__ = [
    "SCHEDULES",
    "Carry",
    "attention",
    "attn_bwd",
    "attn_fwd",
    "available_backends",
    "check_inputs",
    "choose_schedule",
    "decode_xattn",
    "lv_xattn",
    "lv_xattn_backward",
    "lv_xattn_forward",
    "lv_xattn_with_lse",
    "merge",
    "merge_",
    "merge_many",
    "merge_seen",
]
