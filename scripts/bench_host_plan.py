"""Host seconds a hyper layer spends planning its visual attention over a video prompt, at the 7B
model's shapes, on host tensors only (no GPU needed; the device side is the meta device).

A prompt prefill's hyper layer packs the query groups of every text token as rows (`gqa`) and
plans their media-mask tiles against this rank's visual keys, one frame's patches each
(`lvx_kernels/masks.py`); the masks themselves are built on the device, here on the meta device, so
what is timed is the host's share alone. `--scan` times the planner that compares every tile's rows
with every local key (what keys in no order still take), for comparison.

    python scripts/bench_host_plan.py                 # 1 h at 1 fps, one rank
    python scripts/bench_host_plan.py --minutes 10 --scan --json plan.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(ROOT)
    import scripts  # noqa: F401

from lvx_kernels import masks
from lvx_kernels.masks import Indices, pack_vis
from lvx_models.mplug_owl3.hyper import visible_frames
from scripts.harness import Rows, command_line, machine, show

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128  # Qwen2-7B, the 7B checkpoint's language model
PATCHES = 729  # visual keys per frame (SigLIP so400m at 384 px)
TOKENS_BEFORE, TOKENS_PER_FRAME, TOKENS_AFTER = 18, 5, 29  # the prompt's text around the frames


def prompt(frames: int, ranks: int, generation: str) -> tuple[Indices, Indices, int]:
    """(q_vis of every prompt token, k_frame of one rank's visual keys, tokens): a video prompt
    of `frames` at their placeholders, one rank's contiguous share of the frames."""
    starts = TOKENS_BEFORE + TOKENS_PER_FRAME * torch.arange(frames)
    tokens = int(starts[-1]) + TOKENS_PER_FRAME + TOKENS_AFTER
    q_vis = visible_frames(torch.arange(tokens).view(1, -1), starts, generation)
    mine = frames // ranks  # rank 0's frames
    k_frame = torch.arange(mine).repeat_interleave(PATCHES).view(1, -1)
    return Indices.of_host(q_vis, "cpu"), Indices.of_host(k_frame, "cpu"), tokens


def plan_seconds(q_vis: Indices, k_frame: Indices, tokens: int) -> tuple[float, int]:
    """(host seconds, plans) of one hyper layer's plan over the prompt, every mask made (meta)."""
    group = HEADS // KV_HEADS
    q = torch.empty(1, tokens * group, KV_HEADS, HEAD_DIM, device="meta")
    k = torch.empty(1, k_frame.tensor.shape[1], KV_HEADS, HEAD_DIM, device="meta")
    start = time.perf_counter()
    plans = masks.tile_plans(
        q, k, False, pack_vis(q_vis, group), k_frame, group=group, min_tokens=masks.MIN_TILE_CUDA
    )
    count = sum(1 for _ in plans)
    return time.perf_counter() - start, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="video length at 1 fps")
    parser.add_argument("--ranks", type=int, default=1, help="ranks the frames are shared by")
    parser.add_argument("--generation", default="g1", choices=["g1", "g2"])
    parser.add_argument("--layers", type=int, default=3, help="hyper layers timed (median)")
    parser.add_argument("--scan", action="store_true", help="also time the scanning planner")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    frames = max(1, int(args.minutes * 60))
    q_vis, k_frame, tokens = prompt(frames, args.ranks, args.generation)
    rows = Rows(args.json, command=command_line(), machine=machine())
    plan_seconds(*prompt(60, args.ranks, args.generation))  # one-time set-up of the meta device
    planners = [("search", None)] + ([("scan", lambda kf: False)] if args.scan else [])
    for name, ordered in planners:
        real = masks._ordered
        if ordered is not None:
            masks._ordered = ordered
        try:
            runs = [plan_seconds(q_vis, k_frame, tokens) for _ in range(args.layers)]
        finally:
            masks._ordered = real
        seconds = sorted(s for s, _ in runs)[len(runs) // 2]
        rows.add(
            {
                "planner": name,
                "minutes": args.minutes,
                "ranks": args.ranks,
                "tokens": tokens,
                "local_keys": k_frame.tensor.shape[1],
                "plans": runs[0][1],
                "host_s_per_hyper_layer": seconds,
            }
        )
    show("host planning of one hyper layer's visual attention (7B shapes)", rows.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
