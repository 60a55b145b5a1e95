"""Decoding against sharded visual K/V: one local attention and one collective, no ring.

Every rank passes the SAME query (the one or few new text tokens) and its own K/V shard (may be
empty). Each rank computes the partial (out, lse) against its shard, writes it into one flat float32
buffer ([out | lse | carry]), one `all_gather_into_tensor` brings all n buffers to every rank, and
one exact log-sum-exp merge (`merge_many`) combines them in rank order, so every rank gets a
bit-identical result (Tree-Attention style, one collective instead of three all-reduces). The two
buffers are kept for the session (`CombineBuffers`), so a decoded token allocates nothing for them.
The partials travel in float32 whatever the model's dtype: a token's are a few kilobytes, so the
call costs the collective's latency, not its bytes, and the merge stays exact. Forward only (runs
under no_grad): decoding never needs gradients.

A `Carry` rides along: a few numbers each rank appends to the packed partials of one call, and gets
back from every rank. The engine uses it to agree on the decoded token inside a step's first hyper
layer instead of a collective of its own (lvx_app/engine/generator.py).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import Tensor

from lvx_app.parallel import get_world_size
from lvx_app.parallel.collectives import all_gather_flat, count_bytes, nbytes
from lvx_kernels.carry import Carry
from lvx_kernels.kernels import attn_fwd
from lvx_kernels.masks import MaskIndex
from lvx_kernels.merge import acc_dtype, merge_many


class CombineBuffers:
    """The decode combine's flat buffers, what this rank sends and what every rank sent, kept
    between calls: a pair per size, the `KEEP` sizes used last (a decoded step's first combine
    carries the token and its others do not, so a step allocates nothing, and a captured step's
    pairs stay put). `send` / `every`: the last call's."""

    KEEP = 2

    def __init__(self) -> None:
        self.kept: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()
        self.send: Tensor | None = None
        self.every: Tensor | None = None

    def get(self, numel: int, ranks: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
        key = (numel, ranks, dtype, torch.device(device))
        pair = self.kept.pop(key, None)
        if pair is None:
            pair = (
                torch.empty(numel, dtype=dtype, device=device),
                torch.empty(ranks, numel, dtype=dtype, device=device),
            )
        self.kept[key] = pair
        while len(self.kept) > self.KEEP:
            self.kept.popitem(last=False)
        self.send, self.every = pair
        return pair


@torch.no_grad()
def decode_xattn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    stats: dict | None = None,
    carry: Carry | None = None,
    buffers: CombineBuffers | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns (out (B,Sq,Hq,D) in q's dtype, lse (B,Hq,Sq) float32), identical on every rank.

    `stats`: a dict to which the bytes this rank sends are added ("fwd_bytes"). `carry`: exchanged
    in this call's collective unless it already was. `buffers`: the session's (default: fresh).
    `window`: the media mask's (`attn_fwd`)."""
    out, lse = attn_fwd(q, k, v, scale=scale, q_vis=q_vis, k_frame=k_frame, window=window)
    return combine_partials(out, lse, group=group, stats=stats, carry=carry, buffers=buffers)


@torch.no_grad()
def combine_partials(
    out: Tensor,
    lse: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    stats: dict | None = None,
    carry: Carry | None = None,
    buffers: CombineBuffers | None = None,
) -> tuple[Tensor, Tensor]:
    """Every rank's partial (out, lse) of the same queries against its own keys, merged: (out in
    out's dtype, lse float32), identical on every rank (`decode_xattn`'s collective and merge)."""
    n = get_world_size(group)
    ride = carry is not None and carry.received is None
    if n == 1:
        if ride and carry.source is not None:
            carry.received = carry.source.view(1, -1).to(torch.int64).clone()
        elif ride:
            carry.received = torch.tensor([carry.numbers], dtype=torch.int64)
        return out, lse
    n_out, n_lse = out.numel(), lse.numel()
    extra = carry.count if ride else 0
    send, every = (buffers or CombineBuffers()).get(
        n_out + n_lse + extra, n, acc_dtype(out), out.device
    )
    send[:n_out].view(out.shape).copy_(out)
    send[n_out : n_out + n_lse].view(lse.shape).copy_(lse)
    if ride:
        carry.write(send[n_out + n_lse :])
    all_gather_flat(every.view(-1), send, group)
    count_bytes(stats, "fwd_bytes", (n - 1) * nbytes(send))
    if ride:
        carry.unpack(every[:, n_out + n_lse :])
    outs = every[:, :n_out].view(n, *out.shape)
    lses = every[:, n_out : n_out + n_lse].view(n, *lse.shape)
    merged_out, merged_lse = merge_many(outs, lses)
    return merged_out.to(out.dtype), merged_lse
