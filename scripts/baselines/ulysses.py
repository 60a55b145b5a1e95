"""DeepSpeed-Ulysses cross-attention: all-to-all from sequence shards to head shards and back.

One all-to-all turns each rank's (B, S_i, H, D) sequence shard of Q, K and V into (B, S, H/n, D):
the whole sequence for n-th of the heads. Each rank then runs one local attention over its heads,
and a second all-to-all returns the output to the sequence layout. The media mask's q_vis / k_frame
are all-gathered (every rank now holds the whole sequence). Backward does the same with dO in and
dQ, dK, dV out.

Head counts: the query heads must divide by the world size n. The K/V heads
must either divide by n, or divide n (GQA with fewer K/V heads than ranks):
then each K/V head is repeated n/H_kv times before the all-to-all, so every
rank receives the one K/V head its query heads use (what yunchang does), and
the repeated heads' gradients are summed back. Anything else raises a
ValueError that says which counts work; use ring_xattn or lv_xattn there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lvx_app.parallel.collectives import allgather_seq, count_bytes, exchange_sizes, nbytes
from lvx_app.parallel.group import get_rank, get_world_size
from lvx_kernels.kernels import attn_bwd, attn_fwd


def ulysses_supported(q_heads: int, kv_heads: int, world: int) -> str | None:
    """None if Ulysses can split these heads over `world` ranks, else the reason why not."""
    if q_heads % world:
        return f"{q_heads} query heads do not divide over {world} ranks"
    if kv_heads % world and world % kv_heads:
        return f"{kv_heads} key/value heads neither divide over {world} ranks nor divide {world}"
    if q_heads % kv_heads:
        return f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads"
    return None


def _seq_to_heads(x: torch.Tensor, sizes: list[int], group) -> tuple[torch.Tensor, int]:
    """(B, S_i, H, D) sequence shard -> (B, S, H/n, D) head shard; returns (tensor, bytes sent)."""
    world = len(sizes)
    if world == 1:
        return x, 0
    b, s, h, d = x.shape
    # Seq-first so all_to_all_single's dim-0 splits are the heads groups going out and the ranks'
    # sequence shards coming in: (n, S_i, B, H/n, D) -> (S, B, H/n, D).
    send = (
        x.reshape(b, s, world, h // world, d)
        .permute(2, 1, 0, 3, 4)
        .reshape(world * s, b, h // world, d)
    )
    recv = x.new_empty((sum(sizes), b, h // world, d))
    sent = nbytes(send) * (world - 1) // world
    dist.all_to_all_single(
        recv, send, output_split_sizes=sizes, input_split_sizes=[s] * world, group=group
    )
    return recv.permute(1, 0, 2, 3), sent


def _heads_to_seq(y: torch.Tensor, sizes: list[int], group) -> tuple[torch.Tensor, int]:
    """(B, S, H/n, D) head shard -> (B, S_i, H, D) sequence shard; returns (tensor, bytes sent)."""
    world = len(sizes)
    if world == 1:
        return y, 0
    b, _, h, d = y.shape
    mine = sizes[get_rank(group)]
    send = y.permute(1, 0, 2, 3).contiguous()  # (S, B, H/n, D), split by the ranks' sequence shards
    recv = y.new_empty((world * mine, b, h, d))
    sent = (sum(sizes) - mine) * b * h * d * y.element_size()
    dist.all_to_all_single(
        recv, send, output_split_sizes=[mine] * world, input_split_sizes=sizes, group=group
    )
    out = recv.view(world, mine, b, h, d).permute(2, 1, 0, 3, 4).reshape(b, mine, world * h, d)
    return out, sent


class _UlyssesXAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, q_vis, k_frame, stats):
        world = get_world_size(group)
        why = ulysses_supported(q.shape[2], k.shape[2], world)
        if why is not None:
            raise ValueError(
                f"ulysses_xattn cannot shard heads: {why}; use lv_xattn or ring_xattn instead"
            )
        repeat = world // k.shape[2] if k.shape[2] < world else 1
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        q_sizes, kv_sizes = exchange_sizes(q.shape[1], k.shape[1], group=group, device=q.device)
        sent = 0
        qh, n = _seq_to_heads(q, q_sizes, group)
        sent += n
        kh, n = _seq_to_heads(k, kv_sizes, group)
        sent += n
        vh, n = _seq_to_heads(v, kv_sizes, group)
        sent += n
        q_vis_all, k_frame_all = None, None
        if q_vis is not None:
            q_vis_all, n = allgather_seq(q_vis, q_sizes, group)
            sent += n
        if k_frame is not None:
            k_frame_all, n = allgather_seq(k_frame, kv_sizes, group)
            sent += n
        out_h, lse_h = attn_fwd(qh, kh, vh, scale=scale, q_vis=q_vis_all, k_frame=k_frame_all)
        out_h = out_h.to(q.dtype)
        out, n = _heads_to_seq(out_h, q_sizes, group)
        count_bytes(stats, "fwd_bytes", sent + n)
        ctx.save_for_backward(qh, kh, vh, out_h, lse_h, q_vis_all, k_frame_all)
        ctx.q_sizes, ctx.kv_sizes, ctx.repeat = q_sizes, kv_sizes, repeat
        ctx.group, ctx.scale, ctx.stats = group, scale, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, out_h, lse_h, q_vis_all, k_frame_all = ctx.saved_tensors
        group = ctx.group
        dout_h, sent = _seq_to_heads(dout.contiguous(), ctx.q_sizes, group)
        dqh, dkh, dvh = attn_bwd(
            dout_h, qh, kh, vh, out_h, lse_h, scale=ctx.scale, q_vis=q_vis_all, k_frame=k_frame_all
        )
        dq, n1 = _heads_to_seq(dqh, ctx.q_sizes, group)
        dk, n2 = _heads_to_seq(dkh, ctx.kv_sizes, group)
        dv, n3 = _heads_to_seq(dvh, ctx.kv_sizes, group)
        count_bytes(ctx.stats, "bwd_bytes", sent + n1 + n2 + n3)
        if ctx.repeat > 1:
            b, s, h, d = dk.shape
            dk = dk.view(b, s, h // ctx.repeat, ctx.repeat, d).sum(3)
            dv = dv.view(b, s, h // ctx.repeat, ctx.repeat, d).sum(3)
        return dq, dk, dv, None, None, None, None, None


def ulysses_xattn(
    q, k, v, *, group=None, scale=None, q_vis=None, k_frame=None, stats: dict | None = None
):
    """Exact distributed cross-attention by DeepSpeed-Ulysses head sharding; same contract as
    `lv_xattn`.

    Needs query heads divisible by the world size and K/V heads that divide by it or divide it (see
    the module doc); raises ValueError otherwise. `stats`, if given, accumulates "fwd_bytes" /
    "bwd_bytes" sent by this rank.
    """
    return _UlyssesXAttn.apply(q, k, v, group, scale, q_vis, k_frame, stats)
