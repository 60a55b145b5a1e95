"""Distributed attention hooks for the model when frames (and a long prompt's tokens) are sharded
over ranks.

Each rank holds some of the frames (their visual K/V, never moved), dealt by
lvx_app/parallel/layout.py: any sorted set works, since positions, q_vis and k_frame are global. The
text K/V cache is replicated: a sharded prefill (the video prompt, whose tokens travel with their
frames; a question too long for the gather schedule) runs both attentions as LV-XAttn rings over
each rank's share of the tokens, and `replicate` then all-gathers the shares' new text K/V, in
position order, so every rank holds the whole cache. A forward whose tokens every rank feeds alike
(a short question, each decoded token) then needs no collective for text attention, and one
(`decode_xattn`, the gather schedule with replicated queries) per hyper layer for the visual one; a
decoded token's agreement rides on the first (`carry`). `schedule` (--xattn-schedule) decides which
kind of forward a question gets, here.

Text causality becomes the media mask: a key at position p is visible to a query at position t iff p
< t + 1, i.e. `k_frame = key positions` and `q_vis = query positions + 1`. In a ring the replicated
keys count on rank 0 only; elsewhere they carry a position no query can reach.

`impl` (`SessionConfig.attention`, for benchmarks) swaps both attentions for a baseline that moves
K/V instead: "ring" (Ring Attention, pass-KV) or "allgather". The baselines keep the text K/V cache
sharded, as Ring Attention does: every question is sharded and each decoded token's key counts on
rank 0 only. This is the one place it is chosen. Every call adds the bytes this rank sends to
`stats["fwd_bytes"]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lvx_app.attention import Carry, attn_fwd, choose_schedule, decode_xattn, lv_xattn_with_lse
from lvx_app.attention.baselines import allgather_xattn_with_lse, ring_xattn_with_lse
from lvx_app.parallel.collectives import allgather_seq, exchange_sizes

HIDDEN = 1 << 60  # a key position that no query position reaches

# impl -> (sharded attention, attention of tokens every rank feeds alike); all take (q, k, v,
# group=, q_vis=, k_frame=, stats=)
IMPLS = {
    "lv_xattn": (lv_xattn_with_lse, decode_xattn),
    "ring": (ring_xattn_with_lse, ring_xattn_with_lse),
    "allgather": (allgather_xattn_with_lse, allgather_xattn_with_lse),
}


class ShardedAttention:
    """`AttentionHooks`-compatible text and visual attention over a process group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        rank: int = 0,
        world: int = 1,
        schedule: str = "auto",
        impl: str = "lv_xattn",
    ) -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown attention {impl!r}; use one of {', '.join(IMPLS)}")
        choose_schedule(1, world, schedule)  # an unknown schedule fails here, at start-up
        self.group, self.rank, self.world, self.schedule = group, rank, world, schedule
        self.sharded_fn, self.replicated_fn = IMPLS[impl]
        self.replicates_cache = impl == "lv_xattn"  # the baselines keep the text cache sharded
        self.stats: dict = {}  # bytes this rank has sent ("fwd_bytes")
        # global position of every cached text key
        self.key_positions = torch.empty(1, 0, dtype=torch.int64)
        self.shared = 0  # cached keys [0, shared) are the same on every rank
        self.query_vis = torch.empty(1, 0, dtype=torch.int64)
        self.replicated = False
        self._ring_keys: tuple[torch.Tensor, torch.Tensor] | None = None
        self.carry: Carry | None = (
            None  # rides on this forward's first replicated visual combine (set for LV-XAttn only)
        )

    def replicate_queries(self, rows: int) -> bool:
        """Whether a question of `rows` tokens is fed whole on every rank (gather) rather than
        sharded (ring)."""
        return (
            self.replicates_cache and choose_schedule(rows, self.world, self.schedule) == "gather"
        )

    def begin(self, positions: torch.Tensor, *, replicated: bool) -> None:
        """Called before each forward with this rank's token positions (1, L); `replicated`: every
        rank feeds them."""
        positions = positions.to(torch.int64).cpu().view(1, -1)
        mine = (
            positions
            if (not replicated or self.replicates_cache or self.rank == 0)
            else torch.full_like(positions, HIDDEN)
        )
        self.key_positions = torch.cat([self.key_positions, mine], dim=1)
        self.query_vis = positions + 1
        self.replicated = replicated
        if replicated and self.replicates_cache:
            self.shared = self.key_positions.shape[1]
        self._ring_keys = (
            None  # this forward's key positions as the ring sees them, made by its first layer
        )

    def truncate(self, length: int) -> None:
        """Keep the first `length` cached keys (matches TextKVCache.truncate)."""
        self.key_positions = self.key_positions[:, :length]
        self.shared = min(self.shared, length)

    def restore(self, key_positions: torch.Tensor) -> None:
        """The positions of a text cache read back from a saved video prompt (whole on every rank
        when replicated)."""
        self.key_positions = key_positions
        self.shared = key_positions.shape[1] if self.replicates_cache else 0

    def replicate(self, cache, start: int) -> None:
        """After a sharded prefill: every rank's cached text K/V from `start` on, gathered in rank
        order (one all_gather for all layers' K/V, one for their positions), replace this rank's
        own, so the whole cache is the same on every rank. The baselines keep their shards."""
        if not self.replicates_cache:
            return
        layers = cache.layers
        new = torch.cat(
            [t[:, start : layer.length] for layer in layers for t in (layer.k, layer.v)], dim=-1
        )
        (sizes,) = exchange_sizes(new.shape[1], group=self.group, device=new.device)
        full, _ = allgather_seq(new.contiguous(), sizes, self.group)
        # NCCL: on the GPU
        pos, _ = allgather_seq(
            self.key_positions[:, start:].to(new.device).contiguous(), sizes, self.group
        )
        if bool(
            (pos[0, 1:] < pos[0, :-1]).any()
        ):  # a striped or zigzag layout interleaves the shares: position order
            order = pos[0].argsort()
            full, pos = full.index_select(1, order), pos.index_select(1, order)
        parts = full.split(layers[0].k.shape[-1], dim=-1)  # k, v of layer 0, k, v of layer 1, ...
        for i, layer in enumerate(layers):
            layer.length = start
            layer.append(parts[2 * i], parts[2 * i + 1])
        self.key_positions = torch.cat([self.key_positions[:, :start], pos.cpu()], dim=1)
        self.shared = self.key_positions.shape[1]

    def text(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True):
        if not causal:
            raise ValueError("sharded text attention is always causal")
        if self.replicated and self.replicates_cache:
            # the whole cache is here, one key per position in position order (as `replicate` leaves
            # it): plain causal attention, as in one process; no collective, no mask, no positions
            # moved to the device
            return attn_fwd(q, k, v, causal=True)
        return self.visual(q, k, v, *self._ring_positions(k.shape[1], q.device))

    def _ring_positions(self, keys: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_vis, k_frame) of text attention in a ring, on `device`: the same in every layer of a
        forward, so made once. Replicated keys count on rank 0 only."""
        if (
            self._ring_keys is None
            or self._ring_keys[1].shape[1] != keys
            or self._ring_keys[1].device != device
        ):
            k_pos = self.key_positions[:, :keys]
            if self.rank != 0 and self.shared:
                k_pos = k_pos.clone()
                k_pos[:, : self.shared] = HIDDEN
            self._ring_keys = (self.query_vis.to(device), k_pos.to(device))
        return self._ring_keys

    def visual(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_vis: torch.Tensor,
        k_frame: torch.Tensor,
    ):
        fn = self.replicated_fn if self.replicated else self.sharded_fn
        # decode_xattn's
        extra = {"carry": self.carry} if self.replicated and self.carry is not None else {}
        return fn(
            q, k, v, group=self.group, q_vis=q_vis, k_frame=k_frame, stats=self.stats, **extra
        )
