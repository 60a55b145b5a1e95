#!/usr/bin/env python
"""Distributed cross-attention side by side on CPU ranks: LV-XAttn vs Ring vs Ulysses vs all-gather.

N gloo ranks on this machine at Video-MME proportions scaled down (729 visual tokens per frame,
S_KV/S_Q ≈ 145, GQA 7:1, the mPLUG-Owl3 media mask), timing forward and forward+backward of every
path plus a no-communication run of LV-XAttn's per-rank kernel work. Every row names the block
kernels each path really ran and any fallback. Prints a table and writes JSON.

    python scripts/bench_xattn.py                      # 4 ranks
    python scripts/bench_xattn.py --ranks 2 --out runs/bench_2.json

A GPU cluster's regime on this machine, emulated (`--link-gbps X`): every P2P batch and collective
of every schedule crosses an emulated link (scripts/emulated_link.py): one NIC per rank and
direction at X GB/s that a rank's transfers share, and a per-message latency (`--link-latency-us`,
default NCCL's network ring step); compute proceeds meanwhile, as with a NIC. An emulation, not a
network model (no topology). The LV-XAttn paper's Table 3 row by row: `scripts/bench_paper.py`;
layouts: `scripts/bench_layouts.py`; the per-rank block at 7B shapes on a GPU:
`scripts/bench_xattn_7b.py`.

    python scripts/bench_xattn.py --ranks 2 --link-gbps 0.01
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

import torch
import torch.distributed as dist

from lvx_app.attention import attn_bwd, attn_fwd, lv_xattn, merge_
from lvx_kernels.backends import kernel_tally
from scripts.baselines import allgather_xattn, ring_xattn, ulysses_supported, ulysses_xattn
from scripts.emulated_link import NCCL_NET_LATENCY_S, emulated_link
from scripts.gloo_ranks import run_ranks
from scripts.harness import command_line, machine, markdown, show, write_json
from scripts.xattn_problem import DTYPES, media_mask, shapes, slices, timed_rounds

PATHS = {
    "lv_xattn": lv_xattn,
    "ring_xattn": ring_xattn,
    "ulysses_xattn": ulysses_xattn,
    "allgather_xattn": allgather_xattn,
}


def nocomm(q_blocks, k, v, qv_blocks, k_frame, rank, world, dout_blocks=None):
    """LV-XAttn's per-rank kernel work without any P2P: round t computes block (rank - t) against
    the local shard.

    Every query block is already local (the benchmark made them all), so the same attn_fwd / merge /
    attn_bwd calls run, just with nothing travelling.
    """
    acc = {}
    for t in range(world):
        j = (rank - t) % world
        o, lse = attn_fwd(q_blocks[j], k, v, q_vis=qv_blocks[j], k_frame=k_frame)
        if j not in acc:
            acc[j] = (o.float(), lse)
        else:
            merge_(*acc[j], o, lse)
    if dout_blocks is None:
        return acc
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    for t in range(world):
        j = (rank - t) % world
        out, lse = acc[j]
        _, gk, gv = attn_bwd(
            dout_blocks[j], q_blocks[j], k, v, out.to(k.dtype), lse, q_vis=qv_blocks[j],
            k_frame=k_frame,
        )  # fmt: skip
        dk += gk
        dv += gv
    return dk, dv


def _problem(rank: int, world: int, cfg: dict) -> dict:
    """This rank's share of the problem, every query block made on every rank (the same seed)."""
    torch.manual_seed(0)
    dtype = DTYPES[cfg["dtype"]]
    s_q, s_kv = cfg.get("s_q_kv") or shapes(cfg["frames"], cfg["keys_per_frame"], cfg["ratio"])
    b, hq, hkv, d = cfg["batch"], cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    q_full = torch.randn(b, s_q, hq, d).to(dtype)
    dout_full = torch.randn(b, s_q, hq, d).to(dtype)
    prompt = {k: cfg[k] for k in ("per", "header") if k in cfg}  # a family's placeholders
    q_vis, k_frame_full = media_mask(s_q, s_kv, cfg["frames"], cfg["keys_per_frame"], **prompt)
    q_vis, k_frame_full = q_vis.expand(b, -1), k_frame_full.expand(b, -1)
    if not cfg["mask"]:
        q_vis = k_frame_full = None
    qs, ks = slices(s_q, world), slices(s_kv, world)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank makes only its own K/V shard
    k = torch.randn(b, ks[rank].stop - ks[rank].start, hkv, d, generator=g).to(dtype)
    return {
        "s_q": s_q, "s_kv": s_kv, "k": k, "v": torch.randn(k.shape, generator=g).to(dtype),
        "kf": None if k_frame_full is None else k_frame_full[:, ks[rank]].contiguous(),
        "q_blocks": [q_full[:, s].contiguous() for s in qs],
        "qv_blocks": [None if q_vis is None else q_vis[:, s].contiguous() for s in qs],
        "dout_blocks": [dout_full[:, s].contiguous() for s in qs],
    }  # fmt: skip


def bench_rank(rank: int, world: int, cfg: dict) -> dict:
    """Every path's times, bytes and agreement with LV-XAttn on this rank, over the emulated link
    when `cfg` names one."""
    with emulated_link(cfg.get("link_gbps"), cfg.get("link_latency_s", NCCL_NET_LATENCY_S)):
        return rank_results(rank, world, cfg)


def rank_results(rank: int, world: int, cfg: dict) -> dict:
    """`bench_rank` on whatever link is in place (the paper's emulation sets its own)."""
    p = _problem(rank, world, cfg)
    k, v, kf = p["k"], p["v"], p["kf"]
    q, qv, dout = p["q_blocks"][rank], p["qv_blocks"][rank], p["dout_blocks"][rank]
    backward = cfg.get("backward", True)
    paths = {n: fn for n, fn in PATHS.items() if n in cfg.get("paths", PATHS)}
    results: dict[str, dict] = {}
    skipped = ulysses_supported(cfg["q_heads"], cfg["kv_heads"], world)
    if skipped is not None and "ulysses_xattn" in paths:
        results["ulysses_xattn"] = {"skipped": skipped}
        del paths["ulysses_xattn"]

    def fwd(fn, stats):
        with torch.no_grad():
            return fn(q, k, v, q_vis=qv, k_frame=kf, stats=stats)

    def fwd_bwd(fn, stats, leaves):
        for t in leaves:
            t.grad = None
        fn(*leaves, q_vis=qv, k_frame=kf, stats=stats).backward(dout)

    reference_out = None  # bytes and agreement, from one untimed call of each path
    for name, fn in paths.items():
        out, results[name] = _untimed_row(fn, fwd, fwd_bwd, (q, k, v), backward)
        reference_out = out if reference_out is None else reference_out
        err = torch.tensor([(out - reference_out).abs().max().item() if out.numel() else 0.0])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        results[name]["max_abs_diff_vs_lv"] = float(err)
    results["no-comm"] = {"fwd_bytes": 0, "bwd_bytes": 0}
    blocks = (p["q_blocks"], k, v, p["qv_blocks"], kf, rank, world)
    cases = {("no-comm", "fwd_s"): lambda: nocomm(*blocks)}
    if backward:
        cases[("no-comm", "fwd_bwd_s")] = lambda: nocomm(*blocks, p["dout_blocks"])
    for name, fn in paths.items():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        cases[(name, "fwd_s")] = lambda fn=fn: fwd(fn, {})
        if backward:
            cases[(name, "fwd_bwd_s")] = lambda fn=fn, leaves=leaves: fwd_bwd(fn, {}, leaves)
    for (name, phase), row in timed_rounds(cases, cfg["warmup"], cfg["iters"]).items():
        results[name][phase] = row
    order = [*PATHS, "no-comm"]
    results = {name: results[name] for name in order if name in results}
    return {"rank": rank, "s_q": p["s_q"], "s_kv": p["s_kv"], "results": results}


def _untimed_row(fn, fwd, fwd_bwd, qkv: tuple, backward: bool) -> tuple[torch.Tensor, dict]:
    """One untimed call of a path: (its output, its row: bytes sent, the block kernels that really
    ran and any fallback)."""
    stats: dict = {}
    with kernel_tally() as seen:
        out = fwd(fn, stats).float()
        row = {"fwd_bytes": stats.get("fwd_bytes", 0)}
        stats = {}
        if backward:
            fwd_bwd(fn, stats, [t.detach().clone().requires_grad_() for t in qkv])
    row["bwd_bytes"] = stats.get("bwd_bytes", 0)
    row["ran"] = {"fwd": seen.ran("fwd"), "bwd": seen.ran("bwd")}
    row["fallbacks"] = sorted(seen.fallbacks)
    return out, row


def summarise(per_rank: list[dict]) -> dict:
    """Times are already the slowest rank's per iteration; bytes: the most any rank sent. A path
    timed forward only (the paper's no-comm calibration) has no fwd+bwd figures."""
    summary = {}
    for name, row in per_rank[0]["results"].items():
        if "skipped" in row:
            summary[name] = dict(row)
            continue
        summary[name] = {
            "fwd_ms": 1e3 * statistics.median(row["fwd_s"]),
            "fwd_ms_all": [1e3 * x for x in row["fwd_s"]],
            "fwd_bytes_per_rank": max(r["results"][name]["fwd_bytes"] for r in per_rank),
            "fwd_bwd_bytes_per_rank": max(
                r["results"][name]["fwd_bytes"] + r["results"][name]["bwd_bytes"] for r in per_rank
            ),
            "max_abs_diff_vs_lv": row.get("max_abs_diff_vs_lv"),
            "ran": row.get("ran", {}),
            "fallbacks": sorted(
                {f for r in per_rank for f in r["results"][name].get("fallbacks", ())}
            ),
        }
        if "fwd_bwd_s" in row:
            summary[name]["fwd_bwd_ms"] = 1e3 * statistics.median(row["fwd_bwd_s"])
            summary[name]["fwd_bwd_ms_all"] = [1e3 * x for x in row["fwd_bwd_s"]]
    ring, free = summary.get("ring_xattn", {}), summary["no-comm"]
    for row in summary.values():
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if key not in row:
                continue
            phase = key[:-3]
            if ring.get(key):
                row[f"speedup_vs_ring_{phase}"] = ring[key] / row[key]
            row[f"overhead_vs_nocomm_{phase}"] = row[key] / free[key] - 1
    return summary


def table_rows(summary: dict) -> list[dict]:
    """The summary as the rows of the printed table (and of `--markdown`)."""
    rows = []
    for name, r in summary.items():
        if "skipped" in r:
            rows.append({"method": name, "fwd ms": f"skipped: {r['skipped']}"})
            continue
        ring = [r.get(f"speedup_vs_ring_{p}") for p in ("fwd", "fwd_bwd")]
        diff = r.get("max_abs_diff_vs_lv")
        rows.append(
            {
                "method": name,
                "fwd ms": f"{r['fwd_ms']:.1f}",
                "fwd+bwd ms": f"{r.get('fwd_bwd_ms', float('nan')):.1f}",
                "MB sent/rank fwd": f"{r['fwd_bytes_per_rank'] / 1e6:.2f}",
                "MB sent/rank fwd+bwd": f"{r['fwd_bwd_bytes_per_rank'] / 1e6:.2f}",
                "speedup vs ring fwd / fwd+bwd": " / ".join(
                    f"{x:.2f}x" if x else "-" for x in ring
                ),
                "overhead vs no-comm fwd / fwd+bwd": " / ".join(
                    f"{100 * r.get(f'overhead_vs_nocomm_{p}', float('nan')):+.0f}%"
                    for p in ("fwd", "fwd_bwd")
                ),
                "max abs diff vs LV": "" if diff is None else f"{diff:.1e}",
            }
        )
    return rows


def run(args) -> dict:
    keys = ("ranks", "frames", "keys_per_frame", "ratio", "batch", "q_heads", "kv_heads")
    cfg = {k: getattr(args, k) for k in (*keys, "head_dim", "dtype", "warmup", "iters")}
    cfg |= {"mask": not args.no_mask, "link_gbps": args.link_gbps}
    cfg["link_latency_s"] = args.link_latency_us * 1e-6
    s_q, s_kv = shapes(cfg["frames"], cfg["keys_per_frame"], cfg["ratio"])
    if args.link_gbps:
        print(
            f"emulated link (an emulation): one NIC per rank and direction at {args.link_gbps:g} "
            f"GB/s, {args.link_latency_us:g} us per message"
        )
    print(
        f"{args.ranks} gloo ranks (1 thread each, {os.cpu_count()} CPUs); S_q={s_q}, S_kv={s_kv} "
        f"({cfg['frames']} frames × {cfg['keys_per_frame']}), heads {args.q_heads}/"
        f"{args.kv_heads}, d={args.head_dim}, {args.dtype}, media mask "
        f"{'on' if cfg['mask'] else 'off'}; median of {args.iters} after {args.warmup} warm-up"
    )
    t0, load_before = time.perf_counter(), os.getloadavg()
    summary = summarise(run_ranks(bench_rank, args.ranks, cfg, timeout_s=3600))
    rows = table_rows(summary)
    show(f"Cross-attention, {args.ranks} CPU ranks", rows)
    if args.markdown:
        print(markdown(rows))
    load = {"before": load_before, "after": os.getloadavg()}  # 1/5/15-minute load averages
    print(
        f"total wall time {time.perf_counter() - t0:.0f} s; load average before "
        f"{load_before[0]:.1f}, after {load['after'][0]:.1f} (other work on this machine)"
    )
    return {"config": cfg, "s_q": s_q, "s_kv": s_kv, "loadavg": load, "results": summary}


def add_problem_options(p: argparse.ArgumentParser, ranks: int = 4) -> None:
    """The CPU problem's options, shared with bench_layouts.py."""
    p.add_argument("--ranks", type=int, default=ranks, help=f"CPU gloo ranks (default {ranks})")
    p.add_argument("--frames", type=int, default=48, help="video frames in total")
    p.add_argument(
        "--keys-per-frame", type=int, default=729, help="visual tokens per frame (SigLIP: 729)"
    )
    p.add_argument(
        "--ratio", type=float, default=145.0, help="S_KV / S_Q (Video-MME with mPLUG-Owl3: ~145)"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the results as JSON here")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add_problem_options(p)
    p.add_argument("--no-mask", action="store_true", help="attend every query to every frame")
    p.add_argument("--link-gbps", type=float, default=None, help="emulate a link of this many GB/s")
    p.add_argument(
        "--link-latency-us",
        type=float,
        default=NCCL_NET_LATENCY_S * 1e6,
        help="with --link-gbps: each message's latency (default: NCCL's network ring step)",
    )
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    args = p.parse_args(argv)
    report = run(args) | {"machine": machine(), "command": command_line()}
    if args.out:
        print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
