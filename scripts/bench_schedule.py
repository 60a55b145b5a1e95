#!/usr/bin/env python
"""Ring or gather by query size: where the gather schedule stops beating the LV-XAttn ring.

N gloo ranks on this machine, one question's worth of query rows (every row after the whole video,
so it sees every frame), the visual K/V of `--frames` frames of 729 tokens split over the ranks, GQA
14:2, d 64, float32, forward only (what a question's prefill runs). For each total of query rows it
times the ring (`lv_xattn_with_lse`), the gather schedule (`gather_xattn_with_lse`) and the same
local kernel work with no communication, interleaved, median of the slowest rank; prints a table,
the crossover (the most rows for which gather is faster) and writes JSON.
`lvx_app/attention/schedule.py` GATHER_MAX_ROWS holds the crossovers measured.

    python scripts/bench_schedule.py --ranks 2 4 --rows 8 24 64 128 256 --out runs/schedule.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_xattn import _slices, _timed_rounds  # noqa: E402

from lvx_app.attention import attn_fwd, gather_xattn_with_lse, lv_xattn_with_lse  # noqa: E402
from lvx_app.parallel.testing import run_ranks  # noqa: E402

KEYS_PER_FRAME = 729


def _bench_rank(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    hq, hkv, d, frames = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"], cfg["frames"]
    s_kv = frames * KEYS_PER_FRAME
    ks = _slices(s_kv, world)[rank]
    g = torch.Generator().manual_seed(1000 + rank)
    k = torch.randn(1, ks.stop - ks.start, hkv, d, generator=g)
    v = torch.randn(k.shape, generator=g)
    k_frame = (torch.arange(ks.start, ks.stop) // KEYS_PER_FRAME).view(1, -1).to(torch.int32)
    cases, sizes_of = {}, {}
    for rows in cfg["rows"]:
        qs = _slices(rows, world)
        sizes = [s.stop - s.start for s in qs]
        q_all = torch.randn(1, rows, hq, d)
        q, q_vis = (
            q_all[:, qs[rank]].contiguous(),
            torch.full((1, sizes[rank]), frames, dtype=torch.int32),
        )
        vis_all = torch.full((1, rows), frames, dtype=torch.int32)
        kw = dict(q_vis=q_vis, k_frame=k_frame, q_sizes=sizes)
        cases[(rows, "ring")] = lambda q=q, kw=kw: lv_xattn_with_lse(q, k, v, **kw)
        cases[(rows, "gather")] = lambda q=q, kw=kw: gather_xattn_with_lse(q, k, v, **kw)
        cases[(rows, "no-comm")] = lambda q=q_all, vis=vis_all: attn_fwd(
            q, k, v, q_vis=vis, k_frame=k_frame
        )
        sizes_of[rows] = sizes
    with torch.no_grad():
        times = _timed_rounds(cases, cfg["warmup"], cfg["iters"])
    return {f"{rows}/{name}": 1e3 * statistics.median(t) for (rows, name), t in times.items()}


def _crossover(row_ms: dict, rows: list[int]) -> int:
    """The most query rows for which gather beat the ring, 0 if it never did."""
    wins = [r for r in rows if row_ms[f"{r}/gather"] < row_ms[f"{r}/ring"]]
    return max(wins, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 24, 64, 128, 256])
    ap.add_argument("--frames", type=int, default=48, help="48 frames x 729 = S_KV 34,992")
    ap.add_argument("--q-heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = {
        k: getattr(args, k)
        for k in ("rows", "frames", "q_heads", "kv_heads", "head_dim", "warmup", "iters")
    }
    report = {
        "command": " ".join(sys.argv),
        "cpus": os.cpu_count(),
        "load_avg_before": os.getloadavg(),
        "ranks": {},
    }
    print("| ranks | query rows | ring ms | gather ms | no-comm ms | ring / gather |")
    print("|---|---|---|---|---|---|")
    for world in args.ranks:
        ms = run_ranks(_bench_rank, world, cfg, timeout_s=1800)[0]
        for rows in args.rows:
            ring, gather, free = ms[f"{rows}/ring"], ms[f"{rows}/gather"], ms[f"{rows}/no-comm"]
            print(
                f"| {world} | {rows} | {ring:.1f} | {gather:.1f} | {free:.1f} | "
                f"{ring / gather:.2f}x |"
            )
        report["ranks"][world] = {"ms": ms, "crossover_rows": _crossover(ms, args.rows)}
        print(
            f"crossover at {world} ranks: gather up to {report['ranks'][world]['crossover_rows']} "
            "query rows"
        )
    report["load_avg_after"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
