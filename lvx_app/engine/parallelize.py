"""Shard the model's attention over the ranks, from outside the model (as gpt-fast's `tp.py` does).

`parallelize(info, config)` makes the `ShardedAttention` whose hooks the engine hands every forward
(`Conversation.hooks`); nothing is set on the model, which never imports torch.distributed. Every
hook call gets the forward's step context and the layer's index: how the ranks feed the forward's
tokens (its `Feed`) travels with the forward, so the hooks keep nothing per forward.

Each rank holds some of the frames (their visual K/V, never moved), dealt by
lvx_app/parallel/layout.py: any sorted set works, since positions, q_vis and k_frame are global. The
text K/V cache is replicated: a sharded prefill (the video prompt, whose tokens travel with their
frames; a question too long for the gather schedule) runs both attentions as LV-XAttn rings over
each rank's share of the tokens, and `replicate` then all-gathers the shares' new text K/V, in
position order, so every rank holds the whole cache (its keys at positions 0, 1, 2, ...). A forward
whose tokens every rank feeds alike (a short question, each decoded token) then needs no collective
for text attention, and one (`decode_xattn`, the gather schedule with replicated queries) per hyper
layer for the visual one. The decoded token's agreement rides on the first of those (`Feed.carry`).

Text causality becomes the media mask: a key at position p is visible to a query at position t iff p
< t + 1, i.e. `k_frame = key positions` and `q_vis = query positions + 1`. In a ring the cached keys
count on rank 0 only; elsewhere they are left out of the rank's keys. Positions live on the host
(the engine knows them), and the masks go to the kernels with them (`masks.Indices`), so planning a
tile reads no device memory, and a rank's own tokens against its own keys (the diagonal of the
causal triangle) are planned as one causal kernel call per contiguous run.

`ShardedHooks` is what inference and finetuning share (lvx_app/train/recompute.py subclasses it);
benchmarks compare other schedules by subclassing `ShardedAttention` (its `ring` and `combine`)
and passing it to `parallelize` through the rank entry point (scripts/baselines/engine.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lvx_app.attention import attn_fwd, choose_schedule, decode_xattn, lv_xattn_with_lse
from lvx_app.attention.decode_xattn import CombineBuffers
from lvx_app.attention.schedule import crossovers, gather_limit
from lvx_app.config import Config
from lvx_app.parallel.collectives import all_min, allgather_seq
from lvx_app.parallel.group import DistInfo
from lvx_kernels.feed import Feed
from lvx_kernels.masks import Indices, MaskIndex
from lvx_models.api import ForwardStep


class ShardedHooks:
    """The model's text and visual attention hooks over a process group, for forwards whose tokens
    the ranks feed as each forward's `Feed` says (module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.stats: dict = {}  # bytes this rank has sent ("fwd_bytes")
        self.buffers = CombineBuffers()  # the decode combine's buffers, kept for the session

    def sharded_feed(
        self, positions: torch.Tensor, sizes, device: torch.device, cached: int = 0, every=None
    ) -> Feed:
        """The feed of a forward in which this rank feeds its tokens at `positions` (1, L), a host
        tensor, after `cached` keys every rank holds, every rank's count in `sizes` (and, when
        known, every rank's positions in `every`); the ring's text mask is made here once for
        every layer, on `device` and on the host."""
        positions = positions.to("cpu", torch.int64).view(1, -1)
        keys = positions
        if self.rank == 0 and cached:  # the cached keys count on rank 0 only
            keys = torch.cat([torch.arange(cached).view(1, -1), positions], dim=1)
        return Feed(
            sizes=tuple(int(n) for n in sizes),
            text_q_vis=_known(positions + 1, device),
            text_k_frame=_known(keys, device),
            positions=None if every is None else tuple(p.view(1, -1) for p in every),
        )

    def text(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: ForwardStep, layer: int
    ):
        feed: Feed = step.feed
        if feed.replicated:
            # the whole cache is here, in position order (as `replicate` leaves it): plain causal
            # attention, as in one process; no collective, no mask
            return attn_fwd(q, k, v, causal=True, alibi=getattr(step, "alibi", None))
        first = 0 if self.rank == 0 else k.shape[1] - q.shape[1]  # this forward's own keys
        kept = k[:, first:], v[:, first:]
        every = None if feed.positions is None else [p + 1 for p in feed.positions]
        alibi = getattr(step, "alibi", None)
        return self.ring(
            q, *kept, feed.text_q_vis, feed.text_k_frame, step, layer, every, alibi=alibi
        )

    def visual(self, q: torch.Tensor, step: ForwardStep, layer: int):
        vis = step.visual
        k, v = vis.kv[layer]
        if step.feed.replicated:
            return self.combine(q, k, v, vis.q_vis, vis.k_frame, step.feed, vis.window)
        return self.ring(
            q, k, v, vis.q_vis, vis.k_frame, step, layer, vis.q_vis_every, window=vis.window
        )

    def ring(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_vis: MaskIndex,
        k_frame: MaskIndex,
        step: ForwardStep,
        layer: int,
        every=None,
        alibi: torch.Tensor | None = None,
        window: int | None = None,
    ):
        """This rank's share of a sharded forward's queries against its keys (text or visual), as
        one LV-XAttn ring over the group; `every`: every rank's q_vis on the host, if known;
        `alibi`: the ALiBi slopes of a text attention whose family has them (`step.alibi`);
        `window`: the visual mask's."""
        return lv_xattn_with_lse(
            q,
            k,
            v,
            group=self.group,
            q_vis=q_vis,
            k_frame=k_frame,
            q_sizes=step.feed.sizes,
            stats=self.stats,
            q_vis_every=every,
            alibi=alibi,
            window=window,
        )

    def combine(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_vis: MaskIndex,
        k_frame: MaskIndex,
        feed: Feed,
        window: int | None = None,
    ):
        """Queries every rank holds alike against this rank's visual keys, the partials combined
        in one collective (the feed's carry rides on it)."""
        return decode_xattn(
            q,
            k,
            v,
            group=self.group,
            q_vis=q_vis,
            k_frame=k_frame,
            stats=self.stats,
            carry=feed.carry,
            buffers=self.buffers,
            window=window,
        )


class ShardedAttention(ShardedHooks):
    """Inference's hooks: the ring-or-gather choice for a question and the replication of a
    sharded prefill's text K/V."""

    def __init__(
        self, group: dist.ProcessGroup | None, rank: int, world: int, schedule: str = "auto"
    ) -> None:
        super().__init__(group, rank, world)
        self.schedule = schedule
        # most query rows to gather, the same on every rank (None: this machine's own crossover)
        self.gather_rows: int | None = None

    def replicate_queries(self, rows: int) -> bool:
        """Whether a question of `rows` tokens is fed whole on every rank (gather) rather than
        sharded (ring)."""
        return choose_schedule(rows, self.world, self.schedule, self.gather_rows) == "gather"

    def replicate(self, cache, start: int, positions: torch.Tensor, sizes) -> None:
        """After a sharded prefill: every rank's cached text K/V from `start` on (this rank's at
        `positions`, every rank's count in `sizes`), gathered in rank order (one all_gather for all
        layers' K/V, one for their positions), replace this rank's own, so the whole cache is the
        same on every rank, in position order."""
        layers = cache.layers
        new = torch.cat(
            [t[:, start : layer.length] for layer in layers for t in (layer.k, layer.v)], dim=-1
        )
        full, _ = allgather_seq(new.contiguous(), list(sizes), self.group)
        # NCCL: the positions go over the device too
        mine = positions.to(torch.int64).view(1, -1).to(new.device).contiguous()
        pos, _ = allgather_seq(mine, list(sizes), self.group)
        if bool((pos[0, 1:] < pos[0, :-1]).any()):  # a striped or zigzag layout: position order
            order = pos[0].argsort()
            full = full.index_select(1, order)
        # k, v of layer 0, k, v of layer 1, ... (a layer's width is its own: zero for a family's
        # layer that keeps no text K/V)
        parts = full.split([t.shape[-1] for layer in layers for t in (layer.k, layer.v)], dim=-1)
        cache.truncate(start)
        for i in range(len(layers)):
            cache.update(i, parts[2 * i], parts[2 * i + 1])


def _known(values: torch.Tensor, device: torch.device) -> Indices:
    """Host `values` on `device`, the kernels planning from the host copy."""
    return Indices(values.to(device), values=values)


def parallelize(
    info: DistInfo, config: Config, attention: type[ShardedAttention] = ShardedAttention
) -> ShardedAttention:
    """`attention` (LV-XAttn) over the default group: the hooks the engine's forwards call. Every
    rank calls it: the ranks agree on the smallest of their machines' ring-or-gather crossovers
    (each read from the run's cache folder), so a question takes the same schedule on every
    rank."""
    attn = attention(None, info.rank, info.world_size, config.parallel.xattn_schedule)
    limit = gather_limit(info.world_size, crossovers(config.video.cache_dir))
    attn.gather_rows = all_min(limit, info.device)
    return attn
