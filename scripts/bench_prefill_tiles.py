#!/usr/bin/env python
"""The prompt prefill's tiles against one dense call, side by side in one run (CPU, float32).

A hyper layer's cross-attention of a video prompt at mPLUG-Owl3-7B head shapes (28 query heads,
4 K/V heads, d 128, 729 visual keys per frame, a `<|image|>` placeholder of 5 tokens per frame):
`attn_fwd`, which plans tiles that skip what the media mask hides, against one
`scaled_dot_product_attention` call over every key (GQA without copies, the mask as a dense bool
tensor where one is needed) and against `attn_fwd` over every key with no mask at all (what
skipping nothing costs on lvx's own call). Two layouts:

- `prompt`: the video prompt itself, each row seeing the frames placed before it (a staircase: the
  tiles skip about half the keys);
- `all keys`: every row sees every key (the question after the video, or a prompt whose rows all
  come after its frames): nothing to skip, so the tiles must cost what the dense call costs.

Each case runs once per round, the rounds interleaved so load that comes and goes hits both alike;
the table gives the median seconds, the ratio tiles / dense and the largest difference of outputs.

    python scripts/bench_prefill_tiles.py
    python scripts/bench_prefill_tiles.py --frames 32 --rounds 7 --json runs/prefill_tiles.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_kernels.kernels import attn_fwd
from scripts.harness import command_line, machine, markdown, write_json
from scripts.xattn_problem import KEYS_PER_FRAME, TOKENS_PER_PLACEHOLDER

HQ, HKV, D = 28, 4, 128
QUESTION = 24  # tokens after the last frame


def layout(frames: int, keys_per_frame: int, all_keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_vis (1, rows), k_frame (1, keys)): row t sees frame j iff j < q_vis[t]."""
    rows = frames * TOKENS_PER_PLACEHOLDER + QUESTION
    t = torch.arange(rows)
    seen = (t // TOKENS_PER_PLACEHOLDER + 1).clamp(max=frames)
    q_vis = torch.full((rows,), frames) if all_keys else seen
    k_frame = torch.arange(frames * keys_per_frame) // keys_per_frame
    return q_vis.unsqueeze(0).to(torch.int32), k_frame.unsqueeze(0).to(torch.int32)


def dense(q, k, v, q_vis, k_frame) -> torch.Tensor:
    """One SDPA call over every key (GQA without K/V copies); the mask as a bool tensor unless
    every row sees every key."""
    mask = None
    if bool((q_vis.amin() <= k_frame.amax()).item()):
        mask = k_frame[:, None, None, :] < q_vis[:, None, :, None]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


def compare(frames: int, keys_per_frame: int, all_keys: bool, rounds: int) -> dict:
    q_vis, k_frame = layout(frames, keys_per_frame, all_keys)
    rows, keys = q_vis.shape[1], k_frame.shape[1]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, rows, HQ, D, generator=gen)
    k, v = (torch.randn(1, keys, HKV, D, generator=gen) for _ in range(2))
    cases = {
        "tiles": lambda: attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame)[0],
        "dense": lambda: dense(q, k, v, q_vis, k_frame),
        "unmasked": lambda: attn_fwd(q, k, v)[0],  # every key, no plan: the cost of skipping none
    }
    outs = {name: fn() for name, fn in cases.items()}  # warm-up, and the outputs compared
    times: dict = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tiles_s, dense_s, unmasked_s = (statistics.median(times[n]) for n in cases)
    visible = float((k_frame[:, None, :] < q_vis[:, :, None]).float().mean())
    return {
        "layout": "all keys" if all_keys else "prompt",
        "frames": frames,
        "rows": rows,
        "keys": keys,
        "visible": visible,
        "tiles_s": tiles_s,
        "dense_s": dense_s,
        "unmasked_s": unmasked_s,
        "tiles_over_dense": tiles_s / dense_s,
        "tiles_over_unmasked": tiles_s / unmasked_s,
        "max_abs_diff": float((outs["tiles"] - outs["dense"]).abs().max()),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--frames", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--keys-per-frame", type=int, default=KEYS_PER_FRAME)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        compare(frames, args.keys_per_frame, all_keys, args.rounds)
        for frames in args.frames
        for all_keys in (False, True)
    ]
    print(markdown(rows))
    if args.json is not None:
        write_json(args.json, {"machine": machine(), "command": command_line(), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
