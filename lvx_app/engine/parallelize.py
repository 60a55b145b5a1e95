"""Shard the model's attention over the ranks, from outside the model (as gpt-fast's `tp.py` does).

`parallelize(model, group, schedule)` installs a `ShardedAttention` as the model's attention hooks;
the model itself never imports torch.distributed.

Each rank holds some of the frames (their visual K/V, never moved), dealt by
lvx_app/parallel/layout.py: any sorted set works, since positions, q_vis and k_frame are global. The
text K/V cache is replicated: a sharded prefill (the video prompt, whose tokens travel with their
frames; a question too long for the gather schedule) runs both attentions as LV-XAttn rings over
each rank's share of the tokens, and `replicate` then all-gathers the shares' new text K/V, in
position order, so every rank holds the whole cache. A forward whose tokens every rank feeds alike
(a short question, each decoded token) then needs no collective for text attention, and one
(`decode_xattn`, the gather schedule with replicated queries) per hyper layer for the visual one.
The decoded token's agreement rides on the first of those (`riding`).

Text causality becomes the media mask: a key at position p is visible to a query at position t iff p
< t + 1, i.e. `k_frame = key positions` and `q_vis = query positions + 1`. In a ring the replicated
keys count on rank 0 only; elsewhere they are left out of the rank's keys. Positions live on the
host (the engine knows them); the mask tensors carry their host copies, so planning a tile reads no
device memory, and a rank's own tokens against its own keys (the diagonal of the causal triangle)
are planned as one causal kernel call per contiguous run.

Benchmarks compare other schedules by subclassing `ShardedAttention` (its `sharded` and
`replicated` functions) and passing it to `parallelize` through the rank entry point
(scripts/baselines.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from lvx_app.attention import Carry, attn_fwd, choose_schedule, decode_xattn, lv_xattn_with_lse
from lvx_app.attention.decode_xattn import CombineBuffers
from lvx_app.attention.masks import HostCopy, keep_host_copy
from lvx_app.attention.schedule import crossovers, gather_limit
from lvx_app.config import Config
from lvx_app.parallel.collectives import all_min, allgather_seq
from lvx_app.parallel.group import DistInfo


class ShardedAttention:
    """The model's text and visual attention over a process group (an `AttentionHooks`)."""

    # (q, k, v, group=, q_vis=, k_frame=, q_sizes=, stats=) -> (out, lse): a sharded forward's
    sharded = staticmethod(lv_xattn_with_lse)
    # the same for queries every rank holds alike (a short question, a decoded token); also takes
    # carry=
    replicated = staticmethod(decode_xattn)

    def __init__(
        self, group: dist.ProcessGroup | None, rank: int, world: int, schedule: str = "auto"
    ) -> None:
        self.group, self.rank, self.world, self.schedule = group, rank, world, schedule
        self.stats: dict = {}  # bytes this rank has sent ("fwd_bytes")
        self.key_positions = torch.empty(1, 0, dtype=torch.int64)  # of every cached text key
        self.shared = 0  # cached keys [0, shared) are the same on every rank
        self.query_vis = torch.empty(1, 0, dtype=torch.int64)
        self.query_sizes: list[int] | None = None  # every rank's query rows in a sharded forward
        self.is_replicated = False
        self._ring_keys: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rider: Carry | None = None
        # most query rows to gather, the same on every rank (None: this machine's own crossover)
        self.gather_rows: int | None = None
        self.combine = CombineBuffers()  # the decode combine's buffers, kept for the session

    def replicate_queries(self, rows: int) -> bool:
        """Whether a question of `rows` tokens is fed whole on every rank (gather) rather than
        sharded (ring)."""
        return choose_schedule(rows, self.world, self.schedule, self.gather_rows) == "gather"

    def begin(
        self, positions: torch.Tensor, *, replicated: bool, sizes: list[int] | None = None
    ) -> None:
        """Called before each forward with this rank's token positions (1, L), a host tensor;
        `replicated`: every rank feeds them; `sizes`: every rank's number of tokens in a sharded
        forward."""
        positions = positions.to(torch.int64).view(1, -1)
        self.key_positions = torch.cat([self.key_positions, positions], dim=1)
        self.query_vis = positions + 1
        self.query_sizes = sizes
        self.is_replicated = replicated
        if replicated:
            self.shared = self.key_positions.shape[1]
        self._ring_keys = None  # this forward's key positions as the ring sees them (made once)

    def truncate(self, length: int) -> None:
        """Keep the first `length` cached keys (matches TextKVCache.truncate)."""
        self.key_positions = self.key_positions[:, :length]
        self.shared = min(self.shared, length)

    def restore(self, key_positions: torch.Tensor) -> None:
        """The positions of a whole text cache read back from a saved video prompt."""
        self.key_positions = key_positions
        self.shared = key_positions.shape[1]

    def replicate(self, cache, start: int) -> None:
        """After a sharded prefill: every rank's cached text K/V from `start` on, gathered in rank
        order (one all_gather for all layers' K/V, one for their positions), replace this rank's
        own, so the whole cache is the same on every rank. Every rank's share is the prefill's
        `query_sizes`, known to all."""
        layers = cache.layers
        new = torch.cat(
            [t[:, start : layer.length] for layer in layers for t in (layer.k, layer.v)], dim=-1
        )
        sizes = self.query_sizes
        full, _ = allgather_seq(new.contiguous(), sizes, self.group)
        # NCCL: the positions go over the device too
        mine = self.key_positions[:, start:].to(new.device).contiguous()
        pos, _ = allgather_seq(mine, sizes, self.group)
        if bool((pos[0, 1:] < pos[0, :-1]).any()):  # a striped or zigzag layout: position order
            order = pos[0].argsort()
            full, pos = full.index_select(1, order), pos.index_select(1, order)
        parts = full.split(layers[0].k.shape[-1], dim=-1)  # k, v of layer 0, k, v of layer 1, ...
        for i, layer in enumerate(layers):
            layer.length = start
            layer.append(parts[2 * i], parts[2 * i + 1])
        self.key_positions = torch.cat([self.key_positions[:, :start], pos.cpu()], dim=1)
        self.shared = self.key_positions.shape[1]

    @contextmanager
    def riding(self, numbers: Sequence[int]) -> Iterator[Carry]:
        """Within the block, `numbers` ride on the first replicated visual combine: the `Carry`
        yielded holds every rank's numbers once the forward has run."""
        self.rider = Carry(numbers)
        try:
            yield self.rider
        finally:
            self.rider = None

    def text(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True):
        if not causal:
            raise ValueError("sharded text attention is always causal")
        if self.is_replicated:
            # the whole cache is here, in position order (as `replicate` leaves it): plain causal
            # attention, as in one process; no collective, no mask
            return attn_fwd(q, k, v, causal=True)
        # in a ring the replicated keys count on rank 0 only
        first = self.shared if self.rank != 0 else 0
        q_vis, k_frame = self._ring_positions(first, k.shape[1], q.device)
        return self.visual(q, k[:, first:], v[:, first:], q_vis, k_frame)

    def _ring_positions(
        self, first: int, keys: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_vis, k_frame) of text attention in a ring for the keys [first, keys), on `device`
        with their host copies: the same in every layer of a forward, so made once."""
        made = self._ring_keys
        if made is None or made[1].shape[1] != keys - first or made[1].device != device:
            k_pos = self.key_positions[:, first:keys]
            self._ring_keys = tuple(
                keep_host_copy(t.to(device), HostCopy(values=t)) for t in (self.query_vis, k_pos)
            )
        return self._ring_keys

    def visual(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_vis: torch.Tensor,
        k_frame: torch.Tensor,
    ):
        kw = dict(group=self.group, q_vis=q_vis, k_frame=k_frame, stats=self.stats)
        if self.is_replicated:
            return self.replicated(q, k, v, carry=self.rider, buffers=self.combine, **kw)
        return self.sharded(q, k, v, q_sizes=self.query_sizes, **kw)


def parallelize(
    model, info: DistInfo, config: Config, attention: type[ShardedAttention] = ShardedAttention
) -> ShardedAttention:
    """Install `attention` (LV-XAttn) as `model`'s attention over the default group; returns the
    installed hooks. Every rank calls it: the ranks agree on the smallest of their machines'
    ring-or-gather crossovers (each read from the run's cache folder), so a question takes the same
    schedule on every rank."""
    attn = attention(None, info.rank, info.world_size, config.parallel.xattn_schedule)
    limit = gather_limit(info.world_size, crossovers(config.video.cache_dir))
    attn.gather_rows = all_min(limit, info.device)
    model.hooks.text = attn.text
    model.hooks.visual = attn.visual
    return attn
