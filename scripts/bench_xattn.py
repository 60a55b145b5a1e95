#!/usr/bin/env python
"""Distributed cross-attention side by side: LV-XAttn vs Ring vs Ulysses vs all-gather.

CPU (default): N gloo ranks on this machine at Video-MME proportions scaled down (729 visual tokens
per frame, S_KV/S_Q ≈ 145, GQA 7:1, the mPLUG-Owl3 media mask), timing forward and forward+backward
of every path plus a no-communication run of LV-XAttn's per-rank kernel work. Prints a table and
writes JSON.

    python scripts/bench_xattn.py                      # 4 ranks
    python scripts/bench_xattn.py --ranks 2 --out runs/bench_2.json
    # LV-XAttn per layout
    python scripts/bench_xattn.py --ranks 2 --layout contiguous,striped,zigzag

`--layout` times LV-XAttn alone with frames and their placeholder tokens dealt by each layout
(lvx_app/parallel/layout.py), layouts interleaved in one run, and prints each round's busiest rank's
visible work against the mean, from the plan, at --ranks, 4 and 8 ranks.

A GPU cluster's regime on this machine, emulated (`--link-gbps X`, `--paper`): every P2P batch and
collective of every schedule crosses an emulated link (scripts/emulated_link.py): one NIC per rank
and direction at X GB/s that a rank's transfers share, and a per-message latency
(`--link-latency-us`, default NCCL's network ring step); compute proceeds meanwhile, as with a NIC.
An emulation, not a network model (no topology). `--paper` emulates the LV-XAttn paper's Table 3
row by row at scaled shapes (scripts/paper_emulation.py: forward and backward, bf16, no mask,
LV-XAttn vs Ring vs no-comm; the link set per row so that transfer over compute time is the 16
A100s' at an assumed kernel efficiency) and prints the paper's row next to ours, a sensitivity line
over the efficiencies and the efficiency the paper's own LV-XAttn times imply. An emulation, not a
reproduction of the paper's runs.

    python scripts/bench_xattn.py --ranks 2 --link-gbps 0.01
    python scripts/bench_xattn.py --paper --ranks 2 --warmup 1 --iters 3 --out runs/paper.json

CUDA (`--device cuda`, or `--kernels` on any device): one process times the per-rank block kernel of
every available backend at real per-rank shapes (mPLUG-Owl3-7B: 28 query heads, 4 KV heads, d=128;
an hour of video at 1 fps over 8 GPUs) in TFLOP/s. Every row names the kernels each call site really
ran (cuDNN's backward is the memory-efficient kernel's) and every fallback, which the JSON also
lists under "fallbacks"; the CPU rank benchmark records the same per path.

    python scripts/bench_xattn.py --device cuda --out runs/bench_xattn_gpu.json
    python scripts/bench_xattn.py --kernels --device cpu --cuda-frames 16 --iters 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.attention import attn_bwd, attn_fwd, available_backends, lv_xattn, merge_
from lvx_app.attention.backends import can_run, kernel_tally
from lvx_app.defaults import LAYOUTS
from lvx_app.parallel.layout import balance, owners, round_work, token_owners
from scripts.baselines import allgather_xattn, ring_xattn, ulysses_supported, ulysses_xattn
from scripts.emulated_link import NCCL_NET_LATENCY_S, emulated_link
from scripts.gloo_ranks import run_ranks
from scripts.paper_emulation import TABLE3, emulated_link_for, implied_efficiency, scale

TOKENS_PER_PLACEHOLDER = 5  # `<|image|>` is ~5 text tokens; 729/5 ≈ 145 = Video-MME's S_KV/S_Q
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------ problem


def shapes(frames: int, keys_per_frame: int, ratio: float) -> tuple[int, int]:
    """(S_q, S_kv) of the whole problem."""
    s_kv = frames * keys_per_frame
    return max(1, round(s_kv / ratio)), s_kv


def media_mask(s_q: int, s_kv: int, frames: int, keys_per_frame: int):
    """mPLUG-Owl3 (G1) mask: frame j's placeholder starts at token 5j; token t sees frame j iff 5j <
    t."""
    t = torch.arange(s_q)
    q_vis = torch.div(
        t + TOKENS_PER_PLACEHOLDER - 1, TOKENS_PER_PLACEHOLDER, rounding_mode="floor"
    ).clamp(max=frames)
    k_frame = torch.arange(s_kv) // keys_per_frame
    return q_vis.unsqueeze(0).to(torch.int32), k_frame.unsqueeze(0).to(torch.int32)


def _slices(total: int, world: int) -> list[slice]:
    """Contiguous shards, `torch.tensor_split` sizes."""
    bounds = [0]
    for part in torch.arange(total).tensor_split(world):
        bounds.append(bounds[-1] + len(part))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


# ------------------------------------------------------------------ the no-communication run


def nocomm(q_blocks, k, v, qv_blocks, k_frame, rank, world, dout_blocks=None):
    """LV-XAttn's per-rank kernel work without any P2P: round t computes block (rank - t) against
    the local shard.

    Every query block is already local (the benchmark made them all), so the same attn_fwd / merge /
    attn_bwd calls run, just with nothing travelling.
    """
    acc = {}
    for t in range(world):
        j = (rank - t) % world
        qj = q_blocks[j]
        o, lse = attn_fwd(qj, k, v, q_vis=qv_blocks[j], k_frame=k_frame)
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
            dout_blocks[j],
            q_blocks[j],
            k,
            v,
            out.to(k.dtype),
            lse,
            q_vis=qv_blocks[j],
            k_frame=k_frame,
        )
        dk += gk
        dv += gv
    return dk, dv


# ------------------------------------------------------------------ one rank


def _timed_rounds(cases: dict, warmup: int, iters: int, device: torch.device | None = None) -> dict:
    """Per-iteration wall time of every case, the slowest rank's; all ranks start each after a
    barrier.

    Interleaved: every iteration runs every case once, so load that comes and goes on a shared
    machine hits all of them alike. On a GPU (`device`) each case is timed to its last kernel.
    """
    cuda = device is not None and device.type == "cuda"
    times: dict = {name: [] for name in cases}
    for it in range(warmup + iters):
        for name, fn in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            if it >= warmup:
                times[name].append(time.perf_counter() - t0)
    names = list(cases)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: row for n, row in zip(names, t.cpu().tolist())}


def _bench_rank(rank: int, world: int, cfg: dict) -> dict:
    with emulated_link(cfg.get("link_gbps"), cfg.get("link_latency_s", NCCL_NET_LATENCY_S)):
        return _bench_rank_on_link(rank, world, cfg)


def _bench_rank_on_link(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)  # the same full query side on every rank
    dtype = DTYPES[cfg["dtype"]]
    s_q, s_kv = cfg.get("s_q_kv") or shapes(cfg["frames"], cfg["keys_per_frame"], cfg["ratio"])
    b, hq, hkv, d = cfg["batch"], cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    q_full = torch.randn(b, s_q, hq, d).to(dtype)
    dout_full = torch.randn(b, s_q, hq, d).to(dtype)
    q_vis, k_frame_full = media_mask(s_q, s_kv, cfg["frames"], cfg["keys_per_frame"])
    q_vis, k_frame_full = q_vis.expand(b, -1), k_frame_full.expand(b, -1)
    if not cfg["mask"]:
        q_vis = k_frame_full = None
    qs, ks = _slices(s_q, world), _slices(s_kv, world)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank makes only its own K/V shard
    k = torch.randn(b, ks[rank].stop - ks[rank].start, hkv, d, generator=g).to(dtype)
    v = torch.randn(k.shape, generator=g).to(dtype)
    kf = None if k_frame_full is None else k_frame_full[:, ks[rank]].contiguous()
    q_blocks = [q_full[:, s].contiguous() for s in qs]
    qv_blocks = [None if q_vis is None else q_vis[:, s].contiguous() for s in qs]
    dout_blocks = [dout_full[:, s].contiguous() for s in qs]
    q, qv, dout = q_blocks[rank], qv_blocks[rank], dout_blocks[rank]

    paths = {
        "lv_xattn": lambda q_, k_, v_, stats: lv_xattn(
            q_, k_, v_, q_vis=qv, k_frame=kf, stats=stats
        ),
        "ring_xattn": lambda q_, k_, v_, stats: ring_xattn(
            q_, k_, v_, q_vis=qv, k_frame=kf, stats=stats
        ),
        "ulysses_xattn": lambda q_, k_, v_, stats: ulysses_xattn(
            q_, k_, v_, q_vis=qv, k_frame=kf, stats=stats
        ),
        "allgather_xattn": lambda q_, k_, v_, stats: allgather_xattn(
            q_, k_, v_, q_vis=qv, k_frame=kf, stats=stats
        ),
    }
    results: dict[str, dict] = {}
    paths = {name: fn for name, fn in paths.items() if name in cfg.get("paths", paths)}
    skipped = ulysses_supported(hq, hkv, world)
    if skipped is not None and "ulysses_xattn" in paths:
        results["ulysses_xattn"] = {"skipped": skipped}
        del paths["ulysses_xattn"]

    def fwd(fn, stats):
        with torch.no_grad():
            return fn(q, k, v, stats)

    def fwd_bwd(fn, stats, leaves):
        for t in leaves:
            t.grad = None
        fn(*leaves, stats).backward(dout)

    # Bytes and agreement, from one untimed call of each path.
    reference_out = None
    for name, fn in paths.items():
        out, results[name] = _untimed_row(fn, fwd, fwd_bwd, (q, k, v), cfg.get("backward", True))
        reference_out = out if reference_out is None else reference_out
        err = torch.tensor([(out - reference_out).abs().max().item() if out.numel() else 0.0])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        results[name]["max_abs_diff_vs_lv"] = float(err)
    results["no-comm"] = {"fwd_bytes": 0, "bwd_bytes": 0}

    cases = {}
    for name, fn in paths.items():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        cases[(name, "fwd_s")] = lambda fn=fn: fwd(fn, {})
        if cfg.get("backward", True):
            cases[(name, "fwd_bwd_s")] = lambda fn=fn, leaves=leaves: fwd_bwd(fn, {}, leaves)
    cases[("no-comm", "fwd_s")] = lambda: nocomm(q_blocks, k, v, qv_blocks, kf, rank, world)
    if cfg.get("backward", True):
        cases[("no-comm", "fwd_bwd_s")] = lambda: nocomm(
            q_blocks, k, v, qv_blocks, kf, rank, world, dout_blocks
        )
    for (name, phase), row in _timed_rounds(cases, cfg["warmup"], cfg["iters"]).items():
        results[name][phase] = row
    order = ["lv_xattn", "ring_xattn", "ulysses_xattn", "allgather_xattn", "no-comm"]
    results = {name: results[name] for name in order if name in results}
    return {"rank": rank, "s_q": s_q, "s_kv": s_kv, "results": results, "loadavg": os.getloadavg()}


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


# ------------------------------------------------------------------ layouts


def layout_shard(cfg: dict, layout: str, rank: int, world: int):
    """(token indices, key indices) this rank holds when frames and their placeholder tokens follow
    `layout`."""
    s_q, s_kv = shapes(cfg["frames"], cfg["keys_per_frame"], cfg["ratio"])
    starts = torch.arange(cfg["frames"]) * TOKENS_PER_PLACEHOLDER
    tail = min(s_q, cfg["frames"] * TOKENS_PER_PLACEHOLDER)
    tokens = torch.nonzero(
        token_owners(s_q, starts, world, layout, tail_from=tail) == rank
    ).flatten()
    key_rank = owners(cfg["frames"], world, layout).repeat_interleave(cfg["keys_per_frame"])
    return tokens, torch.nonzero(key_rank == rank).flatten()


def layout_work(cfg: dict, layout: str, world: int) -> torch.Tensor:
    """(rounds, ranks) visible (query, key) pairs of LV-XAttn's ring under `layout`, from the plan
    alone."""
    s_q, s_kv = shapes(cfg["frames"], cfg["keys_per_frame"], cfg["ratio"])
    q_vis, k_frame = (
        x[0].long() for x in media_mask(s_q, s_kv, cfg["frames"], cfg["keys_per_frame"])
    )
    q_rank, k_rank = torch.zeros(s_q, dtype=torch.long), torch.zeros(s_kv, dtype=torch.long)
    for r in range(world):
        tokens, keys = layout_shard(cfg, layout, r, world)
        q_rank[tokens], k_rank[keys] = r, r
    return round_work(q_vis, q_rank, k_frame, k_rank, world)


def _round_cpu(full, q_vis, k_frame, cfg: dict, layout: str, rank: int, world: int) -> torch.Tensor:
    """(rounds, ranks) CPU seconds of each round's kernel work (fwd + bwd, no P2P), every rank's row
    filled in by it.

    CPU time, not wall time: on a machine shared with other jobs it still shows what each rank
    computes per round, and a round on dedicated cores lasts as long as its busiest rank."""
    tokens, keys = layout_shard(cfg, layout, rank, world)
    k, v = full[1].index_select(1, keys), full[2].index_select(1, keys)
    kf = k_frame[:, keys]
    cpu = torch.zeros(world, world, dtype=torch.float64)
    for t in range(world):
        src, _ = layout_shard(cfg, layout, (rank - t) % world, world)
        q, dout, qv = full[0].index_select(1, src), full[3].index_select(1, src), q_vis[:, src]
        t0 = time.process_time()
        out, lse = attn_fwd(q, k, v, q_vis=qv, k_frame=kf)
        attn_bwd(dout, q, k, v, out.to(k.dtype), lse, q_vis=qv, k_frame=kf)
        cpu[t, rank] = time.process_time() - t0
    dist.all_reduce(cpu)
    return cpu


def _layout_rank(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)  # the same full problem on every rank; each takes its layout's share
    dtype = DTYPES[cfg["dtype"]]
    s_q, s_kv = shapes(cfg["frames"], cfg["keys_per_frame"], cfg["ratio"])
    b, hq, hkv, d = cfg["batch"], cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"]
    full = [
        torch.randn(b, n, h, d).to(dtype)
        for n, h in ((s_q, hq), (s_kv, hkv), (s_kv, hkv), (s_q, hq))
    ]
    q_vis, k_frame = media_mask(s_q, s_kv, cfg["frames"], cfg["keys_per_frame"])
    cases = {}
    for layout in cfg["layouts"]:
        tokens, keys = layout_shard(cfg, layout, rank, world)
        q, k, v, dout = (
            x.index_select(1, idx) for x, idx in zip(full, (tokens, keys, keys, tokens))
        )
        qv, kf = q_vis[:, tokens].expand(b, -1), k_frame[:, keys].expand(b, -1)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

        def fwd(q=q, k=k, v=v, qv=qv, kf=kf):
            with torch.no_grad():
                lv_xattn(q, k, v, q_vis=qv, k_frame=kf)

        def fwd_bwd(leaves=leaves, qv=qv, kf=kf, dout=dout):
            for t in leaves:
                t.grad = None
            lv_xattn(*leaves, q_vis=qv, k_frame=kf).backward(dout)

        cases[(layout, "fwd_s")], cases[(layout, "fwd_bwd_s")] = fwd, fwd_bwd
    cpu = {layout: [] for layout in cfg["layouts"]}
    for _ in range(cfg["iters"]):
        for layout in cfg["layouts"]:
            cpu[layout].append(_round_cpu(full, q_vis, k_frame, cfg, layout, rank, world).tolist())
    return {
        "times": _timed_rounds(cases, cfg["warmup"], cfg["iters"]),
        "cpu": cpu,
        "loadavg": os.getloadavg(),
    }


def run_layouts(args) -> dict:
    """LV-XAttn with each layout, interleaved in one run, and the per-round work balance from the
    plan."""
    cfg = {
        k: getattr(args, k)
        for k in (
            "frames",
            "keys_per_frame",
            "ratio",
            "batch",
            "q_heads",
            "kv_heads",
            "head_dim",
            "dtype",
            "warmup",
            "iters",
        )
    }
    cfg["layouts"] = args.layout.split(",")
    for name in cfg["layouts"]:
        if name not in LAYOUTS:
            raise SystemExit(
                f"--layout: unknown layout {name!r}; use a comma list of {', '.join(LAYOUTS)}"
            )
    load_before = os.getloadavg()
    times = run_ranks(_layout_rank, args.ranks, cfg, timeout_s=3600)[0]
    rows = {}
    for layout in cfg["layouts"]:
        row = {
            p[:-2] + "_ms": 1e3 * statistics.median(times["times"][(layout, p)])
            for p in ("fwd_s", "fwd_bwd_s")
        }
        # (rounds, ranks), median over iterations
        cpu = torch.tensor(times["cpu"][layout]).median(0).values
        # rounds on dedicated cores: busiest rank each
        row["cpu_busiest_ms"] = 1e3 * float(cpu.amax(1).sum())
        row["cpu_mean_ms"] = 1e3 * float(cpu.sum() / cpu.shape[1])
        for world in sorted({args.ranks, 4, 8}):
            work = layout_work(cfg, layout, world).double()
            row[f"balance_{world}"] = balance(work)
            row[f"round_max_over_mean_{world}"] = (
                work.amax(1) / work.mean(1).clamp(min=1)
            ).tolist()
        rows[layout] = row
    base = rows.get("contiguous")
    print(
        f"LV-XAttn, {args.ranks} gloo ranks, media mask, {cfg['frames']} frames × "
        f"{cfg['keys_per_frame']}, "
        f"{cfg['dtype']}; median of {cfg['iters']}; load average {load_before[0]:.1f} -> "
        f"{times['loadavg'][0]:.1f}"
    )
    for layout, row in rows.items():
        speed = (
            ""
            if base is None
            else (
                f"  speed-up vs contiguous fwd {base['fwd_ms'] / row['fwd_ms']:.2f}x, "
                f"fwd+bwd {base['fwd_bwd_ms'] / row['fwd_bwd_ms']:.2f}x"
            )
        )
        bal = ", ".join(f"{w} ranks {row[f'balance_{w}']:.2f}" for w in sorted({args.ranks, 4, 8}))
        print(
            f"{layout:>10}: fwd {row['fwd_ms']:.0f} ms, fwd+bwd {row['fwd_bwd_ms']:.0f} ms{speed}"
        )
        cpu_speed = (
            ""
            if base is None
            else f" ({base['cpu_busiest_ms'] / row['cpu_busiest_ms']:.2f}x vs contiguous)"
        )
        print(
            f"{'':>10}  fwd+bwd kernel CPU time, busiest rank per round summed: "
            f"{row['cpu_busiest_ms']:.0f} ms"
            f"{cpu_speed}; balanced would be {row['cpu_mean_ms']:.0f} ms"
        )
        print(f"{'':>10}  busiest rank / mean, summed over rounds: {bal}")
        per_round = ", ".join(f"{x:.2f}" for x in row[f"round_max_over_mean_{args.ranks}"])
        print(f"{'':>10}  per round at {args.ranks} ranks: {per_round}")
    return {"config": cfg, "machine": machine(), "results": rows}


# ------------------------------------------------------------------ CPU report


def _summarise(per_rank: list[dict]) -> dict:
    """Times are already the slowest rank's per iteration; bytes: the most any rank sent."""
    summary = {}
    for name, row in per_rank[0]["results"].items():
        if "skipped" in row:
            summary[name] = dict(row)
            continue
        bwd = row.get("fwd_bwd_s") or [float("nan")]  # nan: forward only (--paper)
        summary[name] = {
            "fwd_ms": 1e3 * statistics.median(row["fwd_s"]),
            "fwd_bwd_ms": 1e3 * statistics.median(bwd),
            "fwd_ms_all": [1e3 * x for x in row["fwd_s"]],
            "fwd_bwd_ms_all": [1e3 * x for x in bwd],
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
    ring, free = summary.get("ring_xattn", {}), summary["no-comm"]
    for row in summary.values():
        if "fwd_ms" not in row:
            continue
        for key in ("fwd_ms", "fwd_bwd_ms"):
            phase = key[:-3]
            if ring.get(key):
                row[f"speedup_vs_ring_{phase}"] = ring[key] / row[key]
            row[f"overhead_vs_nocomm_{phase}"] = row[key] / free[key] - 1
    return summary


def _print_table(summary: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "method",
        "fwd ms",
        "fwd+bwd ms",
        "MB sent/rank fwd",
        "MB sent/rank fwd+bwd",
        "speedup vs ring fwd",
        "speedup vs ring fwd+bwd",
        "overhead vs no-comm fwd",
        "overhead vs no-comm fwd+bwd",
        "max |Δout| vs LV",
    ):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, row in summary.items():
        if "skipped" in row:
            table.add_row(name, f"skipped: {row['skipped']}", *[""] * 8)
            continue
        diff = row.get("max_abs_diff_vs_lv")
        table.add_row(
            name,
            f"{row['fwd_ms']:.1f}",
            f"{row['fwd_bwd_ms']:.1f}",
            f"{row['fwd_bytes_per_rank'] / 1e6:.2f}",
            f"{row['fwd_bwd_bytes_per_rank'] / 1e6:.2f}",
            f"{row['speedup_vs_ring_fwd']:.2f}x" if "speedup_vs_ring_fwd" in row else "",
            f"{row['speedup_vs_ring_fwd_bwd']:.2f}x" if "speedup_vs_ring_fwd_bwd" in row else "",
            f"{100 * row['overhead_vs_nocomm_fwd']:+.0f}%",
            f"{100 * row['overhead_vs_nocomm_fwd_bwd']:+.0f}%",
            "" if diff is None else f"{diff:.1e}",
        )
    Console(width=200).print(table)


def markdown_table(summary: dict) -> str:
    """The CPU summary as a Markdown table (for docs/benchmarks.md)."""
    head = (
        "| method | fwd ms | fwd+bwd ms | MB sent/rank fwd | MB sent/rank fwd+bwd "
        "| speedup vs ring fwd / fwd+bwd | overhead vs no-comm fwd / fwd+bwd |"
    )
    lines = [head, "|" + "---|" * 7]
    for name, row in summary.items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | | | | |")
            continue
        lines.append(
            f"| {name} | {row['fwd_ms']:.0f} | {row['fwd_bwd_ms']:.0f} | "
            f"{row['fwd_bytes_per_rank'] / 1e6:.2f} "
            f"| {row['fwd_bwd_bytes_per_rank'] / 1e6:.2f} "
            f"| {row.get('speedup_vs_ring_fwd', float('nan')):.2f}x / "
            f"{row.get('speedup_vs_ring_fwd_bwd', float('nan')):.2f}x "
            f"| {100 * row['overhead_vs_nocomm_fwd']:+.0f}% / "
            f"{100 * row['overhead_vs_nocomm_fwd_bwd']:+.0f}% |"
        )
    return "\n".join(lines)


def machine() -> dict:
    """The machine a result was measured on, for a benchmark's JSON."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def run_cpu(args) -> dict:
    cfg = {
        "ranks": args.ranks,
        "frames": args.frames,
        "keys_per_frame": args.keys_per_frame,
        "ratio": args.ratio,
        "batch": args.batch,
        "q_heads": args.q_heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "mask": not args.no_mask,
        "warmup": args.warmup,
        "iters": args.iters,
        "link_gbps": args.link_gbps,
        "link_latency_s": args.link_latency_us * 1e-6,
    }
    s_q, s_kv = shapes(cfg["frames"], cfg["keys_per_frame"], cfg["ratio"])
    if args.link_gbps:
        print(
            f"emulated link (an emulation): one NIC per rank and direction at {args.link_gbps:g} "
            f"GB/s, {args.link_latency_us:g} us per message"
        )
    print(
        f"{args.ranks} gloo ranks (1 thread each, {os.cpu_count()} CPUs); S_q={s_q}, S_kv={s_kv} "
        f"({cfg['frames']} frames × {cfg['keys_per_frame']}), heads "
        f"{cfg['q_heads']}/{cfg['kv_heads']}, "
        f"d={cfg['head_dim']}, {cfg['dtype']}, media mask {'on' if cfg['mask'] else 'off'}; "
        f"median of {cfg['iters']} after {cfg['warmup']} warm-up"
    )
    t0, load_before = time.perf_counter(), os.getloadavg()
    per_rank = run_ranks(_bench_rank, args.ranks, cfg, timeout_s=3600)
    summary = _summarise(per_rank)
    _print_table(summary, f"Cross-attention, {args.ranks} CPU ranks")
    if args.markdown:
        print(markdown_table(summary))
    print(f"total wall time {time.perf_counter() - t0:.0f} s")
    load = {"before": load_before, "after": per_rank[0]["loadavg"]}  # 1/5/15-minute load averages
    print(
        f"load average before {load_before[0]:.1f}, after {load['after'][0]:.1f} (other work on "
        "this machine)"
    )
    return {
        "config": cfg,
        "s_q": s_q,
        "s_kv": s_kv,
        "machine": machine(),
        "loadavg": load,
        "results": summary,
    }


# ------------------------------------------------------------------ CUDA kernels


def bench_kernels(
    device: str, s_q: int, s_kv: int, hq: int, hkv: int, d: int, dtype, iters: int, warmup: int
) -> dict:
    """Time attn_fwd / attn_bwd of every backend that can run one unmasked (fully visible) block;
    each row names the kernels that really ran (cuDNN's backward is "efficient") and any
    fallback."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, s_q, hq, d, device=dev, dtype=dtype, generator=g)
    k = torch.randn(1, s_kv, hkv, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(1, s_kv, hkv, d, device=dev, dtype=dtype, generator=g)
    dout = torch.randn_like(q)
    rows = {}
    for backend in available_backends(dev):
        if backend == "math" or not can_run(backend, q, False, d):
            rows[backend] = {
                "skipped": "materialises the score matrix" if backend == "math" else "cannot run"
            }
            continue
        rows[backend] = _bench_backend(backend, (q, k, v, dout), dev, iters, warmup)
    return rows


def _bench_backend(backend: str, qkvd: tuple, dev: torch.device, iters: int, warmup: int) -> dict:
    """One backend's forward and backward times, with the kernels each call site ran."""
    q, k, v, dout = qkvd
    flops_fwd = 4 * q.shape[1] * k.shape[1] * q.shape[2] * q.shape[3]
    with kernel_tally() as fwd_seen:
        out, lse = attn_fwd(q, k, v, backend=backend)
        fwd = _device_time(lambda: attn_fwd(q, k, v, backend=backend), dev, iters, warmup)
    with kernel_tally() as bwd_seen:
        bwd = _device_time(
            lambda: attn_bwd(dout, q, k, v, out, lse, backend=backend), dev, iters, warmup
        )
    return {
        "fwd_ms": 1e3 * fwd,
        "bwd_ms": 1e3 * bwd,
        "fwd_tflops": flops_fwd / fwd / 1e12,
        "bwd_tflops": 2.5 * flops_fwd / bwd / 1e12,  # flash-attn's convention: bwd = 2.5 x fwd
        "ran": {"attn_fwd": fwd_seen.ran("fwd"), "attn_bwd": bwd_seen.ran("bwd")},
        "fallbacks": {"attn_fwd": dict(fwd_seen.fallbacks), "attn_bwd": dict(bwd_seen.fallbacks)},
    }


def fallback_lines(rows: dict) -> list[str]:
    """Every fallback of the kernel rows, one line each: "backend site: what (n calls)"."""
    return [
        f"{name} {site}: {what} ({n} calls)"
        for name, row in rows.items()
        for site, seen in row.get("fallbacks", {}).items()
        for what, n in seen.items()
    ]


def _device_time(fn, dev: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(dev)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_kernels(args) -> dict:
    """The per-rank block kernel of every backend at one rank's share of the 7B problem."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda needs a CUDA GPU; run without --device for the CPU rank benchmark"
        )
    s_q, s_kv = shapes(args.cuda_frames, args.keys_per_frame, args.ratio)
    s_q, s_kv = -(-s_q // args.cuda_gpus), -(-s_kv // args.cuda_gpus)
    dtype = DTYPES[args.dtype if args.dtype != "float32" else "bfloat16"]
    name = torch.cuda.get_device_name() if args.device == "cuda" else machine()["processor"]
    print(
        f"{name}: one block per rank of {args.cuda_gpus}: S_q={s_q}, S_kv={s_kv}, "
        f"heads 28/4, d=128, {dtype}, no mask (a fully visible block)"
    )
    rows = bench_kernels(args.device, s_q, s_kv, 28, 4, 128, dtype, args.iters, args.warmup)
    _print_kernels(rows)
    fallbacks = fallback_lines(rows)
    for line in fallbacks:
        print(f"FALLBACK {line}")
    return {
        "s_q_block": s_q,
        "s_kv_shard": s_kv,
        "dtype": str(dtype),
        "machine": machine() | {"device": name},
        "results": rows,
        "fallbacks": fallbacks,
    }


def _print_kernels(rows: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Per-rank block kernel")
    for col in ("backend", "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s", "kernels that ran"):
        table.add_column(col, justify="left" if col in ("backend", "kernels that ran") else "right")
    for name, row in rows.items():
        if "skipped" in row:
            table.add_row(name, f"skipped: {row['skipped']}", "", "", "", "")
            continue
        ran = ", ".join(f"{site} {'/'.join(kernels)}" for site, kernels in row["ran"].items())
        fell = sum(n for seen in row["fallbacks"].values() for n in seen.values())
        table.add_row(
            name,
            f"{row['fwd_ms']:.2f}",
            f"{row['fwd_tflops']:.0f}",
            f"{row['bwd_ms']:.2f}",
            f"{row['bwd_tflops']:.0f}",
            ran + (f" ({fell} calls fell back)" if fell else ""),
        )
    Console(width=200).print(table)


# ------------------------------------------------------------------ the paper's regime, emulated


def _paper_rank(rank: int, world: int, cfg: dict) -> dict:
    """One paper row on this rank: the time of a ring round without communication (LV-XAttn's
    kernels and merges alone, the slowest rank's fastest iteration), then LV-XAttn, Ring and no
    communication over the emulated link of each efficiency."""
    scaled = scale(TABLE3[cfg["row"]], cfg["round_gflop"])
    bench = {
        **{k: cfg[k] for k in ("dtype", "warmup", "iters", "keys_per_frame")},
        "frames": 1,
        "ratio": 1.0,
        "batch": 1,
        "q_heads": scaled.q_heads,
        "kv_heads": scaled.kv_heads,
        "head_dim": scaled.head_dim,
        "mask": False,
        "s_q_kv": (world * scaled.rows, world * scaled.keys),
        "backward": True,
    }
    alone = _bench_rank_on_link(rank, world, {**bench, "paths": []})["results"]["no-comm"]
    cpu_round_s = min(alone["fwd_bwd_s"]) / world
    out = {"cpu_round_s": cpu_round_s, "by_efficiency": {}}
    for label, efficiency in cfg["efficiencies"].items():
        gbps, latency_s, tau = emulated_link_for(scaled, efficiency, cpu_round_s)
        with emulated_link(gbps, latency_s):
            result = _bench_rank_on_link(
                rank, world, {**bench, "paths": ["lv_xattn", "ring_xattn"]}
            )
        link = {"gbps": gbps, "latency_s": latency_s, "tau": tau, "efficiency": efficiency}
        out["by_efficiency"][label] = {"link": link, "per_rank": result}
    return out


def _paper_row(index: int, args, labels: list[str]) -> dict:
    """One Table 3 row emulated at every efficiency (a number, or "implied": the one the paper's
    own LV-XAttn time implies): our speed-ups next to the paper's. Times are each path's fastest
    iteration (the slowest rank's), the least disturbed by other work on a shared machine, as the
    time scale is."""
    row = TABLE3[index]
    efficiencies = {
        label: implied_efficiency(row) if label == "implied" else float(label) for label in labels
    }
    cfg = {
        "row": index,
        "round_gflop": args.paper_round_gflop,
        "dtype": args.dtype if args.dtype != "float32" else "bfloat16",
        "warmup": args.warmup,
        "iters": args.iters,
        "keys_per_frame": args.keys_per_frame,
        "efficiencies": efficiencies,
    }
    per_rank = run_ranks(_paper_rank, args.ranks, cfg, timeout_s=3600)
    scaled = scale(row, args.paper_round_gflop)
    ours = {}
    for eff in efficiencies:
        summary = _summarise([r["by_efficiency"][eff]["per_rank"] for r in per_rank])
        lv, ring, free = (
            min(summary[name]["fwd_bwd_ms_all"]) for name in ("lv_xattn", "ring_xattn", "no-comm")
        )
        ours[eff] = {
            "link": per_rank[0]["by_efficiency"][eff]["link"],
            "lv_ms": lv,
            "ring_ms": ring,
            "nocomm_ms": free,
            "speedup": ring / lv,
            "lv_over_nocomm": lv / free - 1,
            # the compute of this run over the time scale's: how far other work moved the ratio
            "compute_drift": free / (1e3 * per_rank[0]["cpu_round_s"] * args.ranks) - 1,
            "lv_mb_per_rank": summary["lv_xattn"]["fwd_bwd_bytes_per_rank"] / 1e6,
            "ring_mb_per_rank": summary["ring_xattn"]["fwd_bwd_bytes_per_rank"] / 1e6,
        }
    return {
        "paper": vars(row),
        "scaled": {k: v for k, v in vars(scaled).items() if k != "row"},
        "cpu_round_s": per_rank[0]["cpu_round_s"],
        "implied_efficiency": implied_efficiency(row),
        "ours": ours,
        "loadavg": os.getloadavg(),
    }


def run_paper(args) -> dict:
    """Table 3 of the LV-XAttn paper, row by row, emulated at scaled shapes (paper_emulation.py)."""
    main_eff = args.paper_efficiency
    sensitivity = [x for x in args.paper_sensitivity.split(",") if x]
    efficiencies = list(dict.fromkeys([main_eff, *sensitivity]))
    for label in efficiencies:
        if label != "implied" and not 0 < _number(label) <= 1:
            raise SystemExit(
                f"--paper-efficiency: {label!r} is not a fraction in (0, 1] or implied"
            )
    indices = (
        [int(x) - 1 for x in args.paper_table_rows.split(",")] if args.paper_table_rows else []
    )
    print(
        "An emulation of the paper's regime, not a reproduction: one cross-attention call, "
        f"forward and backward, bf16, no mask, on {args.ranks} CPU ranks over an emulated link "
        "(one NIC per rank and direction, NCCL's per-message latency), scaled per row to the 16 "
        f"A100s' transfer-to-compute ratio at kernel efficiency {main_eff} (sensitivity: "
        f"{', '.join(sensitivity)})"
    )
    rows = []
    for index in indices or range(len(TABLE3)):
        rows.append(_paper_row(index, args, efficiencies))
        _print_paper_row(rows[-1], main_eff)
    _print_paper(rows, main_eff, sensitivity)
    return {
        "efficiencies": efficiencies,
        "main_efficiency": main_eff,
        "rows": rows,
        "machine": machine(),
        "emulation": "emulated regime at scaled shapes, not a reproduction of the paper's runs",
    }


def _print_paper_row(r: dict, eff: str) -> None:
    p, o = r["paper"], r["ours"][eff]
    print(
        f"{p['model']} S_Q {p['s_q'] // 1024}K S_KV {p['s_kv'] // 1024}K: emulated LV "
        f"{o['lv_ms']:.0f} ms, Ring {o['ring_ms']:.0f} ms -> {o['speedup']:.2f}x "
        f"(paper {p['ca_speedup']:.2f}x); link {o['link']['gbps'] * 1e3:.1f} MB/s, "
        f"{o['link']['latency_s'] * 1e3:.2f} ms/message; compute {o['compute_drift']:+.0%} of the "
        f"time scale's; load {r['loadavg'][0]:.1f}",
        flush=True,
    )


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _print_paper(rows: list[dict], eff: str, efficiencies: list[str]) -> None:
    print(paper_markdown(rows, eff))
    for e in efficiencies:
        ratios = [r["ours"][e]["speedup"] for r in rows]
        print(
            f"sensitivity: at kernel efficiency {e} the emulated CA speed-up over Ring is "
            f"{min(ratios):.2f}-{max(ratios):.2f}x over these rows"
        )
    implied = [r["implied_efficiency"] for r in rows]
    print(
        "the paper's own LV-XAttn times are its kernel work at an efficiency of "
        f"{min(implied):.3f}-{max(implied):.3f} (no mask, forward + backward + recomputed forward)"
    )


def paper_markdown(rows: list[dict], eff: str) -> str:
    """Paper row next to the emulated one, Markdown."""
    lines = [
        "| model | S_Q | S_KV | paper: Ring / LV CA s | speed-up | emulated: Ring / LV ms | "
        "speed-up | LV vs no-comm | compute vs time scale |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        p, o = r["paper"], r["ours"][eff]
        lines.append(
            f"| {p['model']} | {p['s_q'] // 1024}K | {p['s_kv'] // 1024}K | "
            f"{p['ring_ca']:.1f} / {p['lv_ca']:.1f} | {p['ca_speedup']:.2f}× | "
            f"{o['ring_ms']:.0f} / {o['lv_ms']:.0f} | {o['speedup']:.2f}× | "
            f"{o['lv_over_nocomm']:+.0%} | {o['compute_drift']:+.0%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo ranks; cuda: kernel TFLOP/s",
    )
    p.add_argument("--ranks", type=int, default=4, help="CPU gloo ranks (default 4)")
    p.add_argument("--frames", type=int, default=48, help="video frames in total (CPU run)")
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
    p.add_argument("--no-mask", action="store_true", help="attend every query to every frame")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--kernels",
        action="store_true",
        help="time the per-rank block kernel of every backend on --device (the cuda default)",
    )
    p.add_argument(
        "--cuda-frames", type=int, default=3600, help="--kernels: frames (an hour at 1 fps)"
    )
    p.add_argument(
        "--cuda-gpus", type=int, default=8, help="--kernels: ranks the problem is split over"
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="emulate a link of this many GB/s for every schedule",
    )
    p.add_argument(
        "--link-latency-us",
        type=float,
        default=NCCL_NET_LATENCY_S * 1e6,
        help="with --link-gbps: each message's latency (default: NCCL's network ring step)",
    )
    p.add_argument(
        "--paper",
        action="store_true",
        help="the LV-XAttn paper's Table 3, row by row, emulated at scaled shapes (see above)",
    )
    p.add_argument(
        "--paper-efficiency",
        default="0.5",
        help="--paper: fraction of the A100's 312 bf16 TFLOP/s the paper's kernels are assumed to "
        "reach in the table, or implied (each row's, from the paper's LV-XAttn time)",
    )
    p.add_argument(
        "--paper-sensitivity",
        default="0.3,0.5,0.7",
        help="--paper: the efficiencies of the sensitivity line (comma list; implied allowed)",
    )
    p.add_argument(
        "--paper-table-rows",
        help="--paper: comma list of Table 3 rows (1-15) to emulate (default: all)",
    )
    p.add_argument(
        "--paper-round-gflop",
        type=float,
        default=3.0,
        help="--paper: GFLOP of one ring round's kernels per rank at the scaled shapes",
    )
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument(
        "--layout", help="comma list of contiguous,striped,zigzag: time LV-XAttn under each layout"
    )
    args = p.parse_args(argv)
    if args.layout:
        report = run_layouts(args)
    elif args.kernels or args.device == "cuda":
        report = run_kernels(args)
    else:
        report = run_paper(args) if args.paper else run_cpu(args)
    report["command"] = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
