#!/usr/bin/env python
"""Which layout deals frames and their placeholder tokens to the ranks best: contiguous, striped or
zigzag (lvx_app/parallel/layout.py), on gloo CPU ranks, layouts interleaved in one run.

Default: LV-XAttn alone at bench_xattn.py's problem under each layout, with each round's busiest
rank's visible work against the mean, from the plan, at --ranks, 4 and 8 ranks, and each round's
kernel CPU time per rank. `--prefill`: the video-prompt prefill of the engine's sharded forward (its
hooks, small shapes, random weights and features) under each layout; the last token's logits are
compared with the contiguous layout's.

    python scripts/bench_layouts.py --ranks 2 --layout contiguous,striped,zigzag
    python scripts/bench_layouts.py --prefill --ranks 2 --minutes 10 --iters 3
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

from lvx_app.attention import attn_bwd, attn_fwd, lv_xattn
from lvx_app.defaults import LAYOUTS
from lvx_app.parallel.layout import balance, owned, owners, round_work, token_owners
from scripts.bench_xattn import add_problem_options
from scripts.gloo_ranks import run_ranks
from scripts.harness import command_line, machine, show, write_json
from scripts.random_model import random_model
from scripts.xattn_problem import DTYPES, TOKENS_PER_PLACEHOLDER, media_mask, shapes, timed_rounds

# ------------------------------------------------------------------ LV-XAttn under each layout


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


def _layout_cases(full, q_vis, k_frame, cfg: dict, rank: int, world: int) -> dict:
    """Forward and forward+backward of LV-XAttn on this rank's share under each layout."""
    b, cases = cfg["batch"], {}
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
    return cases


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
    cases = _layout_cases(full, q_vis, k_frame, cfg, rank, world)
    cpu = {layout: [] for layout in cfg["layouts"]}
    for _ in range(cfg["iters"]):
        for layout in cfg["layouts"]:
            cpu[layout].append(_round_cpu(full, q_vis, k_frame, cfg, layout, rank, world).tolist())
    times = timed_rounds(cases, cfg["warmup"], cfg["iters"])
    return {"times": times, "cpu": cpu, "loadavg": os.getloadavg()}


def _layout_row(cfg: dict, layout: str, measured: dict, worlds: list[int]) -> dict:
    row = {
        p[:-2] + "_ms": 1e3 * statistics.median(measured["times"][(layout, p)])
        for p in ("fwd_s", "fwd_bwd_s")
    }
    cpu = torch.tensor(measured["cpu"][layout]).median(0).values  # (rounds, ranks)
    row["cpu_busiest_ms"] = 1e3 * float(cpu.amax(1).sum())  # rounds on dedicated cores
    row["cpu_mean_ms"] = 1e3 * float(cpu.sum() / cpu.shape[1])
    for world in worlds:
        work = layout_work(cfg, layout, world).double()
        row[f"balance_{world}"] = balance(work)
        row[f"round_max_over_mean_{world}"] = (work.amax(1) / work.mean(1).clamp(min=1)).tolist()
    return row


def _print_layouts(rows: dict, ranks: int, worlds: list[int]) -> None:
    base = rows.get("contiguous")
    for layout, row in rows.items():
        speed = cpu_speed = ""
        if base is not None:
            speed = (
                f"  speed-up vs contiguous fwd {base['fwd_ms'] / row['fwd_ms']:.2f}x, "
                f"fwd+bwd {base['fwd_bwd_ms'] / row['fwd_bwd_ms']:.2f}x"
            )
            cpu_speed = f" ({base['cpu_busiest_ms'] / row['cpu_busiest_ms']:.2f}x vs contiguous)"
        bal = ", ".join(f"{w} ranks {row[f'balance_{w}']:.2f}" for w in worlds)
        per_round = ", ".join(f"{x:.2f}" for x in row[f"round_max_over_mean_{ranks}"])
        print(
            f"{layout:>10}: fwd {row['fwd_ms']:.0f} ms, fwd+bwd {row['fwd_bwd_ms']:.0f} ms{speed}\n"
            f"{'':>10}  fwd+bwd kernel CPU time, busiest rank per round summed: "
            f"{row['cpu_busiest_ms']:.0f} ms{cpu_speed}; balanced would be "
            f"{row['cpu_mean_ms']:.0f} ms\n"
            f"{'':>10}  busiest rank / mean, summed over rounds: {bal}\n"
            f"{'':>10}  per round at {ranks} ranks: {per_round}"
        )


def run_layouts(args) -> dict:
    """LV-XAttn with each layout, interleaved in one run, and the per-round work balance from the
    plan."""
    keys = ("frames", "keys_per_frame", "ratio", "batch", "q_heads", "kv_heads", "head_dim")
    cfg = {k: getattr(args, k) for k in (*keys, "dtype", "warmup", "iters")}
    cfg["layouts"] = args.layouts
    load_before = os.getloadavg()
    measured = run_ranks(_layout_rank, args.ranks, cfg, timeout_s=3600)[0]
    worlds = sorted({args.ranks, 4, 8})
    rows = {layout: _layout_row(cfg, layout, measured, worlds) for layout in cfg["layouts"]}
    print(
        f"LV-XAttn, {args.ranks} gloo ranks, media mask, {cfg['frames']} frames × "
        f"{cfg['keys_per_frame']}, {cfg['dtype']}; median of {cfg['iters']}; load average "
        f"{load_before[0]:.1f} -> {measured['loadavg'][0]:.1f}"
    )
    _print_layouts(rows, args.ranks, worlds)
    return {"config": cfg, "results": rows}


# ------------------------------------------------------------------ the engine's prefill


def _prefill_rank(rank: int, world: int, cfg: dict) -> dict:
    """Video-prompt prefill on this gloo rank for each layout (interleaved), with the engine's
    hooks."""
    from lvx_app.engine.parallelize import ShardedAttention

    model = random_model("small", torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    frames, header = cfg["frames"], 18
    starts = header + 5 * torch.arange(frames)
    ids = torch.randint(0, model.config.vocab_size, (int(starts[-1]) + 5,), generator=g)
    features = torch.randn(
        frames, model.config.vision.num_patches, model.config.hidden_size, generator=g
    )
    times, logits = {name: [] for name in cfg["layouts"]}, {}
    for _ in range(cfg["iters"]):
        for layout in cfg["layouts"]:
            mine = owned(frames, world, rank, layout)
            visual = model.prepare_visual(
                features[mine], starts, torch.tensor(mine, dtype=torch.int64)
            )
            who = token_owners(ids.numel(), starts, world, layout)
            tokens = torch.nonzero(who == rank).flatten()
            hooks = ShardedAttention(None, rank, world)
            sizes = torch.bincount(who, minlength=world).tolist()
            feed = hooks.sharded_feed(tokens.view(1, -1), sizes, torch.device("cpu"))
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(
                    ids[tokens].view(1, -1), tokens.view(1, -1), cache=model.new_cache(),
                    visual=visual, last_only=True, feed=feed, hooks=hooks,
                )  # fmt: skip
            times[layout].append(time.perf_counter() - t0)
            last = rank == int(who[-1])
            box = out[0, -1].clone() if last else torch.zeros(model.config.vocab_size)
            dist.all_reduce(box)
            logits[layout] = box.numpy()
    t = torch.tensor([times[name] for name in cfg["layouts"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a prefill lasts as long as its slowest rank
    return {"times": t.tolist(), "logits": logits, "prompt_tokens": int(ids.numel())}


def run_prefill(args) -> dict:
    """Video-prompt prefill of the engine's sharded forward at each layout (small shapes, random
    weights)."""
    frames = int(args.minutes * 60 * args.fps)
    cfg = {"layouts": args.layouts, "frames": frames, "iters": args.iters}
    out = run_ranks(_prefill_rank, args.ranks, cfg, timeout_s=3600)[0]
    base = out["logits"].get("contiguous", out["logits"][args.layouts[0]])
    rows = [
        {
            "layout": name,
            "ranks": args.ranks,
            "frames": frames,
            "prompt_tokens": out["prompt_tokens"],
            "prefill_s": statistics.median(t),
            "max_abs_logit_diff": float(abs(out["logits"][name] - base).max()),
        }
        for name, t in zip(args.layouts, out["times"])
    ]
    contiguous = next((r["prefill_s"] for r in rows if r["layout"] == "contiguous"), None)
    for row in rows:
        row["speedup_vs_contiguous"] = contiguous / row["prefill_s"] if contiguous else None
    show(
        f"video-prompt prefill per layout, small shapes, {args.minutes:g} min at {args.fps:g} "
        f"fps, {args.ranks} CPU ranks",
        rows,
    )
    return {"config": cfg, "rows": rows}


def _layouts(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    for name in names:
        if name not in LAYOUTS:
            raise argparse.ArgumentTypeError(
                f"unknown layout {name!r}; use a comma list of {', '.join(LAYOUTS)}"
            )
    return names


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add_problem_options(p, ranks=2)
    p.add_argument("--layout", "--layouts", dest="layouts", type=_layouts, default=list(LAYOUTS))
    p.add_argument("--prefill", action="store_true", help="the engine's video-prompt prefill")
    p.add_argument("--minutes", type=float, default=10.0, help="--prefill: video length")
    p.add_argument("--fps", type=float, default=1.0, help="--prefill: frames per second")
    args = p.parse_args(argv)
    report = run_prefill(args) if args.prefill else run_layouts(args)
    report |= {"machine": machine(), "command": command_line()}
    if args.out:
        print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
