"""All-gather cross-attention: gather every K/V shard, then one local attention.

The simplest exact baseline (PyTorch context parallel's default rotation and
ring-flash-attn's "llama3" variant): every rank all-gathers the full K, V (and `k_frame`), attends
its local queries to all of them, and in backward re-gathers K/V (only the local shard is saved, as
in the llama3 variant) and reduce-scatters dK/dV back to their owners. It moves (n-1)/n of the whole
K/V to every rank, so it is the worst case for long video; it is here for honest comparison.

Shards may be uneven or empty; their lengths are exchanged once per call
(lvx_app.parallel.collectives), and padded to the longest for the transfer (the bytes counted
include that padding).
"""

from __future__ import annotations

from lvx_app.parallel.collectives import allgather_seq, reduce_scatter_seq
from lvx_kernels.kernels import attn_bwd, attn_fwd
from scripts.baselines.kv_xattn import KVExchange, kv_moving_xattn, kv_moving_xattn_with_lse


def _gather_kv(k, v, k_frame, sizes, group):
    """Every rank's K, V (and k_frame) concatenated in rank order; returns (k_all, v_all,
    k_frame_all, bytes sent)."""
    k_all, sent_k = allgather_seq(k, sizes, group)
    v_all, sent_v = allgather_seq(v, sizes, group)
    kf_all, sent_f = allgather_seq(k_frame, sizes, group) if k_frame is not None else (None, 0)
    return k_all, v_all, kf_all, sent_k + sent_v + sent_f


def _forward(q, k, v, q_vis, k_frame, sizes, group, scale):
    k_all, v_all, kf_all, sent = _gather_kv(k, v, k_frame, sizes, group)
    out, lse = attn_fwd(q, k_all, v_all, scale=scale, q_vis=q_vis, k_frame=kf_all)
    return out, lse, sent


def _backward(dout, q, k, v, out, lse, q_vis, k_frame, sizes, group, scale):
    k_all, v_all, kf_all, sent = _gather_kv(k, v, k_frame, sizes, group)
    dq, dk_all, dv_all = attn_bwd(
        dout, q, k_all, v_all, out, lse, scale=scale, q_vis=q_vis, k_frame=kf_all
    )
    # Sum the partial dK/dV of every rank in float32, then cast once.
    dk, sent_dk = reduce_scatter_seq(dk_all.float(), sizes, group)
    dv, sent_dv = reduce_scatter_seq(dv_all.float(), sizes, group)
    return dq, dk, dv, sent + sent_dk + sent_dv


_ALL_GATHER = KVExchange(_forward, _backward)


def allgather_xattn(
    q, k, v, *, group=None, scale=None, q_vis=None, k_frame=None, stats: dict | None = None
):
    """Exact distributed cross-attention by all-gathering K/V (same contract as `lv_xattn`).

    q: this rank's query block (B, Sq_i, Hq, D); k, v: this rank's K/V shard (B, Skv_i, Hkv, D),
    un-repeated GQA heads; q_vis (B, Sq_i) / k_frame (B, Skv_i): the media mask. Returns this rank's
    output (B, Sq_i, Hq, D). `stats`, if given, accumulates "fwd_bytes" / "bwd_bytes" sent by this
    rank.
    """
    return kv_moving_xattn(_ALL_GATHER, q, k, v, group, scale, q_vis, k_frame, stats)


def allgather_xattn_with_lse(
    q, k, v, *, group=None, scale=None, q_vis=None, k_frame=None, stats: dict | None = None
):
    """`allgather_xattn`, forward only, returning (out, lse float32) like `lv_xattn_with_lse` (the
    engine's option)."""
    return kv_moving_xattn_with_lse(_ALL_GATHER, q, k, v, group, scale, q_vis, k_frame, stats)
