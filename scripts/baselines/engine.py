"""The baselines LV-XAttn is compared with, installed in the real engine from outside.

`ATTENTIONS` maps a benchmark's label to a `ShardedAttention` subclass: Ring Attention (pass-KV) and
all-gather move the visual K/V instead of the queries. Every rank holds the whole text cache as with
LV-XAttn (replicated after each sharded prefill), so the comparison is the cross-attention and a
sharded prefill's text attention; a decoded token's agreement, which rides on LV-XAttn's decode
combine, costs these baselines one small all-gather of its own.

    engine = open_engine(config, entry=baseline_entry("Ring pass-KV"))   # a group of ranks
    session = RankSession(config, info, baseline_parallelize("Ring pass-KV"))  # one rank, in tests

Run as a script it is the rank entry point: `python scripts/baselines/engine.py --attention LABEL
--config JSON`.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    import scripts  # noqa: F401

from lvx_app.engine.parallelize import ShardedAttention, parallelize
from lvx_app.runtime import rank_main
from lvx_kernels.masks import device_tensor
from scripts.baselines import allgather_xattn_with_lse, ring_xattn_with_lse


def _refuse(hooks, alibi, window) -> None:
    """The baselines run every frame before a token, without ALiBi: anything else is one line."""
    if alibi is not None:
        raise ValueError(f"{type(hooks).__name__} has no ALiBi: run a family without it")
    if window is not None:
        raise ValueError(f"{type(hooks).__name__} sees every frame before a token: no window")


class _KVMoving(ShardedAttention):
    """A baseline: one K/V-moving function for sharded and replicated queries alike."""

    fn = staticmethod(ring_xattn_with_lse)

    def _moving(self, q, k, v, q_vis, k_frame):
        q_vis, k_frame = device_tensor(q_vis), device_tensor(k_frame)
        return self.fn(q, k, v, group=self.group, q_vis=q_vis, k_frame=k_frame, stats=self.stats)

    def ring(self, q, k, v, q_vis, k_frame, step, layer, every=None, alibi=None, window=None):
        _refuse(self, alibi, window)
        return self._moving(q, k, v, q_vis, k_frame)  # K/V move: no query block to plan

    def combine(self, q, k, v, q_vis, k_frame, feed, window=None):
        _refuse(self, None, window)
        out = self._moving(q, k, v, q_vis, k_frame)
        rider = feed.carry
        if rider is not None and rider.received is None:
            mine = torch.tensor(rider.numbers, dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(every, mine, group=self.group)
            rider.received = torch.stack(every).to(torch.int64)
        return out


class RingPassKV(_KVMoving):
    fn = staticmethod(ring_xattn_with_lse)


class AllGatherKV(_KVMoving):
    fn = staticmethod(allgather_xattn_with_lse)


ATTENTIONS: dict[str, type[ShardedAttention] | None] = {
    "LV-XAttn": None,  # the product's own
    "Ring pass-KV": RingPassKV,
    "all-gather K/V": AllGatherKV,
}


def baseline_parallelize(label: str):
    """The `parallelize` that installs the attention `label` names."""
    attention = ATTENTIONS[label]
    return parallelize if attention is None else partial(parallelize, attention=attention)


def baseline_entry(label: str) -> list[str]:
    """What each rank runs (after `python`) for the attention `label` names."""
    return [str(Path(__file__).resolve()), "--attention", label]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--attention", choices=list(ATTENTIONS), required=True)
    args, rest = parser.parse_known_args(argv)
    return rank_main.main(rest, parallelize=baseline_parallelize(args.attention))


if __name__ == "__main__":
    sys.exit(main())
