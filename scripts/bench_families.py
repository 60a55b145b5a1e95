#!/usr/bin/env python
"""Every registered model family side by side, at the same video length on the same ranks: read
from the registry (`lvx_models.api.FAMILIES`), each at its first published release
(`Family.published`), so a family registered later appears with no edit here.

Per family:
- visual tokens per frame, and the video prompt's positions at `--minutes` of video at 1 fps;
- the cross-attention share of the video-prompt prefill and of one decoded token after it: the
  FLOPs of the attention to the frames (scores and values, 4 · query width · keys per row, the
  prompt's rows seeing a growing prefix of frames) over all the forward's FLOPs (every language
  model weight one multiply-add per token, the text attention, the attention to the frames), from
  the release's published sizes (projected, not measured);
- LV-XAttn against Ring Attention (pass-KV, un-repeated K/V): one cross-attention call, forward and
  backward, on `--ranks` CPU gloo ranks (`bench_xattn.rank_results`, interleaved iterations,
  slowest rank, median), the release's cross-layer heads, head size and visual tokens per frame,
  its prompt's positions per frame and media mask, `--frames` frames (the video scaled down for a
  CPU); optionally over an emulated link (`--link-gbps`, scripts/emulated_link.py);
- the LV-XAttn paper's Table 3 beside it where it evaluated the family (its speed-ups over Ring
  Attention, of the cross-attention and end to end, over its rows; 16 A100s).

    python scripts/bench_families.py --ranks 2 --frames 8 --markdown
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.engine.memory_plan import param_counts
from lvx_models.api import FAMILIES, Family, ModelConfig
from scripts.bench_xattn import bench_rank, summarise
from scripts.gloo_ranks import run_ranks
from scripts.harness import command_line, machine, markdown, show, write_json
from scripts.paper_emulation import TABLE3

QUESTION_TOKENS = 24


def prompt_positions(cfg: ModelConfig, frames: int) -> int:
    """The video prompt's positions for `frames` frames (its header and each frame's
    placeholder; visual tokens take none)."""
    return cfg.prompt_header_tokens + cfg.prompt_positions_per_frame * frames


def cross_shares(cfg: ModelConfig, frames: int) -> tuple[float, float]:
    """(the share of the video-prompt prefill's FLOPs, of one decoded token's) spent attending
    to the frames, at `frames` frames (projected from the sizes)."""
    counts = param_counts(cfg)
    weights = 2 * (counts.language - counts.embedding)  # FLOPs per token of the weights
    keys, rows = frames * cfg.visual_tokens_per_frame, prompt_positions(cfg, frames)
    cross = 4 * cfg.cross_attention_heads * cfg.cross_head_dim * len(cfg.cross_layer_indices)
    text = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.text_kv_layers
    prefill_cross = cross * keys * rows / 2  # row t sees the frames placed before it
    prefill = weights * rows + text * rows * rows / 2 + prefill_cross
    decode_cross = cross * keys
    decode = weights + text * (rows + QUESTION_TOKENS) + decode_cross
    return prefill_cross / prefill, decode_cross / decode


def paper_speedups(family: Family) -> tuple[str, str]:
    """The LV-XAttn paper's speed-ups over Ring Attention for the family (Table 3: of the
    cross-attention, end to end), as ranges over its rows; "–" where it has none."""
    rows = [r for r in TABLE3 if r.model.lower().startswith(family.title.lower())]
    if not rows:
        return "–", "–"

    def span(values: list[float]) -> str:
        return f"{min(values):.2f}–{max(values):.2f}×"

    return span([r.ca_speedup for r in rows]), span([r.total_speedup for r in rows])


def xattn_case(cfg: ModelConfig, args: argparse.Namespace) -> dict:
    """The cross-attention call of `--frames` frames of this release, as `bench_xattn` runs it."""
    frames = args.frames
    return {
        "dtype": args.dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "frames": frames,
        "keys_per_frame": cfg.visual_tokens_per_frame,
        "s_q_kv": (prompt_positions(cfg, frames), frames * cfg.visual_tokens_per_frame),
        "per": cfg.prompt_positions_per_frame,
        "header": cfg.prompt_header_tokens,
        "batch": 1,
        "q_heads": cfg.cross_attention_heads,
        "kv_heads": cfg.cross_kv_heads,
        "head_dim": cfg.cross_head_dim,
        "mask": True,
        "backward": True,
        "paths": ["lv_xattn", "ring_xattn"],
        "link_gbps": args.link_gbps,
    }


def family_row(family: Family, args: argparse.Namespace) -> dict:
    """One family's figures: the projected ones at `--minutes`, the measured call at `--frames`."""
    release, cfg = next(iter(family.published.items()))
    frames = round(args.minutes * 60)
    prefill, decode = cross_shares(cfg, frames)
    case = xattn_case(cfg, args)
    summary = summarise(run_ranks(bench_rank, args.ranks, case, timeout_s=3600))
    lv, ring = summary["lv_xattn"], summary["ring_xattn"]
    paper_ca, paper_total = paper_speedups(family)
    return {
        "family": family.title,
        "release": release,
        "visual tokens/frame": cfg.visual_tokens_per_frame,
        "prompt positions": prompt_positions(cfg, frames),
        "cross heads (q/kv × d)": f"{cfg.cross_attention_heads}/{cfg.cross_kv_heads} × "
        f"{cfg.cross_head_dim}",
        "cross share, prefill": prefill,
        "cross share, decoded token": decode,
        "CPU S_Q / S_KV": "{} / {}".format(*case["s_q_kv"]),
        "LV-XAttn fwd+bwd ms": lv["fwd_bwd_ms"],
        "Ring fwd+bwd ms": ring["fwd_bwd_ms"],
        "speed-up over Ring": ring["fwd_bwd_ms"] / lv["fwd_bwd_ms"],
        "MB sent/rank LV / Ring": f"{lv['fwd_bwd_bytes_per_rank'] / 1e6:.2f} / "
        f"{ring['fwd_bwd_bytes_per_rank'] / 1e6:.2f}",
        "paper: CA speed-up": paper_ca,
        "paper: end to end": paper_total,
        "max abs diff": ring["max_abs_diff_vs_lv"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2, help="CPU gloo ranks (default 2)")
    p.add_argument("--frames", type=int, default=8, help="frames of the measured call")
    p.add_argument("--minutes", type=float, default=60.0, help="video of the projected columns")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--link-gbps", type=float, default=None, help="emulate a link of this GB/s")
    p.add_argument("--families", nargs="+", help="only these family ids (default: every one)")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    chosen = [f for f in FAMILIES.values() if f.published]
    chosen = [f for f in chosen if not args.families or f.name in args.families]
    load_before, t0 = os.getloadavg(), time.perf_counter()
    rows = [family_row(f, args) for f in chosen]
    title = (
        f"Every family at {args.minutes:g} min at 1 fps (projected) and {args.frames} frames on "
        f"{args.ranks} CPU ranks (measured)"
    )
    show(title, rows)
    if args.markdown:
        print(markdown(rows))
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"wall {time.perf_counter() - t0:.0f} s; load average {load_before[0]:.1f} before, "
          f"{load['after'][0]:.1f} after")  # fmt: skip
    if args.out:
        run = {"command": command_line(), "machine": machine(), "load": load}
        write_json(args.out, run | {"args": vars(args) | {"out": str(args.out)}, "rows": rows})


if __name__ == "__main__":
    main()
