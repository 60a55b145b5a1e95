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
nothing; under a window (`--media-attention latest-frame`) a query's mass lies on the frames its
window lets it see, so the shares fall only there. Forward only, float64 accumulation of the
shares.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from lvx_app.parallel.collectives import all_gather_flat

# float32 score elements one chunk of keys may make at once (queries x heads x keys)
SCORE_CHUNK_ELEMENTS = 1 << 22


def local_frames(k_frame: Tensor) -> tuple[Tensor, int | None]:
    """(the global index of each frame this rank holds, as `frame_lse` orders them; the keys per
    frame when each frame's keys are contiguous and every frame has as many, else None: the
    frames sorted). One host read, once per answer."""
    ids, counts = torch.unique_consecutive(k_frame.view(-1), return_counts=True)
    if ids.numel() and ids.unique().numel() == ids.numel() and bool((counts == counts[0]).all()):
        return ids, int(counts[0])
    return ids.unique(), None


@torch.no_grad()
def frame_lse(
    q: Tensor,
    k: Tensor,
    q_vis: Tensor,
    k_frame: Tensor,
    frames: tuple[Tensor, int | None] | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """Log-sum-exp of each (query, head)'s scores over each local frame's keys: (T, Hq, frames
    held), float32 (float64 for float64 inputs), -inf where the query does not see the frame.

    q (T, Hq, D) roped queries; k (S, Hkv, D) this rank's visual keys; q_vis (T,) how many frames
    (a prefix) each query sees; k_frame (S,) each key's global frame index; `frames`: what
    `local_frames(k_frame)` says (made here when not given); `window`: each query sees only the
    latest `window` frames of its prefix. Keys go in chunks of whole frames (a frame's keys in one
    reshape when every frame has as many); any other layout of keys is taken per key and merged
    per frame exactly."""
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    ids, per_frame = frames if frames is not None else local_frames(k_frame)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = (q.to(dt) * scale).view(t, hkv, hq // hkv, d)  # query heads folded onto their K/V head
    q_vis = q_vis.to(k.device, torch.int64).view(t, 1, 1, 1)
    low = q_vis - window if window is not None else torch.full_like(q_vis, -1)
    if per_frame is None:
        return _scattered_lse(qf, k, (low, q_vis), k_frame.to(k.device, torch.int64).view(-1), ids)
    nf = ids.numel()
    step = max(1, SCORE_CHUNK_ELEMENTS // max(1, t * hq * per_frame))  # frames per chunk
    parts = []
    for lo in range(0, nf, step):
        keys = k[lo * per_frame : (lo + step) * per_frame].to(dt)
        scores = torch.einsum("tkgd,skd->tkgs", qf, keys).unflatten(-1, (-1, per_frame))
        lse = torch.logsumexp(scores, dim=-1)  # (T, Hkv, G, frames of the chunk)
        held = ids[lo : lo + step].to(k.device).view(1, 1, 1, -1)
        hidden = (held >= q_vis) | (held < low)
        parts.append(lse.masked_fill(hidden, -math.inf))
    if not parts:
        return qf.new_empty(t, hq, 0)
    return torch.cat(parts, dim=-1).view(t, hq, nf)


def _scattered_lse(
    qf: Tensor, k: Tensor, seen: tuple[Tensor, Tensor], k_frame: Tensor, ids: Tensor
) -> Tensor:
    """`frame_lse` for keys in any order: per key, reduced per frame by scatters; `seen`: each
    query's frames [low, q_vis)."""
    low, q_vis = seen
    t, hkv, g, _ = qf.shape
    slot = torch.searchsorted(ids.to(k_frame.device), k_frame)  # each key's place among `ids`
    out = qf.new_full((t, hkv, g, ids.numel()), -math.inf)
    step = max(1, SCORE_CHUNK_ELEMENTS // max(1, t * hkv * g))
    for lo in range(0, k.shape[0], step):
        scores = torch.einsum("tkgd,skd->tkgs", qf, k[lo : lo + step].to(qf.dtype))
        keys = k_frame[lo : lo + step].view(1, 1, 1, -1)
        scores = scores.masked_fill((keys >= q_vis) | (keys < low), -math.inf)
        index = slot[lo : lo + step].view(1, 1, 1, -1).expand_as(scores)
        top = torch.full_like(out, -math.inf).scatter_reduce(3, index, scores, "amax")
        safe = torch.where(torch.isfinite(top), top, 0.0)
        mass = torch.zeros_like(out).scatter_add(3, index, (scores - safe.gather(3, index)).exp())
        out = torch.logaddexp(out, safe + mass.log())
    return out.view(t, hkv * g, -1)


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
    window: int | None = None,
) -> Tensor | None:
    """Each frame's share of the visual attention mass, (num_frames,) float64 summing to 1 (all
    zero when no query saw a frame), on rank 0 (None on the other ranks).

    `layers`: per hyper layer (q (T, Hq, D), q_vis (T,), k (S, Hkv, D), k_frame (S,)), the same
    queries on every rank, this rank's keys (every layer's keys lie over the same frames).
    `distributed`: merge over the group (every rank calls, with the same layers in the same
    order): one all_gather of every layer's per-row totals, one reduce of the shares. `window`: the
    media mask's (`frame_lse`)."""
    rank = dist.get_rank(group) if distributed else 0
    if not layers:
        return torch.zeros(num_frames, dtype=torch.float64) if rank == 0 else None
    frames = local_frames(layers[0][3])
    lses = [
        frame_lse(q, k, q_vis, k_frame, frames, scale, window) for q, q_vis, k, k_frame in layers
    ]
    lse = torch.stack(lses).double()  # (layers, T, Hq, frames held)
    local = torch.logsumexp(lse, dim=-1)  # (layers, T, Hq)
    glob = torch.logsumexp(_all_gather(local, group), 0) if distributed else local
    seen = torch.isfinite(glob)
    share = torch.where(seen[..., None], (lse - glob[..., None]).exp(), 0.0).sum(dim=(0, 1, 2))
    total = torch.zeros(num_frames, dtype=torch.float64, device=share.device)
    total[frames[0].to(share.device)] = share / max(float(seen.sum()), 1.0)
    if distributed:  # every frame is held by one rank: the others add exact zeros
        dist.reduce(total, dst=0, group=group)
    return total.cpu() if rank == 0 else None
