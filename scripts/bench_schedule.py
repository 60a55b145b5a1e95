#!/usr/bin/env python
"""Ring or gather by query size: where the engine's gather stops beating its LV-XAttn ring.

What is timed is what the engine runs for a question's prefill, one hyper layer of it: the
attention hooks `parallelize` installs (`ShardedAttention.text` and `.visual`), called as the
model's forward calls them. "ring": the question sharded over the ranks (`sharded_feed`), its text
attention and its visual attention each an LV-XAttn ring. "gather": the question fed whole on every
rank (the replicated feed), text attention local over the replicated cache and the visual partials
combined in one collective (`ShardedAttention.combine`, `decode_xattn`). "no-comm": the same local
kernel work over all rows with no communication. N ranks, the visual K/V of `--frames` frames of
729 tokens split over the ranks, a text cache of the video prompt's 5 positions per frame, GQA
14:2, d 64, forward only; interleaved, median of the slowest rank. Prints a table, the crossover
(the most rows up to which gather was faster at every size) and writes JSON.

CPU: gloo ranks spawned here, one per `--ranks` entry in turn. GPU: start it under torchrun, one
rank per GPU (NCCL), with `--device cuda`; the ranks are then torchrun's.

`--calibrate` writes the crossovers measured to this machine's calibration file in the cache folder
(`--cache-dir DIR`, else `$LVX_CACHE_DIR`, else ~/.cache/lvx; `--calibration-file` names another
file), which an engine run with the same cache folder reads once at start in place of
`lvx_app/attention/schedule.py`'s built-in GATHER_MAX_ROWS for the numbers of ranks measured.

    python scripts/bench_schedule.py --ranks 2 4 --rows 8 24 64 128 256 --out runs/schedule.json
    python scripts/bench_schedule.py --ranks 2 4 --calibrate [--cache-dir DIR]
    torchrun --nproc-per-node 8 scripts/bench_schedule.py --device cuda --calibrate
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.attention import attn_fwd
from lvx_app.attention.schedule import calibration_path, write_calibration
from lvx_app.engine.parallelize import ShardedAttention
from lvx_kernels.feed import REPLICATED
from lvx_kernels.masks import Indices
from scripts.gloo_ranks import run_ranks
from scripts.harness import command_line, machine, write_json
from scripts.xattn_problem import DTYPES, KEYS_PER_FRAME, slices, timed_rounds


def _question(rows: int, world: int, rank: int, frames: int, dev, heads: tuple) -> tuple:
    """A question of `rows` tokens after the video prompt's text cache: every rank's queries,
    keys and values of one layer (text: the cache's and the question's own), its positions."""
    hq, hkv, d, dtype = heads
    cached = 5 * frames
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(1, rows, hq, d, generator=g).to(dev, dtype)
    kv = [torch.randn(1, cached + rows, hkv, d, generator=g).to(dev, dtype) for _ in range(2)]
    qs = slices(rows, world)
    every = [torch.arange(cached + s.start, cached + s.stop).view(1, -1) for s in qs]
    return q, kv, qs, every, cached


def _cases(rank: int, world: int, cfg: dict, dev, dtype) -> dict:
    """For each total of query rows: the engine's hooks under the sharded feed ("ring") and the
    replicated one ("gather"), and their local kernel work alone ("no-comm")."""
    hq, hkv, d, frames = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"], cfg["frames"]
    ks = slices(frames * KEYS_PER_FRAME, world)[rank]
    g = torch.Generator().manual_seed(1000 + rank)
    vk = torch.randn(1, ks.stop - ks.start, hkv, d, generator=g).to(dev, dtype)
    vv = torch.randn(vk.shape, generator=g).to(dev, dtype)
    k_frame = Indices.of_host((torch.arange(ks.start, ks.stop) // KEYS_PER_FRAME).view(1, -1), dev)
    hooks = ShardedAttention(None, rank, world)
    cases = {}
    for rows in cfg["rows"]:
        heads = (hq, hkv, d, dtype)
        q, (tk, tv), qs, every, cached = _question(rows, world, rank, frames, dev, heads)
        mine = qs[rank]
        sees_all = [torch.full_like(p, frames) for p in every]
        feed = hooks.sharded_feed(every[rank], [p.numel() for p in every], dev, cached, every)
        ring = _step(feed, vk, vv, k_frame, Indices.of_host(sees_all[rank], dev), sees_all)
        whole = Indices.of_host(torch.full((1, rows), frames), dev)
        gather = _step(REPLICATED, vk, vv, k_frame, whole, None)
        # the cache, then this rank's own tokens' keys, as the model hands them to the text hook
        tk_mine, tv_mine = (torch.cat([t[:, :cached], t[:, cached:][:, mine]], 1) for t in (tk, tv))
        qm = q[:, mine].contiguous()
        cases[(rows, "ring")] = lambda q=qm, k=tk_mine, v=tv_mine, s=ring: _layer(hooks, q, k, v, s)
        cases[(rows, "gather")] = lambda q=q, k=tk, v=tv, s=gather: _layer(hooks, q, k, v, s)
        cases[(rows, "no-comm")] = lambda q=q, k=tk, v=tv, w=whole: (
            attn_fwd(q, k, v, causal=True),
            attn_fwd(q, vk, vv, q_vis=w, k_frame=k_frame),
        )
    return cases


def _step(feed, k, v, k_frame, q_vis, q_vis_every) -> SimpleNamespace:
    """What a hyper layer's forward hands its hooks (the model's StepContext and VisualStep)."""
    visual = SimpleNamespace(
        kv={0: (k, v)}, k_frame=k_frame, q_vis=q_vis, q_vis_every=q_vis_every, window=None
    )
    return SimpleNamespace(feed=feed, visual=visual)


def _layer(hooks: ShardedAttention, q, k, v, step) -> None:
    """One hyper layer's attention as the engine runs it: its text hook, then its visual one."""
    hooks.text(q, k, v, step, 0)
    hooks.visual(q, step, 0)


def _bench_rank(rank: int, world: int, cfg: dict, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    dev, dtype = torch.device(device), DTYPES[cfg["dtype"]]
    cases = _cases(rank, world, cfg, dev, dtype)
    with torch.no_grad():
        times = timed_rounds(cases, cfg["warmup"], cfg["iters"], device=dev)
    return {f"{rows}/{name}": 1e3 * statistics.median(t) for (rows, name), t in times.items()}


def _crossover(row_ms: dict, rows: list[int]) -> int:
    """The most query rows up to which gather beat the ring at every size measured (0 if it lost
    at the fewest): a noisy win beyond a loss does not count."""
    best = 0
    for r in sorted(rows):
        if row_ms[f"{r}/gather"] >= row_ms[f"{r}/ring"]:
            break
        best = r
    return best


def _print_rows(world: int, rows: list[int], ms: dict) -> None:
    for r in rows:
        ring, gather, free = ms[f"{r}/ring"], ms[f"{r}/gather"], ms[f"{r}/no-comm"]
        print(f"| {world} | {r} | {ring:.1f} | {gather:.1f} | {free:.1f} | {ring / gather:.2f}x |")
    print(f"crossover at {world} ranks: gather up to {_crossover(ms, rows)} query rows")


def _under_torchrun(args, cfg: dict) -> dict[int, dict] | None:
    """This process as one rank of torchrun's group; the measurement on rank 0, None elsewhere."""
    from lvx_app.defaults import CHECK_TIMEOUT_S
    from lvx_app.parallel.group import destroy_distributed, init_distributed
    from lvx_app.parallel.lifeline import die_with_parent

    die_with_parent()  # a rank ends with the torchrun that started it, however that one ended
    info = init_distributed(cuda=args.device == "cuda", timeout_s=CHECK_TIMEOUT_S)
    try:
        ms = _bench_rank(info.rank, info.world_size, cfg, str(info.device))
    finally:
        destroy_distributed()
    return {info.world_size: ms} if info.rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="CPU: gloo ranks")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="query rows in total")
    ap.add_argument("--frames", type=int, default=48, help="48 frames x 729 = S_KV 34,992")
    ap.add_argument("--q-heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cpu: float32; cuda: bf16"
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--calibrate", action="store_true", help="write the crossovers (see above)")
    ap.add_argument("--cache-dir", type=Path, help="--calibrate: the cache folder to write it in")
    ap.add_argument("--calibration-file", type=Path, help="--calibrate: write this file instead")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    default_rows = [8, 24, 64, 128, 256, 512, 1024] if args.calibrate else [8, 24, 64, 128, 256]
    args.rows = sorted(args.rows or default_rows)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    cfg = {
        k: getattr(args, k)
        for k in ("rows", "frames", "q_heads", "kv_heads", "head_dim", "dtype", "warmup", "iters")
    }
    load_before = os.getloadavg()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        measured = _under_torchrun(args, cfg)
        if measured is None:  # not rank 0: rank 0 reports
            return
    elif args.device == "cuda":
        raise SystemExit("--device cuda runs under torchrun, one rank per GPU (see --help)")
    else:
        measured = {n: run_ranks(_bench_rank, n, cfg, timeout_s=1800)[0] for n in args.ranks}
    print("| ranks | query rows | ring ms | gather ms | no-comm ms | ring / gather |")
    print("|---|---|---|---|---|---|")
    for world, ms in measured.items():
        _print_rows(world, args.rows, ms)
    report = {
        "command": command_line(),
        "machine": machine(args.device),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "ranks": {
            w: {"ms": ms, "crossover_rows": _crossover(ms, args.rows)} for w, ms in measured.items()
        },
    }
    if args.calibrate:
        found = {w: r["crossover_rows"] for w, r in report["ranks"].items()}
        path = args.calibration_file or calibration_path(args.cache_dir)
        path = write_calibration(found, report["machine"], report["command"], path)
        report["calibration_file"] = str(path)
        print(f"wrote {path}: the engine gathers up to {found} query rows (by ranks)")
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
