"""Where an answer looked: each frame's share of the visual attention mass, exact across ranks.

The engine records the queries an answer's positions send to each hyper layer's visual attention
(roped, as the kernel sees them, with each query's visible-frame count). At the end of the answer
every rank computes, against its own visual keys, each (query, head)'s log-sum-exp per local frame
(`frame_lse`, chunked over keys so memory stays bounded, the query heads of a K/V head folded onto
it, K never copied per head). One small all_gather of every rank's total gives the global
log-sum-exp per (query, head) over ALL visual keys; a frame's share is then exp(lse_frame -
lse_global), averaged over heads, hyper layers and queries, on the rank that holds the frame
(`frame_shares`). Only the shares, one float per frame, reach rank 0 (in global frame order).

The share is of the visual mass only: in a G2 hyper layer the softmax also spans the text keys, and
those are left out, so the frames' shares always sum to 1. Queries that see no frame count for
nothing. Forward only, float64 accumulation of the shares.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from lvx_app.parallel.collectives import all_gather_flat

# float32 score elements one chunk of keys may make at once (queries x heads x keys)
SCORE_CHUNK_ELEMENTS = 1 << 22


@torch.no_grad()
def frame_lse(
    q: Tensor,
    k: Tensor,
    q_vis: Tensor,
    k_frame: Tensor,
    num_frames: int,
    scale: float | None = None,
) -> Tensor:
    """Log-sum-exp of each (query, head)'s scores over each frame's keys: (T, Hq, num_frames),
    float32 (float64 for float64 inputs), -inf where the query sees no key of the frame.

    q (T, Hq, D) roped queries; k (S, Hkv, D) this rank's visual keys; q_vis (T,) how many frames
    (a prefix) each query sees; k_frame (S,) each key's global frame index (< num_frames). Keys are
    taken in chunks of whole or partial frames; a frame split over chunks is merged exactly."""
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    g = hq // hkv
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = (q.to(dt) * scale).view(t, hkv, g, d)  # query heads folded onto their K/V head
    q_vis = q_vis.to(k.device, torch.int64).view(t, 1, 1, 1)
    k_frame = k_frame.to(k.device, torch.int64).view(-1)
    out = torch.full((t, hkv, g, num_frames), -math.inf, dtype=dt, device=k.device)
    step = max(1, SCORE_CHUNK_ELEMENTS // max(1, t * hq))
    for lo in range(0, s, step):
        frames = k_frame[lo : lo + step]
        scores = torch.einsum("tkgd,skd->tkgs", qf, k[lo : lo + step].to(dt))
        scores = scores.masked_fill(frames.view(1, 1, 1, -1) >= q_vis, -math.inf)
        index = frames.view(1, 1, 1, -1).expand_as(scores)
        top = torch.full_like(out, -math.inf).scatter_reduce(3, index, scores, "amax")
        safe = torch.where(torch.isfinite(top), top, 0.0)
        mass = torch.zeros_like(out).scatter_add(3, index, (scores - safe.gather(3, index)).exp())
        out = torch.logaddexp(out, safe + mass.log())
    return out.view(t, hq, num_frames)


def _all_gather(x: Tensor, group) -> Tensor:
    """(world, *x.shape): every rank's x, in rank order."""
    world = dist.get_world_size(group)
    every = x.new_empty((world, *x.shape))
    all_gather_flat(every.view(-1), x.contiguous().view(-1), group)
    return every


@torch.no_grad()
def frame_shares(
    layers: list[tuple[Tensor, Tensor, Tensor, Tensor]],
    num_frames: int,
    group: dist.ProcessGroup | None = None,
    distributed: bool = False,
    scale: float | None = None,
) -> Tensor | None:
    """Each frame's share of the visual attention mass, (num_frames,) float64 summing to 1 (all
    zero when no query saw a frame), on rank 0 (None on the other ranks).

    `layers`: per hyper layer (q (T, Hq, D), q_vis (T,), k (S, Hkv, D), k_frame (S,)), the same
    queries on every rank, this rank's keys. `distributed`: merge over the group (every rank
    calls, with the same layers in the same order)."""
    rank = dist.get_rank(group) if distributed else 0
    device = layers[0][2].device if layers else torch.device("cpu")
    total = torch.zeros(num_frames, dtype=torch.float64, device=device)
    counted = 0.0  # (query, head, layer) triples that saw a frame
    for q, q_vis, k, k_frame in layers:
        lse = frame_lse(q, k, q_vis, k_frame, num_frames, scale).double()  # (T, Hq, F)
        local = torch.logsumexp(lse, dim=-1)  # (T, Hq)
        glob = torch.logsumexp(_all_gather(local, group), 0) if distributed else local
        seen = torch.isfinite(glob)
        share = torch.where(seen[..., None], (lse - glob[..., None]).exp(), 0.0)
        total = total + share.sum(dim=(0, 1))
        counted += float(seen.sum())
    total = total / max(counted, 1.0)
    if distributed:  # every frame is held by one rank: the others add exact zeros
        dist.reduce(total, dst=0, group=group)
    return total.cpu() if rank == 0 else None
