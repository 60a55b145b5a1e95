"""Zigzag layout of a causal sequence over n ranks: cut it into 2n chunks, rank r holds chunks r and
2n-1-r.

Every rank then does the same causal work (ring-flash-attn's zigzag, PyTorch CP's load balancing;
Striped Attention / DistFlashAttn balance the same way). Lengths not divisible by 2n give uneven
chunks (`torch.tensor_split` sizes: the first S mod 2n chunks are one longer); very short sequences
give empty chunks. Finetuning shards its text this way; `baselines.ring_self_attn` runs on it.
"""

from __future__ import annotations

from typing import Sequence

import torch


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
