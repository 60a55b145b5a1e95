"""Distributed attention hooks for the model when text and frames are sharded over ranks.

Each rank holds some of the prompt's tokens (and their text K/V in its cache)
and some of the frames (their visual K/V), dealt by lvx_app/parallel/layout.py:
any sorted set works, since positions, q_vis and k_frame are global. Both
attentions are LV-XAttn rings in prefill — the local K/V never move — and a
local partial plus one collective per layer when decoding a token.

Text causality becomes the media mask: a key at position p is visible to a
query at position t iff p < t + 1, i.e. `k_frame = key positions` and
`q_vis = query positions + 1`. Decoded tokens are replicated on every rank but
their keys count only on rank 0; elsewhere they carry a position no query can
reach.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lvx_app.attention import decode_xattn, lv_xattn_with_lse

HIDDEN = 1 << 60  # a key position that no query position reaches


class ShardedAttention:
    """`AttentionHooks`-compatible text and visual attention over a process group."""

    def __init__(self, group: dist.ProcessGroup | None = None, rank: int = 0) -> None:
        self.group = group
        self.rank = rank
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
        if self.decoding:
            return decode_xattn(q, k, v, group=self.group, q_vis=q_vis, k_frame=k_pos)
        return lv_xattn_with_lse(q, k, v, group=self.group, q_vis=q_vis, k_frame=k_pos)

    def visual(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_vis: torch.Tensor, k_frame: torch.Tensor):
        if self.decoding:
            return decode_xattn(q, k, v, group=self.group, q_vis=q_vis, k_frame=k_frame)
        return lv_xattn_with_lse(q, k, v, group=self.group, q_vis=q_vis, k_frame=k_frame)
