"""Pass-KV Ring Attention: the cross-attention baseline and sharded causal self-attention.

Queries stay on their rank; the K/V shards (un-repeated GQA heads, plus the key frame indices of the
media mask) travel the ring (`pass_kv`), one hop per round; the partial (out, lse) of each block is
merged in float32.

`ring_xattn` is the honest Ring Attention baseline for LV-XAttn: it moves 2·S_kv/n·H_kv·D elements
per hop (no `repeat_kv` before the ring).

`ring_self_attn` is causal self-attention over a sharded text sequence with zigzag load balancing
(`lvx_app.attention.layout`): rank r holds chunks r and 2n-1-r, so every round costs each rank the
same half block: the own-shard round is causal, a shard from a lower rank is seen only through its
first chunk, a shard from a higher rank only by the second chunk of the local queries. Blocks
entirely in the future are never computed; empty chunks (very short sequences) are skipped.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lvx_app.parallel.collectives import count_bytes, exchange_sizes
from lvx_app.parallel.group import get_rank
from lvx_app.parallel.layout import zigzag_chunk_sizes
from lvx_kernels.kernels import attn_bwd, attn_fwd
from lvx_kernels.merge import merge_
from scripts.baselines.kv_xattn import KVExchange, kv_moving_xattn, kv_moving_xattn_with_lse
from scripts.baselines.pass_kv import Block, empty_result, pass_kv_backward, pass_kv_forward

# ---------------------------------------------------------------- cross-attention


def _frame(shard: Block):
    return shard[2] if len(shard) > 2 else None


def _xattn_forward(q, k, v, q_vis, k_frame, sizes, group, scale):
    out, lse = empty_result(q)

    def compute(src, shard):
        if q.shape[1] == 0:
            return
        o, l_ = attn_fwd(q, shard[0], shard[1], scale=scale, q_vis=q_vis, k_frame=_frame(shard))
        merge_(out, lse, o, l_)

    block = [k, v] if k_frame is None else [k, v, k_frame]
    return out, lse, pass_kv_forward(block, sizes, group, compute)


def _xattn_backward(dout, q, k, v, out, lse, q_vis, k_frame, sizes, group, scale):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def compute(src, shard):
        if q.shape[1] == 0:
            return None
        dq_b, dk_b, dv_b = attn_bwd(
            dout, q, shard[0], shard[1], out, lse, scale=scale, q_vis=q_vis, k_frame=_frame(shard)
        )
        dq.add_(dq_b)
        return 0, dk_b, dv_b

    block = [k, v] if k_frame is None else [k, v, k_frame]
    dk, dv, sent = pass_kv_backward(block, sizes, group, compute)
    return dq, dk, dv, sent


_PASS_KV = KVExchange(_xattn_forward, _xattn_backward)


def ring_xattn(
    q, k, v, *, group=None, scale=None, q_vis=None, k_frame=None, stats: dict | None = None
):
    """Exact distributed cross-attention by Ring Attention (pass-KV); same contract as `lv_xattn`.

    q: this rank's query block (B, Sq_i, Hq, D); k, v: this rank's K/V shard (B, Skv_i, Hkv, D) (GQA
    heads are not repeated, so the ring moves only H_kv heads); q_vis (B, Sq_i) / k_frame (B,
    Skv_i): media mask, key s visible to query t iff k_frame[s] < q_vis[t]; k_frame travels with its
    shard. Shards may be uneven or empty. Returns this rank's output. `stats`, if given, accumulates
    "fwd_bytes" / "bwd_bytes" sent by this rank.
    """
    return kv_moving_xattn(_PASS_KV, q, k, v, group, scale, q_vis, k_frame, stats)


def ring_xattn_with_lse(
    q, k, v, *, group=None, scale=None, q_vis=None, k_frame=None, stats: dict | None = None
):
    """`ring_xattn`, forward only, returning (out, lse float32) like `lv_xattn_with_lse` (the
    engine's Ring option)."""
    return kv_moving_xattn_with_lse(_PASS_KV, q, k, v, group, scale, q_vis, k_frame, stats)


# ---------------------------------------------------------------- causal self-attention


def _self_attn_plan(sizes: Sequence[int], rank: int, layout: str):
    """For each source rank: (query rows, key rows, causal) to compute, or None to skip.

    Rows are (start, stop) within the local query shard and the source's K/V shard.
    """
    world = len(sizes)
    if layout == "contiguous":
        return [
            None if src > rank else ((0, sizes[rank]), (0, sizes[src]), src == rank)
            for src in range(world)
        ]
    if layout != "zigzag":
        raise ValueError(f"layout must be 'zigzag' or 'contiguous', not {layout!r}")
    chunks = zigzag_chunk_sizes(sum(sizes), world)
    for r in range(world):
        if sizes[r] != chunks[r] + chunks[2 * world - 1 - r]:
            raise ValueError(
                f"rank {r} holds {sizes[r]} tokens, but a zigzag shard of {sum(sizes)} tokens over "
                f"{world} ranks has a different length; shard the sequence with zigzag_shard(x, "
                "rank, world)"
            )
    first = chunks[rank]  # local rows [0, first) are chunk `rank`, the rest chunk 2n-1-rank
    plan = []
    for src in range(world):
        if src == rank:
            plan.append(((0, sizes[rank]), (0, sizes[src]), True))
        elif src < rank:  # both local chunks see all of chunk `src`, none of chunk 2n-1-src
            plan.append(((0, sizes[rank]), (0, chunks[src]), False))
        else:  # only local chunk 2n-1-rank sees the source shard, all of it
            plan.append(((first, sizes[rank]), (0, sizes[src]), False))
    return plan


class _RingSelfAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, layout, stats):
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                "ring_self_attn needs q and k/v shards of the same length (self-attention)"
            )
        (sizes,) = exchange_sizes(q.shape[1], group=group, device=q.device)
        plan = _self_attn_plan(sizes, get_rank(group), layout)
        out, lse = empty_result(q)

        def compute(src, shard):
            if plan[src] is None:
                return
            (q0, q1), (k0, k1), causal = plan[src]
            if q1 <= q0 or k1 <= k0:
                return
            o, l = attn_fwd(
                q[:, q0:q1], shard[0][:, k0:k1], shard[1][:, k0:k1], scale=scale, causal=causal
            )
            merge_(out[:, q0:q1], lse[:, :, q0:q1], o, l)

        count_bytes(stats, "fwd_bytes", pass_kv_forward([k, v], sizes, group, compute))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.sizes, ctx.group, ctx.scale, ctx.stats = plan, sizes, group, scale, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        plan = ctx.plan

        def compute(src, shard):
            if plan[src] is None:
                return None
            (q0, q1), (k0, k1), causal = plan[src]
            if q1 <= q0 or k1 <= k0:
                return None
            dq_b, dk_b, dv_b = attn_bwd(
                dout[:, q0:q1],
                q[:, q0:q1],
                shard[0][:, k0:k1],
                shard[1][:, k0:k1],
                out[:, q0:q1],
                lse[:, :, q0:q1],
                scale=ctx.scale,
                causal=causal,
            )
            dq[:, q0:q1] += dq_b
            return k0, dk_b, dv_b

        dk, dv, sent = pass_kv_backward([k, v], ctx.sizes, ctx.group, compute)
        count_bytes(ctx.stats, "bwd_bytes", sent)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_self_attn(
    q, k, v, *, group=None, scale=None, layout: str = "zigzag", stats: dict | None = None
):
    """Exact causal self-attention over a sequence sharded across ranks (pass-KV ring).

    q, k, v: this rank's shard (B, S_i, H, D) (k/v may have fewer heads: GQA). layout "zigzag"
    (default, load-balanced): shard with `zigzag_shard`; rank r holds chunks r and 2n-1-r. layout
    "contiguous": rank r holds the r-th contiguous slice (any lengths; rank n-1 does n times the
    work of rank 0). Returns this rank's output shard, same layout.
    """
    return _RingSelfAttn.apply(q, k, v, group, scale, layout, stats)
