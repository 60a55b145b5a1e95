"""Attention as the product runs it over the ranks: LV-XAttn (pass-Q ring cross-attention), the
decode combine (what the engine's gather schedule runs for queries every rank holds) and the
ring-or-gather choice, over the block kernels returning (out, lse) and the lse merge of
`lvx_kernels` (re-exported here).

The baselines it is measured against live beside the product, in `scripts/baselines/`."""

from lvx_app.attention.decode_xattn import decode_xattn
from lvx_app.attention.lv_xattn import (
    lv_xattn,
    lv_xattn_backward,
    lv_xattn_forward,
    lv_xattn_with_lse,
)
from lvx_app.attention.schedule import SCHEDULES, choose_schedule
from lvx_kernels.backends import available_backends
from lvx_kernels.carry import Carry
from lvx_kernels.kernels import attention, attn_bwd, attn_fwd, check_inputs
from lvx_kernels.merge import merge, merge_, merge_many, merge_seen

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
