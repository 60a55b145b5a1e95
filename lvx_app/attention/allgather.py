"""All-gather cross-attention: gather every K/V shard, then one local attention.

The simplest exact baseline (PyTorch context parallel's default rotation and
ring-flash-attn's "llama3" variant): every rank all-gathers the full K, V (and
`k_frame`), attends its local queries to all of them, and in backward
re-gathers K/V (only the local shard is saved, as in the llama3 variant) and
reduce-scatters dK/dV back to their owners. It moves (n-1)/n of the whole K/V
to every rank, so it is the worst case for long video; it is here for honest
comparison.

Shards may be uneven or empty; their lengths are exchanged once per call
(lvx_app.parallel.collectives), and padded to the longest for the transfer (the
bytes counted include that padding).
"""

from __future__ import annotations

import torch

from lvx_app.attention.kernels import attn_bwd, attn_fwd
from lvx_app.parallel.collectives import allgather_seq, count_bytes, exchange_sizes, reduce_scatter_seq


class _AllGatherXAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, q_vis, k_frame, stats):
        (sizes,) = exchange_sizes(k.shape[1], group=group, device=q.device)
        k_all, sent_k = allgather_seq(k, sizes, group)
        v_all, sent_v = allgather_seq(v, sizes, group)
        kf_all, sent_f = allgather_seq(k_frame, sizes, group) if k_frame is not None else (None, 0)
        count_bytes(stats, "fwd_bytes", sent_k + sent_v + sent_f)
        out, lse = attn_fwd(q, k_all, v_all, scale=scale, q_vis=q_vis, k_frame=kf_all)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_vis, k_frame)
        ctx.sizes, ctx.group, ctx.scale, ctx.stats = sizes, group, scale, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_vis, k_frame = ctx.saved_tensors
        sizes, group = ctx.sizes, ctx.group
        k_all, sent_k = allgather_seq(k, sizes, group)
        v_all, sent_v = allgather_seq(v, sizes, group)
        kf_all, sent_f = allgather_seq(k_frame, sizes, group) if k_frame is not None else (None, 0)
        dq, dk_all, dv_all = attn_bwd(
            dout.contiguous(), q, k_all, v_all, out, lse, scale=ctx.scale, q_vis=q_vis, k_frame=kf_all
        )
        # Sum the partial dK/dV of every rank in float32, then cast once.
        dk, sent_dk = reduce_scatter_seq(dk_all.float(), sizes, group)
        dv, sent_dv = reduce_scatter_seq(dv_all.float(), sizes, group)
        count_bytes(ctx.stats, "bwd_bytes", sent_k + sent_v + sent_f + sent_dk + sent_dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def allgather_xattn(q, k, v, *, group=None, scale=None, q_vis=None, k_frame=None, stats: dict | None = None):
    """Exact distributed cross-attention by all-gathering K/V (same contract as `lv_xattn`).

    q: this rank's query block (B, Sq_i, Hq, D); k, v: this rank's K/V shard
    (B, Skv_i, Hkv, D), un-repeated GQA heads; q_vis (B, Sq_i) / k_frame
    (B, Skv_i): the media mask. Returns this rank's output (B, Sq_i, Hq, D).
    `stats`, if given, accumulates "fwd_bytes" / "bwd_bytes" sent by this rank.
    """
    return _AllGatherXAttn.apply(q, k, v, group, scale, q_vis, k_frame, stats)
