"""Decoding against sharded visual K/V: one local attention and one collective, no ring.

Every rank passes the SAME query (the one or few new text tokens) and its own K/V shard (may be
empty). Each rank computes the partial (out, lse) against its shard, one all_gather of the packed
[out | lse] (float32) brings all n partials to every rank, and the exact log-sum-exp merge combines
them in rank order, so every rank gets a bit-identical result (Tree-Attention style, one collective
instead of three all-reduces). Forward only (runs under
no_grad): decoding never needs gradients.

A `Carry` rides along: a few numbers each rank appends to the packed partials of one call, and gets
back from every rank. The engine uses it to agree on the decoded token inside a step's first hyper
layer instead of a collective of its own (lvx_app/engine/session.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lvx_app.attention.kernels import attn_fwd
from lvx_app.attention.merge import acc_dtype, merge_many
from lvx_app.parallel import get_world_size
from lvx_app.parallel.collectives import count_bytes, nbytes


class Carry:
    """Integers (1-D tensor) this rank adds to the next `decode_xattn` call; `received` (n, m):
    every rank's, in rank order, once that call has run. They ride bit for bit inside the float
    partials
    (an int32 in a float32 slot, an int64 in a float64 one), so any id travels exactly."""

    def __init__(self, send: Tensor) -> None:
        self.send = send.flatten()
        self.received: Tensor | None = None

    def packed(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """`send` as `dtype` elements holding its integers' bits."""
        return self.send.to(device=device, dtype=_BITS[dtype]).view(dtype)

    def unpack(self, gathered: Tensor) -> None:
        """Keep every rank's integers from their packed rows (n, m)."""
        self.received = gathered.contiguous().view(_BITS[gathered.dtype]).to(torch.int64)


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


@torch.no_grad()
def decode_xattn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_vis: Tensor | None = None,
    k_frame: Tensor | None = None,
    stats: dict | None = None,
    carry: Carry | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns (out (B,Sq,Hq,D) in q's dtype, lse (B,Hq,Sq) float32), identical on every rank.

    `stats`: a dict to which the bytes this rank sends are added ("fwd_bytes"). `carry`: exchanged
    in this call's collective unless it already was."""
    out, lse = attn_fwd(q, k, v, scale=scale, q_vis=q_vis, k_frame=k_frame)
    n = get_world_size(group)
    ride = carry is not None and carry.received is None
    if n == 1:
        if ride:
            carry.received = carry.send.view(1, -1).to(torch.int64)
        return out, lse
    b, sq, hq, d = q.shape
    ct = acc_dtype(q)
    parts = [out.to(ct).flatten(), lse.to(ct).flatten()]
    if ride:
        parts.append(carry.packed(ct, out.device))
    packed = torch.cat(parts)
    gathered = [torch.empty_like(packed) for _ in range(n)]
    sent = (n - 1) * nbytes(packed)
    dist.all_gather(gathered, packed, group=group)
    count_bytes(stats, "fwd_bytes", sent)
    allp = torch.stack(gathered)  # (n, B*Sq*Hq*D + B*Hq*Sq)
    n1 = b * sq * hq * d
    outs = allp[:, :n1].reshape(n, b, sq, hq, d)
    lses = allp[:, n1 : n1 + b * hq * sq].reshape(n, b, hq, sq)
    if ride:
        carry.unpack(allp[:, n1 + b * hq * sq :])
    merged_out, merged_lse = merge_many(outs, lses)
    return merged_out.to(q.dtype), merged_lse
