"""LV-XAttn: exact distributed cross-attention that moves queries, never keys.

Each of n ranks holds its own visual K/V shard (any length, may be empty; it
never leaves the rank) and its own slice of the text queries (any length, may
be empty; the lengths are exchanged with one tiny all_gather per forward,
reused by the backward, or passed in as `q_sizes`). All ranks must agree on
batch, query heads, head_dim, dtype, scale, whether a media mask is used and its `window` (each
query sees only the latest `window` frames of its q_vis; it travels as the q_vis it is read from).
Query block j starts on rank j and walks the ring r -> r+1:

forward, round t on rank r (it holds block j = r - t, `held_len` = S_j rows):
  1. post the P2P that passes Q_j (+ its q_vis row) on to r+1 and receives
     Q_{j-1} (`next_q`, `next_len` rows) for the next round (t < n-1);
  2. compute the partial (o, lse) of Q_j against the local K/V (`partial_out`,
     `partial_lse`; fully hidden tiles and empty shards are skipped inside
     `attn_fwd`);
  3. wait for the running (O_j, lse_j) that rank r-1 merged last round, merge
     the partial into it (log-sum-exp, float32);
  4. post the P2P that passes (O_j, lse_j) on (`running`: packed in one
     float32 buffer).
After n rounds every block has seen every shard and its (O, lse) is home:
n-1 Q transfers and n (O, lse) transfers per rank, no K/V transfer. Bytes
sent by rank r, with S_j the length of block j held in round t:
  forward  sum_{t<n-1} S_j*B*(Hq*D*esize + 4*[mask]) + sum_t S_j*B*Hq*(D*4 + 4)
  backward sum_{t<n-1} S_j*B*(3*Hq*D*esize + n_l*Hq*4 + 4*[mask]) + sum_t S_j*B*Hq*D*4
(n_l = 2 with lse, 1 for `lv_xattn`); pass `stats={}` to get them added up as fwd_bytes / bwd_bytes.
Empty blocks are never sent (one-sided P2P instead of padding).

backward: the same four steps, with (Q_j, dO_j, O_j) [one packed q-dtype message], (lse_j[, dlse_j])
[one float32 message] and q_vis_j travelling in step 1, the block backward in step 2, and the dQ_j
accumulator (float32, `running_dq`) waited for in step 3 and passed on in step 4; dK, dV accumulate
locally (float32) and are exact because every block backward uses the final (O, lse).
A round plans the query block it holds from the host: the caller's own q_vis as `masks.Indices`,
a received one from its sender's host copy when the caller passes every rank's (`q_vis_every`, as
the engine does from the forward's `Feed`), so no round of the forward reads the device.
`lv_xattn_forward` / `lv_xattn_backward` are the two rings without autograd, for callers that run
their own backward (recompute in finetuning).

On CUDA the P2P runs on `RingComm`'s side stream. (Untested without a GPU.) The running (O, lse)
is kept, merged and sent in float32 between hops whatever the model computes in (`wire_dtype`), as
the ring libraries keep theirs: only the final O is rounded to the model's dtype, once. Float64
inputs keep O/lse in float64 (exact tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lvx_app.parallel import RingComm, get_world_size
from lvx_app.parallel.collectives import count_bytes, exchange_sizes
from lvx_kernels.backends import augment_kv, augments_head_dim
from lvx_kernels.kernels import attn_bwd, attn_fwd, check_inputs
from lvx_kernels.masks import Indices, MaskIndex, device_tensor
from lvx_kernels.merge import acc_dtype, merge_


def query_sizes(q: Tensor, group, n: int, rank: int, known=None) -> list[int]:
    """Every rank's query-block length: `known` (checked) or one all_gather of one int."""
    if known is not None:
        known = [int(x) for x in known]
        if len(known) != n or known[rank] != q.shape[1]:
            raise ValueError(
                f"q_sizes {known} must list {n} block lengths with q_sizes[{rank}] == {q.shape[1]}"
            )
        return known
    (sizes,) = exchange_sizes(q.shape[1], group=group, device=q.device)
    return sizes


def _travelling(q_vis: MaskIndex | None) -> MaskIndex | None:
    """This rank's q_vis as it travels (int32), with what the host knows of it (`masks.Indices`),
    so the first round plans its tiles without reading the device."""
    if isinstance(q_vis, Indices):
        return q_vis.as_type(torch.int32)
    return None if q_vis is None else q_vis.to(torch.int32).contiguous()


def _with_host(q_vis: MaskIndex | None, every: Sequence[Tensor] | None, sender: int):
    """A query block's q_vis with its sender's host copy from `every` (every rank's q_vis on the
    host, in rank order), so the round that holds it plans without reading the device."""
    if q_vis is None or every is None:
        return q_vis
    if isinstance(q_vis, Indices) and q_vis.values is not None:
        return q_vis
    return Indices(device_tensor(q_vis), values=every[sender])


def wire_dtype(q: Tensor) -> torch.dtype:
    """The dtype the running O travels and is kept in between hops: float32 (float64 for float64
    inputs), whatever the model computes in. Rounding it to bf16 at every hop adds one bf16
    rounding per rank (8 hops: about four times one kernel's own error)."""
    return acc_dtype(q)


def _out_lse_buffer(q: Tensor, rows: int) -> Tensor:
    """One flat byte buffer for a block's running (O, lse) of `rows` query rows, so it travels as
    one message: lse in float32 (float64) first, then O in `wire_dtype`."""
    b, _, hq, d = q.shape
    lse_bytes = b * hq * rows * acc_dtype(q).itemsize
    return torch.empty(
        lse_bytes + b * rows * hq * d * wire_dtype(q).itemsize, dtype=torch.uint8, device=q.device
    )


def _out_lse_views(buf: Tensor, q: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """The (O (B, rows, Hq, D), lse (B, Hq, rows)) views of an `_out_lse_buffer`."""
    b, _, hq, d = q.shape
    lse_bytes = b * hq * rows * acc_dtype(q).itemsize
    lse = buf[:lse_bytes].view(acc_dtype(q)).view(b, hq, rows)
    return buf[lse_bytes:].view(wire_dtype(q)).view(b, rows, hq, d), lse


def _merge_running(running: Tensor, q: Tensor, rows: int, out: Tensor, lse: Tensor) -> None:
    """Merge a partial (out, lse) into a block's running buffer in place (both float32)."""
    run_out, run_lse = _out_lse_views(running, q, rows)
    merge_(run_out, run_lse, out, lse)


def lv_xattn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    q_vis: MaskIndex | None,
    k_frame: MaskIndex | None,
    group: dist.ProcessGroup | None,
    q_sizes: list[int] | None,
    q_vis_every: Sequence[Tensor] | None = None,
    alibi: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor, list[int], int]:
    # long: the ring's rounds in one place, in the four steps the module docstring names
    """The forward ring without autograd: (out in q's dtype, lse float32, every rank's query-block
    length, bytes sent).

    Inputs as `lv_xattn_with_lse` (checked by the caller); pass the returned sizes to
    `lv_xattn_backward`. `q_vis_every`: every rank's q_vis on the host (rank order), so no round
    reads a received q_vis from the device. `alibi`: ALiBi slopes (`kernels.attn_fwd`)."""
    n = get_world_size(group)
    b, sq, hq, d = q.shape
    q_ring, out_ring = RingComm(group, q.device), RingComm(group, q.device)
    rank = q_ring.rank
    sizes = query_sizes(q, group, n, rank, q_sizes)
    held_q = q
    held_q_vis = _travelling(_with_host(q_vis, q_vis_every, rank))
    running = None  # the held block's running (O, lse), one `_out_lse_buffer`
    for t in range(n):
        held = (rank - t) % n
        held_len, next_len = sizes[held], sizes[(held - 1) % n]
        if t < n - 1:  # 1. pass the held query block on, receive the next round's
            wire_vis = device_tensor(held_q_vis)
            next_q = q.new_empty(b, next_len, hq, d)
            next_q_vis = wire_vis.new_empty(b, next_len) if wire_vis is not None else None
            q_ring.post([(held_q, next_q), (wire_vis, next_q_vis)])
        if held_len:  # 2. partial result against the local shard (overlaps the transfers)
            partial_out, partial_lse = attn_fwd(
                held_q,
                k,
                v,
                scale=scale,
                q_vis=held_q_vis,
                k_frame=k_frame,
                alibi=alibi,
                window=window,
            )
        if (
            t > 0
        ):  # 3. the running (O, lse) rank r-1 passed on last round; merge the partial into it
            out_ring.wait()
        if held_len:
            if t == 0:
                running = _out_lse_buffer(q, held_len)
                out_view, lse_view = _out_lse_views(running, q, held_len)
                out_view.copy_(partial_out)
                lse_view.copy_(partial_lse)
            else:
                _merge_running(running, q, held_len, partial_out, partial_lse)
        if n == 1:
            break
        # 4. pass (O, lse) on; the last round's send brings every block home
        next_running = _out_lse_buffer(q, next_len)
        out_ring.post([(running, next_running)])
        if t < n - 1:
            q_ring.wait()
            held_q, held_q_vis = next_q, _with_host(next_q_vis, q_vis_every, (held - 1) % n)
        running = next_running
    if n > 1:
        out_ring.wait()
    sent = q_ring.bytes_sent + out_ring.bytes_sent
    if sq == 0:
        return (
            q.new_zeros(b, 0, hq, d),
            torch.empty(b, hq, 0, dtype=acc_dtype(q), device=q.device),
            sizes,
            sent,
        )
    out, lse = _out_lse_views(running, q, sq)
    return out.to(q.dtype), lse, sizes, sent


def _backward_block(
    q: Tensor,
    dout: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    q_vis: MaskIndex | None,
    with_lse: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """What of this rank's query block travels in backward: (Q, dO, O) stacked in q's dtype, (lse[,
    dlse]) stacked in float32, q_vis as int32."""
    b, sq, hq, _ = q.shape
    qdo = torch.stack([q, dout.to(q.dtype), out.to(q.dtype)])
    lses = torch.empty(2 if with_lse else 1, b, hq, sq, dtype=acc_dtype(q), device=q.device)
    lses[0] = lse
    if with_lse:
        lses[1] = 0 if dlse is None else dlse
    q_vis = device_tensor(q_vis)
    return qdo, lses, q_vis.to(torch.int32).contiguous() if q_vis is not None else None


def lv_xattn_backward(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float | None,
    q_vis: MaskIndex | None,
    k_frame: MaskIndex | None,
    group: dist.ProcessGroup | None,
    with_lse: bool,
    sizes: list[int],
    alibi: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, int]:
    # long: the backward ring's rounds in one place, in the same four steps
    """The backward ring without autograd: (dq, dk, dv, bytes sent), given the final (out, lse) and
    the sizes of `lv_xattn_forward`. `with_lse`: carry dlse (zeros where None) around the ring, on
    every rank."""
    n = get_world_size(group)
    b, sq, hq, d = q.shape
    q_ring, dq_ring = RingComm(group, q.device), RingComm(group, q.device)
    rank = q_ring.rank
    dk = torch.zeros(k.shape, dtype=acc_dtype(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype(v), device=v.device)
    # in fp16 dlse rides through the aten backward ops as extra K/V columns: built once, not per
    # round (bf16 and float32 fold it into O, `backends.fold_dlse`)
    widened = with_lse and k.shape[1] and augments_head_dim(k.dtype)
    kv_aug = augment_kv(k, v) if widened else None
    held_qdo, held_lses, held_q_vis = _backward_block(q, dout, out, lse, dlse, q_vis, with_lse)
    running_dq = None  # the held block's dQ accumulator (float32)
    for t in range(n):
        held = (rank - t) % n
        held_len, next_len = sizes[held], sizes[(held - 1) % n]
        if t < n - 1:  # 1. pass the held block on, receive the next round's
            next_qdo = q.new_empty(3, b, next_len, hq, d)
            next_lses = held_lses.new_empty(len(held_lses), b, hq, next_len)
            next_q_vis = held_q_vis.new_empty(b, next_len) if held_q_vis is not None else None
            q_ring.post([(held_qdo, next_qdo), (held_lses, next_lses), (held_q_vis, next_q_vis)])
        if held_len:  # 2. this shard's share of dQ_j, and its dK, dV
            held_q, held_dout, held_out = held_qdo
            partial_dq, partial_dk, partial_dv = attn_bwd(
                *(held_dout, held_q, k, v, held_out, held_lses[0]),
                scale=scale,
                q_vis=held_q_vis,
                k_frame=k_frame,
                dlse=held_lses[1] if with_lse else None,
                kv_aug=kv_aug,
                alibi=alibi,
                window=window,
            )
            dk += partial_dk
            dv += partial_dv
        if t > 0:  # 3. the dQ_j accumulator rank r-1 passed on last round; add this shard's share
            dq_ring.wait()
        if held_len:
            if t == 0:
                running_dq = partial_dq.to(acc_dtype(q))
            else:
                running_dq += partial_dq
        if n == 1:
            break
        # 4. pass dQ_j on
        next_dq = torch.empty(b, next_len, hq, d, dtype=acc_dtype(q), device=q.device)
        dq_ring.post([(running_dq, next_dq)])
        if t < n - 1:
            q_ring.wait()
            held_qdo, held_lses, held_q_vis = next_qdo, next_lses, next_q_vis
        running_dq = next_dq
    if n > 1:
        dq_ring.wait()
    sent = q_ring.bytes_sent + dq_ring.bytes_sent
    dq = torch.zeros_like(q) if running_dq is None or sq == 0 else running_dq.to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype), sent


class _LVXAttn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, scale, q_vis, k_frame, group, with_lse, q_sizes, stats, every, alibi, window
    ):
        out, lse, sizes, sent = lv_xattn_forward(
            q, k, v, scale, q_vis, k_frame, group, q_sizes, every, alibi, window
        )
        count_bytes(stats, "fwd_bytes", sent)
        ctx.stats = stats
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, q_vis, k_frame, group, with_lse, sizes, alibi, window)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, q_vis, k_frame, group, with_lse, sizes, alibi, window = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, sent = lv_xattn_backward(
            *(dout, dlse, q, k, v, out, lse, scale, q_vis, k_frame, group, with_lse, sizes),
            *(alibi, window),
        )
        count_bytes(ctx.stats, "bwd_bytes", sent)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def _lv_xattn(
    q,
    k,
    v,
    with_lse,
    group,
    scale,
    q_vis,
    k_frame,
    q_sizes,
    stats,
    q_vis_every=None,
    alibi=None,
    window=None,
) -> tuple[Tensor, Tensor]:
    check_inputs(q, k, v, q_vis, k_frame, window)
    return _LVXAttn.apply(
        q, k, v, scale, q_vis, k_frame, group, with_lse, q_sizes, stats, q_vis_every, alibi, window
    )


def lv_xattn_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    q_sizes: list[int] | None = None,
    stats: dict | None = None,
    q_vis_every: Sequence[Tensor] | None = None,
    alibi: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """LV-XAttn over the ranks of `group`; returns this rank's (out (B,Sq,Hq,D) q dtype, lse
    (B,Hq,Sq) float32).

    q: this rank's query block (B, Sq_r, Hq, D), any length incl. 0; k, v: this rank's K/V shard (B,
    Sk_r, Hkv, D), any length incl. 0, never sent. q_vis (B, Sq_r) and k_frame (B, Sk_r): the media
    mask (see masks). `scale` defaults to 1/sqrt(D) and must match on all ranks, as must B, Hq, D
    and the dtype. `q_sizes`: every rank's query-block length in group-rank order, if the caller
    knows it (skips the one all_gather of sizes per call).
    `stats`: a dict to which the bytes this rank sends are added (fwd_bytes, bwd_bytes).
    `q_vis_every`: every rank's q_vis (B, Sq_r) on the host, in group-rank order, if the caller
    knows them: each round then plans the query block it holds from its sender's host copy (no
    device read per round). `window`: each query sees only the latest `window` frames of its q_vis.
    `alibi`: (Hq,) ALiBi slopes, the bias at the positions q_vis - 1 and k_frame (a sharded text
    attention's causality as media mask).
    Differentiable through both outputs (the backward always carries dlse around the ring, zeros
    where the loss does not use lse).
    """
    return _lv_xattn(
        q, k, v, True, group, scale, q_vis, k_frame, q_sizes, stats, q_vis_every, alibi, window
    )


def lv_xattn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    q_sizes: list[int] | None = None,
    stats: dict | None = None,
    q_vis_every: Sequence[Tensor] | None = None,
    window: int | None = None,
) -> Tensor:
    """LV-XAttn, output only (the backward ring carries no dlse); see `lv_xattn_with_lse`."""
    return _lv_xattn(
        q, k, v, False, group, scale, q_vis, k_frame, q_sizes, stats, q_vis_every, window=window
    )[0]
