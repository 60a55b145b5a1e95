"""Which rank holds which frame, and with each frame its placeholder tokens: the load-balanced
layouts.

Under the media mask a token sees the frames before it, so prefill work is a triangle. Contiguous
shares leave rank 0's tokens seeing only rank 0's frames while the last rank's see all of them, and
every LV-XAttn round lasts as long as its fullest block. Dealing frames so each rank has early and
late ones evens the rounds out:

- `contiguous`: rank r holds the run `shard_bounds(n, world, r)` (the old layout);
- `striped`: frame j on rank j mod world (Striped Attention);
- `zigzag`: 2·world chunks, rank r holds chunks r and 2·world-1-r (ring-flash-attn, DistFlashAttn's
  balance).

A rank's items are always returned sorted, so the frames a token sees stay a prefix of the local
keys and the tile planner (`lvx_kernels.masks`) keeps skipping hidden tiles. Masks stay exact
on every layout because q_vis, k_frame and positions are global. `round_work` counts the visible
(query, key) pairs each rank computes in each ring round, the balance the layouts are chosen by.

The zigzag of a causal sequence (`zigzag_indices`, `zigzag_shard`, `zigzag_unshard`) is the same
dealing for text tokens: finetuning shards its text this way, and every rank then does the same
causal work (ring-flash-attn's zigzag, PyTorch CP's load balancing). Lengths not divisible by 2n
give uneven chunks (`torch.tensor_split` sizes), very short sequences empty ones.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lvx_app.defaults import check_layout
from lvx_app.parallel.shards import shard_bounds


def zigzag_chunk_sizes(seq_len: int, world: int) -> list[int]:
    """Lengths of the 2·world chunks (`torch.tensor_split` rule: the first seq_len mod 2n are one
    longer)."""
    base, extra = divmod(seq_len, 2 * world)
    return [base + (1 if i < extra else 0) for i in range(2 * world)]


def zigzag_indices(seq_len: int, rank: int, world: int, device=None) -> torch.Tensor:
    """Global positions held by `rank`: chunk `rank` then chunk `2·world-1-rank` (use for position
    ids)."""
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
    idx = torch.cat(
        [zigzag_indices(seq_len, r, world, device=shards[0].device) for r in range(world)]
    )
    every = torch.cat(list(shards), dim=dim)
    return torch.empty_like(every).index_copy_(dim, idx, every)


def owners(total: int, world: int, layout: str) -> torch.Tensor:
    """(total,) int64: the rank that holds each of `total` items dealt over `world` ranks."""
    check_layout(layout)
    if world < 1:
        raise ValueError(f"a world of {world} ranks has no rank to hold anything")
    if layout == "striped":
        return torch.arange(total, dtype=torch.int64) % world
    if layout == "contiguous":
        sizes = [b - a for a, b in (shard_bounds(total, world, r) for r in range(world))]
        ranks = list(range(world))
    else:
        sizes = zigzag_chunk_sizes(total, world)
        ranks = [min(c, 2 * world - 1 - c) for c in range(2 * world)]
    return torch.repeat_interleave(
        torch.tensor(ranks, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64)
    )


def owned(total: int, world: int, rank: int, layout: str) -> list[int]:
    """The items `rank` holds, sorted."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return torch.nonzero(owners(total, world, layout) == rank).flatten().tolist()


def token_owners(
    n_tokens: int,
    media_starts: Sequence[int] | torch.Tensor,
    world: int,
    layout: str,
    tail_from: int | None = None,
) -> torch.Tensor:
    """(n_tokens,) int64: the rank of each prompt token when tokens travel with their frame.

    Tokens from placeholder j up to placeholder j+1 go with frame j (those before the first with
    frame 0); tokens from `tail_from` on (text after the video: a question, an answer; default none)
    see every frame, so they are dealt by the same layout among themselves. Without frames every
    token is tail."""
    starts = torch.as_tensor(media_starts, dtype=torch.int64).flatten()
    tail_from = n_tokens if tail_from is None else max(0, min(int(tail_from), n_tokens))
    if starts.numel() == 0:
        tail_from = 0
    head = torch.arange(tail_from, dtype=torch.int64)
    frame = (torch.searchsorted(starts, head, right=True) - 1).clamp(min=0)
    per_frame = owners(int(starts.numel()), world, layout)
    return torch.cat(
        [per_frame[frame] if head.numel() else head, owners(n_tokens - tail_from, world, layout)]
    )


def rank_tokens(
    n_tokens: int, media_starts, world: int, rank: int, layout: str, tail_from: int | None = None
) -> torch.Tensor:
    """This rank's token indices (sorted, int64): use them as its share of the ids and as its
    positions."""
    return torch.nonzero(
        token_owners(n_tokens, media_starts, world, layout, tail_from) == rank
    ).flatten()


def round_work(
    q_vis: torch.Tensor,
    q_rank: torch.Tensor,
    k_frame: torch.Tensor,
    k_rank: torch.Tensor,
    world: int,
) -> torch.Tensor:
    """(world rounds, world ranks) visible (query, key) pairs: in round t rank i meets the queries
    of rank (i - t).

    q_vis (Sq,) how many frames each query sees, q_rank its rank; k_frame (Sk,) each key's frame,
    k_rank its rank (LV-XAttn's pass-Q ring: query blocks travel, K/V stay)."""
    seen = (k_frame.view(1, -1) < q_vis.view(-1, 1)).to(torch.int64)  # (Sq, Sk)
    pair = torch.zeros(world, world, dtype=torch.int64)  # [query rank, key rank]
    pair.index_put_(
        (
            q_rank.view(-1, 1).expand_as(seen).reshape(-1),
            k_rank.view(1, -1).expand_as(seen).reshape(-1),
        ),
        seen.reshape(-1),
        accumulate=True,
    )
    rounds = torch.arange(world).view(-1, 1)
    ranks = torch.arange(world).view(1, -1)
    return pair[(ranks - rounds) % world, ranks.expand(world, -1)]


def balance(work: torch.Tensor) -> float:
    """Busiest rank's work over the mean, summed over rounds (each round lasts as long as its
    busiest rank)."""
    busiest = work.amax(1).sum().item()
    mean = work.sum().item() / work.shape[1]
    return busiest / mean if mean else 1.0
