"""The gather schedule of distributed cross-attention: for short query blocks, where the ring is
pure latency.

Same contract as `lv_xattn_with_lse` (each rank its own query block and its own K/V shard, any
length incl. 0; media mask; GQA; out and lse of this rank's rows), but no ring of n-1 dependent
rounds:

forward   one all_gather of every rank's query rows (+ q_vis), one local kernel call over all rows
          against the local shard, then `decode_xattn`'s one all_gather of the packed (O, lse)
          partials and the log-sum-exp merge in rank order; each rank keeps its own rows. 2
          collectives whatever the number of ranks.
backward  every rank already holds the merged (O, lse) of all rows: one all_gather of (dO, dlse),
          one local block backward (dK, dV exact and local), one reduce_scatter of the dQ shares. 2
          collectives.

It sends n-1 copies of all rows' Q and (O, lse) instead of the ring's one per block, so it wins only
while the rows are few; `schedule.choose_schedule` picks between the two from a measured crossover.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lvx_app.attention.decode_xattn import decode_xattn
from lvx_app.attention.lv_xattn import query_sizes
from lvx_app.parallel import get_world_size
from lvx_app.parallel.collectives import allgather_seq, count_bytes, reduce_scatter_seq
from lvx_kernels.kernels import attention, attn_bwd, check_inputs
from lvx_kernels.masks import MaskIndex, device_tensor
from lvx_kernels.merge import acc_dtype


def _rows(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


class _GatherXAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, q_vis, k_frame, group, sizes, stats):
        rank = dist.get_rank(group)
        q_all, sent_q = allgather_seq(q.contiguous(), sizes, group)
        mine_vis = device_tensor(q_vis)
        vis_all, sent_v = (
            allgather_seq(mine_vis.to(torch.int32), sizes, group)
            if mine_vis is not None
            else (None, 0)
        )
        out_all, lse_all = decode_xattn(
            q_all, k, v, group=group, scale=scale, q_vis=vis_all, k_frame=k_frame
        )
        packed = out_all.numel() + lse_all.numel()
        count_bytes(
            stats,
            "fwd_bytes",
            sent_q + sent_v + (len(sizes) - 1) * packed * torch.finfo(acc_dtype(q)).bits // 8,
        )
        ctx.save_for_backward(q_all, k, v, out_all, lse_all)
        ctx.args = (scale, vis_all, k_frame, group, sizes, rank, stats)
        ctx.set_materialize_grads(False)
        mine = _rows(sizes, rank)
        return out_all[:, mine].contiguous(), lse_all[:, :, mine].contiguous()

    @staticmethod
    def backward(ctx, dout, dlse):
        q_all, k, v, out_all, lse_all = ctx.saved_tensors
        scale, vis_all, k_frame, group, sizes, rank, stats = ctx.args
        b, _, hq, d = q_all.shape
        mine = sizes[rank]
        dout = q_all.new_zeros(b, mine, hq, d) if dout is None else dout.to(q_all.dtype)
        dlse = lse_all.new_zeros(b, hq, mine) if dlse is None else dlse.to(lse_all.dtype)
        dout_all, sent_o = allgather_seq(dout.contiguous(), sizes, group)
        dlse_all, sent_l = allgather_seq(dlse.transpose(1, 2).contiguous(), sizes, group)
        dq_all, dk, dv = attn_bwd(
            dout_all,
            q_all,
            k,
            v,
            out_all,
            lse_all,
            scale=scale,
            q_vis=vis_all,
            k_frame=k_frame,
            dlse=dlse_all.transpose(1, 2),
        )
        dq, sent_dq = reduce_scatter_seq(dq_all.to(acc_dtype(q_all)).contiguous(), sizes, group)
        count_bytes(stats, "bwd_bytes", sent_o + sent_l + sent_dq)
        return dq.to(q_all.dtype), dk, dv, None, None, None, None, None, None


def gather_xattn_with_lse(
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
) -> tuple[Tensor, Tensor]:
    """The gather schedule; arguments, results and `stats` keys as `lv_xattn_with_lse`.
    Differentiable."""
    check_inputs(q, k, v, q_vis, k_frame)
    n = get_world_size(group)
    if n == 1:
        return attention(q, k, v, scale=scale, q_vis=q_vis, k_frame=k_frame)
    sizes = query_sizes(q, group, n, dist.get_rank(group), q_sizes)
    return _GatherXAttn.apply(q, k, v, scale, q_vis, k_frame, group, sizes, stats)
