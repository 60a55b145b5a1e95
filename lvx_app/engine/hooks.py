"""Distributed attention hooks for the model when text and frames are sharded over ranks.

Each rank holds a contiguous slice of the prompt's tokens (and their text K/V in
its cache) and a contiguous slice of the frames (their visual K/V). Both
attentions are LV-XAttn rings in prefill — the local K/V never move — and a
local partial plus one collective per layer when decoding a token.

Text causality becomes the media mask: a key at position p is visible to a
query at position t iff p < t + 1, i.e. `k_frame = key positions` and
`q_vis = query positions + 1`. Decoded tokens are replicated on every rank but
their keys count only on rank 0; elsewhere they carry a position no query can
reach.

`impl` (`SessionConfig.attention`, for benchmarks) swaps both attentions, prefill and decode alike, for a baseline
that moves K/V instead: "ring" (Ring Attention, pass-KV) or "allgather". This is the one place it is chosen.
Every call adds the bytes this rank sends to `stats["fwd_bytes"]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lvx_app.attention import decode_xattn, lv_xattn_with_lse
from lvx_app.attention.baselines import allgather_xattn_with_lse, ring_xattn_with_lse

HIDDEN = 1 << 60  # a key position that no query position reaches

# impl -> (prefill attention, one-token decode attention); all take (q, k, v, group=, q_vis=, k_frame=, stats=)
IMPLS = {
    "lv_xattn": (lv_xattn_with_lse, decode_xattn),
    "ring": (ring_xattn_with_lse, ring_xattn_with_lse),
    "allgather": (allgather_xattn_with_lse, allgather_xattn_with_lse),
}


class ShardedAttention:
    """`AttentionHooks`-compatible text and visual attention over a process group."""

    def __init__(self, group: dist.ProcessGroup | None = None, rank: int = 0, impl: str = "lv_xattn") -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown attention {impl!r}; use one of {', '.join(IMPLS)}")
        self.group = group
        self.rank = rank
        self.prefill_fn, self.decode_fn = IMPLS[impl]
        self.stats: dict = {}  # bytes this rank has sent ("fwd_bytes")
        self.key_positions = torch.empty(1, 0, dtype=torch.int64)  # this rank's cached text keys
        self.query_vis = torch.empty(1, 0, dtype=torch.int64)
        self.decoding = False

    def begin(self, positions: torch.Tensor, *, decoding: bool) -> None:
        """Called before each forward with this rank's token positions (1, L)."""
        positions = positions.to(torch.int64).cpu().view(1, -1)
        mine = positions if (not decoding or self.rank == 0) else torch.full_like(positions, HIDDEN)
        self.key_positions = torch.cat([self.key_positions, mine], dim=1)
        self.query_vis = positions + 1
        self.decoding = decoding

    def truncate(self, length: int) -> None:
        """Keep the first `length` local cached keys (matches TextKVCache.truncate)."""
        self.key_positions = self.key_positions[:, :length]

    def text(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True):
        if not causal:
            raise ValueError("sharded text attention is always causal")
        q_vis = self.query_vis.to(q.device)
        k_pos = self.key_positions[:, : k.shape[1]].to(q.device)
        return self.visual(q, k, v, q_vis, k_pos)

    def visual(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_vis: torch.Tensor, k_frame: torch.Tensor):
        fn = self.decode_fn if self.decoding else self.prefill_fn
        return fn(q, k, v, group=self.group, q_vis=q_vis, k_frame=k_frame, stats=self.stats)
