#!/usr/bin/env python
"""Ring or gather by query size: where the gather schedule stops beating the LV-XAttn ring.

N ranks, one question's worth of query rows (every row after the whole video, so it sees every
frame), the visual K/V of `--frames` frames of 729 tokens split over the ranks, GQA 14:2, d 64,
forward only (what a question's prefill runs). For each total of query rows it times the ring
(`lv_xattn_with_lse`), the gather schedule (`gather_xattn_with_lse`) and the same local kernel work
with no communication, interleaved, median of the slowest rank; prints a table, the crossover (the
most rows up to which gather was faster at every size) and writes JSON.

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

import torch

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.attention import attn_fwd, gather_xattn_with_lse, lv_xattn_with_lse
from lvx_app.attention.schedule import calibration_path, write_calibration
from scripts.gloo_ranks import run_ranks
from scripts.harness import command_line, machine, write_json
from scripts.xattn_problem import DTYPES, KEYS_PER_FRAME, slices, timed_rounds


def _bench_rank(rank: int, world: int, cfg: dict, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    dev, dtype = torch.device(device), DTYPES[cfg["dtype"]]
    hq, hkv, d, frames = cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"], cfg["frames"]
    s_kv = frames * KEYS_PER_FRAME
    ks = slices(s_kv, world)[rank]
    g = torch.Generator().manual_seed(1000 + rank)
    k = torch.randn(1, ks.stop - ks.start, hkv, d, generator=g).to(dev, dtype)
    v = torch.randn(k.shape, generator=g).to(dev, dtype)
    k_frame = (torch.arange(ks.start, ks.stop) // KEYS_PER_FRAME).view(1, -1).to(dev, torch.int32)
    cases = {}
    for rows in cfg["rows"]:
        qs = slices(rows, world)
        sizes = [s.stop - s.start for s in qs]
        q_all = torch.randn(1, rows, hq, d).to(dev, dtype)
        q = q_all[:, qs[rank]].contiguous()
        q_vis = torch.full((1, sizes[rank]), frames, dtype=torch.int32, device=dev)
        vis_all = torch.full((1, rows), frames, dtype=torch.int32, device=dev)
        kw = dict(q_vis=q_vis, k_frame=k_frame, q_sizes=sizes)
        cases[(rows, "ring")] = lambda q=q, kw=kw: lv_xattn_with_lse(q, k, v, **kw)
        cases[(rows, "gather")] = lambda q=q, kw=kw: gather_xattn_with_lse(q, k, v, **kw)
        cases[(rows, "no-comm")] = lambda q=q_all, vis=vis_all: attn_fwd(
            q, k, v, q_vis=vis, k_frame=k_frame
        )
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
    from lvx_app.parallel.group import destroy_distributed, init_distributed
    from lvx_app.parallel.lifeline import die_with_parent

    die_with_parent()  # a rank ends with the torchrun that started it, however that one ended
    info = init_distributed(cuda=args.device == "cuda")
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
