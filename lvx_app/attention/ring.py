"""Pass-KV Ring Attention: the cross-attention baseline and sharded causal self-attention.

Queries stay on their rank; the K/V shards (un-repeated GQA heads, plus the
key frame indices of the media mask) travel the ring, one hop per round, with
the next round's transfer posted before this round's block is computed. The
partial (out, lse) of each block is merged in float32. Backward rotates K/V
again, and a second ring carries each shard's float32 dK/dV accumulator along
with it, so the gradient arrives back at the shard's owner after n hops
(ring-flash-attn's scheme); dQ accumulates locally.

`ring_xattn` is the honest Ring Attention baseline for LV-XAttn: it moves
2·S_kv/n·H_kv·D elements per hop (no `repeat_kv` before the ring).

`ring_self_attn` is causal self-attention over a sharded text sequence with
zigzag load balancing: the sequence is cut into 2n chunks and rank r holds
chunks r and 2n-1-r (ring-flash-attn's zigzag, PyTorch CP's load balancing;
Striped Attention / DistFlashAttn balance the same way). Every round then
costs each rank the same half block: the own-shard round is causal, a shard
from a lower rank is seen only through its first chunk, a shard from a higher
rank only by the second chunk of the local queries. Blocks entirely in the
future are never computed. Lengths not divisible by 2n give uneven chunks
(`torch.tensor_split` sizes: the first S mod 2n chunks are one longer); very
short sequences give empty chunks, which are skipped.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from lvx_app.attention.kernels import attn_bwd, attn_fwd
from lvx_app.attention.merge import merge_
from lvx_app.parallel.collectives import count_bytes, exchange_sizes
from lvx_app.parallel.group import get_rank
from lvx_app.parallel.ring import RingComm

Block = list  # the travelling tensors of one shard: [k, v] or [k, v, k_frame]


def _resized(x: torch.Tensor, length: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], length, *x.shape[2:]))


def _rotate(comm: RingComm, block: Block, length: int) -> Block:
    """Queue sending `block` to rank+1 and receiving the previous rank's (of `length`) into new buffers."""
    return [comm.send_recv(x, _resized(x, length)) for x in block]


def _pass_kv_forward(block: Block, sizes: Sequence[int], group, compute: Callable[[int, Block], None]) -> int:
    """Visit every rank's shard: `compute(src_rank, shard)` once per shard; returns bytes sent."""
    world, rank = len(sizes), get_rank(group)
    comm = RingComm(group) if world > 1 else None
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            nxt = _rotate(comm, block, sizes[(src - 1) % world])
            comm.commit()
        if sizes[src] > 0:
            compute(src, block)
        if step < world - 1:
            comm.wait()
            block = nxt
    return comm.bytes_sent if comm is not None else 0


def _pass_kv_backward(
    block: Block, sizes: Sequence[int], group, compute: Callable[[int, Block], tuple | None]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Backward ring: `compute(src, shard)` returns (first key row, dk, dv) of that shard's part, or None.

    The float32 (dk, dv) accumulator of each shard travels with it and reaches
    its owner after the last hop. Returns this rank's (dk, dv, bytes sent).
    """
    world, rank = len(sizes), get_rank(group)
    k = block[0]
    acc = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
    if world == 1:
        _add_grads(acc, compute(rank, block) if sizes[rank] > 0 else None)
        return acc[0], acc[1], 0
    kv_comm, grad_comm = RingComm(group), RingComm(group)
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            nxt = _rotate(kv_comm, block, sizes[(src - 1) % world])
            kv_comm.commit()
        grads = compute(src, block) if sizes[src] > 0 else None
        if step > 0:
            grad_comm.wait()
            acc = incoming  # noqa: F821 (set by the previous step)
        _add_grads(acc, grads)
        # Send this shard's accumulator on; after the last round it goes home.
        incoming = _rotate(grad_comm, acc, sizes[(src - 1) % world])
        grad_comm.commit()
        if step < world - 1:
            kv_comm.wait()
            block = nxt
    grad_comm.wait()
    return incoming[0], incoming[1], kv_comm.bytes_sent + grad_comm.bytes_sent


def _add_grads(acc: list[torch.Tensor], grads: tuple | None) -> None:
    if grads is not None:
        start, dk, dv = grads
        acc[0][:, start : start + dk.shape[1]] += dk
        acc[1][:, start : start + dv.shape[1]] += dv


def _empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


# ---------------------------------------------------------------- cross-attention


class _RingXAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, q_vis, k_frame, stats):
        (sizes,) = exchange_sizes(k.shape[1], group=group, device=q.device)
        out, lse = _empty_result(q)
        block = [k, v] if k_frame is None else [k, v, k_frame]

        def compute(src, shard):
            if q.shape[1] == 0:
                return
            o, l = attn_fwd(q, shard[0], shard[1], scale=scale, q_vis=q_vis, k_frame=_frame(shard))
            merge_(out, lse, o, l)

        count_bytes(stats, "fwd_bytes", _pass_kv_forward(block, sizes, group, compute))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_vis, k_frame)
        ctx.sizes, ctx.group, ctx.scale, ctx.stats = sizes, group, scale, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_vis, k_frame = ctx.saved_tensors
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = [k, v] if k_frame is None else [k, v, k_frame]

        def compute(src, shard):
            if q.shape[1] == 0:
                return None
            dq_b, dk_b, dv_b = attn_bwd(
                dout, q, shard[0], shard[1], out, lse, scale=ctx.scale, q_vis=q_vis, k_frame=_frame(shard)
            )
            dq.add_(dq_b)
            return 0, dk_b, dv_b

        dk, dv, sent = _pass_kv_backward(block, ctx.sizes, ctx.group, compute)
        count_bytes(ctx.stats, "bwd_bytes", sent)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _frame(shard: Block):
    return shard[2] if len(shard) > 2 else None


def ring_xattn(q, k, v, *, group=None, scale=None, q_vis=None, k_frame=None, stats: dict | None = None):
    """Exact distributed cross-attention by Ring Attention (pass-KV); same contract as `lv_xattn`.

    q: this rank's query block (B, Sq_i, Hq, D); k, v: this rank's K/V shard
    (B, Skv_i, Hkv, D) (GQA heads are not repeated, so the ring moves only
    H_kv heads); q_vis (B, Sq_i) / k_frame (B, Skv_i): media mask, key s
    visible to query t iff k_frame[s] < q_vis[t]; k_frame travels with its
    shard. Shards may be uneven or empty. Returns this rank's output.
    `stats`, if given, accumulates "fwd_bytes" / "bwd_bytes" sent by this rank.
    """
    return _RingXAttn.apply(q, k, v, group, scale, q_vis, k_frame, stats)


# ---------------------------------------------------------------- zigzag layout


def zigzag_chunk_sizes(seq_len: int, world: int) -> list[int]:
    """Lengths of the 2·world chunks (`torch.tensor_split` rule: the first seq_len mod 2n are one longer)."""
    base, extra = divmod(seq_len, 2 * world)
    return [base + (1 if i < extra else 0) for i in range(2 * world)]


def zigzag_indices(seq_len: int, rank: int, world: int, device=None) -> torch.Tensor:
    """Global positions held by `rank`: chunk `rank` then chunk `2·world-1-rank` (use for position ids)."""
    sizes = zigzag_chunk_sizes(seq_len, world)
    starts = [sum(sizes[:i]) for i in range(2 * world)]
    a, b = rank, 2 * world - 1 - rank
    return torch.cat(
        [
            torch.arange(starts[a], starts[a] + sizes[a], device=device),
            torch.arange(starts[b], starts[b] + sizes[b], device=device),
        ]
    )


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag shard of a full sequence (any length; chunks may be uneven or empty)."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], rank, world, device=x.device))


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `zigzag_shard`: the full sequence from every rank's shard (in rank order)."""
    world = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    idx = torch.cat([zigzag_indices(seq_len, r, world, device=shards[0].device) for r in range(world)])
    every = torch.cat(list(shards), dim=dim)
    return torch.empty_like(every).index_copy_(dim, idx, every)


def _self_attn_plan(sizes: Sequence[int], rank: int, layout: str):
    """For each source rank: (query rows, key rows, causal) to compute, or None to skip.

    Rows are (start, stop) within the local query shard and the source's K/V shard.
    """
    world = len(sizes)
    if layout == "contiguous":
        return [
            None if src > rank else ((0, sizes[rank]), (0, sizes[src]), src == rank) for src in range(world)
        ]
    if layout != "zigzag":
        raise ValueError(f"layout must be 'zigzag' or 'contiguous', not {layout!r}")
    chunks = zigzag_chunk_sizes(sum(sizes), world)
    for r in range(world):
        if sizes[r] != chunks[r] + chunks[2 * world - 1 - r]:
            raise ValueError(
                f"rank {r} holds {sizes[r]} tokens, but a zigzag shard of {sum(sizes)} tokens over {world} "
                "ranks has a different length; shard the sequence with zigzag_shard(x, rank, world)"
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
            raise ValueError("ring_self_attn needs q and k/v shards of the same length (self-attention)")
        (sizes,) = exchange_sizes(q.shape[1], group=group, device=q.device)
        plan = _self_attn_plan(sizes, get_rank(group), layout)
        out, lse = _empty_result(q)

        def compute(src, shard):
            if plan[src] is None:
                return
            (q0, q1), (k0, k1), causal = plan[src]
            if q1 <= q0 or k1 <= k0:
                return
            o, l = attn_fwd(q[:, q0:q1], shard[0][:, k0:k1], shard[1][:, k0:k1], scale=scale, causal=causal)
            merge_(out[:, q0:q1], lse[:, :, q0:q1], o, l)

        count_bytes(stats, "fwd_bytes", _pass_kv_forward([k, v], sizes, group, compute))
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

        dk, dv, sent = _pass_kv_backward([k, v], ctx.sizes, ctx.group, compute)
        count_bytes(ctx.stats, "bwd_bytes", sent)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_self_attn(q, k, v, *, group=None, scale=None, layout: str = "zigzag", stats: dict | None = None):
    """Exact causal self-attention over a sequence sharded across ranks (pass-KV ring).

    q, k, v: this rank's shard (B, S_i, H, D) (k/v may have fewer heads: GQA).
    layout "zigzag" (default, load-balanced): shard with `zigzag_shard`; rank r
    holds chunks r and 2n-1-r. layout "contiguous": rank r holds the r-th
    contiguous slice (any lengths; rank n-1 does n times the work of rank 0).
    Returns this rank's output shard, same layout.
    """
    return _RingSelfAttn.apply(q, k, v, group, scale, layout, stats)
