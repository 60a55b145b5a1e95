"""The one autograd wrapper of the cross-attention baselines that bring K/V to the queries (Ring,
all-gather).

Both take `lv_xattn`'s arguments, exchange the K/V shard lengths once per call, save the same
tensors and add the bytes they send to `stats` ("fwd_bytes" / "bwd_bytes"); they differ only in how
K/V travel, which a `KVExchange` says.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from lvx_app.parallel.collectives import count_bytes, exchange_sizes


class KVExchange(NamedTuple):
    """How one baseline moves K/V, as two functions of (.., sizes, group, scale), sizes = every
    rank's K/V length.

    forward(q, k, v, q_vis, k_frame, sizes, group, scale) -> (out, lse float32, bytes sent);
    backward(dout, q, k, v, out, lse, q_vis, k_frame, sizes, group, scale) -> (dq, dk, dv, bytes
    sent).
    """

    forward: Callable[..., tuple[Tensor, Tensor, int]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor, int]]


def _forward(exchange: KVExchange, q, k, v, group, scale, q_vis, k_frame, stats):
    (sizes,) = exchange_sizes(k.shape[1], group=group, device=q.device)
    out, lse, sent = exchange.forward(q, k, v, q_vis, k_frame, sizes, group, scale)
    count_bytes(stats, "fwd_bytes", sent)
    return out.to(q.dtype), lse, sizes


class _KVMovingXAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange: KVExchange, q, k, v, group, scale, q_vis, k_frame, stats):
        out, lse, sizes = _forward(exchange, q, k, v, group, scale, q_vis, k_frame, stats)
        ctx.save_for_backward(q, k, v, out, lse, q_vis, k_frame)
        ctx.exchange, ctx.sizes, ctx.group, ctx.scale, ctx.stats = (
            exchange,
            sizes,
            group,
            scale,
            stats,
        )
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_vis, k_frame = ctx.saved_tensors
        dq, dk, dv, sent = ctx.exchange.backward(
            dout.contiguous(), q, k, v, out, lse, q_vis, k_frame, ctx.sizes, ctx.group, ctx.scale
        )
        count_bytes(ctx.stats, "bwd_bytes", sent)
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def kv_moving_xattn(
    exchange: KVExchange,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group,
    scale: float | None,
    q_vis: Tensor | None,
    k_frame: Tensor | None,
    stats: dict | None,
) -> Tensor:
    """This rank's cross-attention output, K/V moved by `exchange`; differentiable in q, k, v."""
    return _KVMovingXAttn.apply(exchange, q, k, v, group, scale, q_vis, k_frame, stats)


@torch.no_grad()
def kv_moving_xattn_with_lse(
    exchange: KVExchange,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group,
    scale: float | None,
    q_vis: Tensor | None,
    k_frame: Tensor | None,
    stats: dict | None,
) -> tuple[Tensor, Tensor]:
    """Forward only, for inference: this rank's (out in q's dtype, lse (B, Hq, Sq) float32), K/V
    moved by `exchange`."""
    out, lse, _ = _forward(exchange, q, k, v, group, scale, q_vis, k_frame, stats)
    return out, lse
