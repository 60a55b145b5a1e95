#!/usr/bin/env python
"""GQA without K/V copies, side by side in one run: today's kernel call vs query groups packed into
rows.

1. CPU time per `attn_fwd` call at mPLUG-Owl3-7B head shapes (28 query heads, 4 K/V heads, d 128,
   float32, one thread): one decoded token and a 24-token question against 50K and 200K visual keys.
   "today" is the call the CPU adapter made before packing (the aten CPU op with 28 query heads on 4
   K/V heads); "packed" is `attn_fwd`.
2. Bytes the CUDA path would allocate per kernel call at one hour of video at 1 fps on one GPU (3600
   frames x 729 keys, bf16), from the op shapes recorded while `attn_fwd` runs on CPU with
   shape-only stand-ins for the CUDA ops (no GPU needed): K/V copies, the additive bias and the bool
   mask. "today" repeats K/V to 28 heads for every call and masks a partly visible tile over its
   whole key span; the same plan gives its shapes.

    python scripts/bench_kernels.py                 # both parts
    python scripts/bench_kernels.py --keys 50000 --iters 2 --skip-memory
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_kernels import backends, masks
from lvx_kernels.kernels import attn_fwd
from scripts.harness import command_line, machine, markdown, median_seconds, write_json
from scripts.xattn_problem import KEYS_PER_FRAME, TOKENS_PER_PLACEHOLDER

HQ, HKV, D = 28, 4, 128
GIB = 2**30


# ------------------------------------------------------------------ 1. CPU time per call


def _ms(fn, iters: int) -> float:
    """The median of `iters` calls after one warm-up, in milliseconds."""
    return 1e3 * median_seconds(fn, iters, warmup=1)


def cpu_times(keys: list[int], queries: list[int], iters: int) -> list[dict]:
    """Median ms per call, today's unpacked CPU-op call vs packed `attn_fwd`, every (queries, keys)
    pair."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for sk in keys:
        k, v = (torch.randn(1, sk, HKV, D, generator=g) for _ in range(2))
        for sq in queries:
            q = torch.randn(1, sq, HQ, D, generator=g)
            scale = D**-0.5
            today = _ms(lambda: backends._cpu_fwd(q, k, v, scale, None, False), iters)
            packed = _ms(lambda: attn_fwd(q, k, v, scale=scale, backend="cpu"), iters)
            rows.append(
                {
                    "queries": sq,
                    "keys": sk,
                    "today_ms": today,
                    "packed_ms": packed,
                    "speedup": today / packed,
                }
            )
    return rows


# ------------------------------------------------------------------ 2. CUDA bytes per call, from
# recorded op shapes


def _shape_only_ops(calls: list) -> dict:
    """Stand-ins for the aten CUDA ops that record (op, q, k, bias) and return empty outputs of the
    real shapes."""

    def efficient_fwd(q, k, v, bias, *a, **kw):
        calls.append(("efficient_fwd", q, k, bias))
        b, h, sq, d = q.shape
        return q.new_empty(b, h, sq, d), torch.empty(b, h, -(-sq // 32) * 32), None, None

    def flash_fwd(q, k, v, *a, **kw):
        calls.append(("flash_fwd", q, k, None))
        b, h, sq, d = q.shape
        return q.new_empty(b, h, sq, d), torch.empty(b, h, sq)

    return {"efficient_fwd": efficient_fwd, "flash_fwd": flash_fwd}


def one_hour_problem(frames: int, question: int):
    """The video prompt of `frames` placeholders (5 tokens each, frame j's placeholder sees frames
    0..j) and a question."""
    t = torch.arange(frames * TOKENS_PER_PLACEHOLDER)
    prompt_vis = (t // TOKENS_PER_PLACEHOLDER + 1).unsqueeze(0)
    k_frame = (torch.arange(frames * KEYS_PER_FRAME) // KEYS_PER_FRAME).unsqueeze(0)
    return prompt_vis, torch.full((1, question), frames), k_frame


def _today_bytes(parts: list, g: int) -> list[dict]:
    """Per tile, what today's adapter allocated: K/V repeated to Hq over the tile's whole key span,
    and a dense bf16 bias (rows padded to 16) plus bool mask over it when some part of the tile was
    masked."""
    tiles = defaultdict(list)
    for p in parts:
        tiles[(p["q0"] // g, -(-p["q1"] // g))].append(p)
    out = []
    for (t0, t1), ps in tiles.items():
        span = max(p["k1"] for p in ps) - min(p["k0"] for p in ps)
        masked = any(p["mask"] for p in ps)
        mask_elems = (t1 - t0) * span if masked else 0
        out.append(
            {
                "kv_copy": 2 * span * HQ * D * 2,
                "mask": mask_elems * 1 + (t1 - t0) * (-(-span // 16) * 16) * 2 * masked,
                "mask_shape": (t1 - t0, span) if masked else None,
            }
        )
    return out


def cuda_bytes(frames: int, question: int) -> list[dict]:
    """Largest per-call allocation (K/V copies + bias + bool mask) today vs packed, for three calls
    at 1 GPU."""
    calls: list = []
    saved = dict(backends.KERNEL_OPS), backends._on_cuda, backends._flash_attn
    backends.KERNEL_OPS.update(_shape_only_ops(calls))
    backends._on_cuda = lambda q: True
    backends._flash_attn = lambda: None  # aten flash / efficient, as on a GPU without flash-attn
    prompt_vis, question_vis, k_frame = one_hour_problem(frames, question)
    sk = k_frame.shape[1]
    # no memory: only shapes and strides matter
    k = torch.zeros((), dtype=torch.bfloat16).expand(1, sk, HKV, D)
    results = []
    try:
        for name, sq, q_vis in (
            ("decode token", 1, None),
            (f"{question}-token question", question, None),
            ("video prompt (media mask)", prompt_vis.shape[1], prompt_vis),
        ):
            calls.clear()
            q = torch.zeros(1, sq, HQ, D, dtype=torch.bfloat16)
            attn_fwd(q, k, k, q_vis=q_vis, k_frame=None if q_vis is None else k_frame)
            after = [_call_bytes(c) for c in calls]
            whole = [{"q0": 0, "q1": sq * HQ // HKV, "k0": 0, "k1": sk, "mask": False}]
            today = _today_bytes(
                whole if q_vis is None else _plan_parts(q, sk, q_vis, k_frame), HQ // HKV
            )
            results.append(
                {
                    "call": name,
                    "queries": sq,
                    "keys": sk,
                    "kernel_calls": len(calls),
                    "today_max": max(t["kv_copy"] + t["mask"] for t in today),
                    "today_mask": _largest(t["mask_shape"] for t in today),
                    "after_max": max(a["bytes"] for a in after),
                    "after_mask": _largest(a["mask_shape"] for a in after),
                    "after_kv_heads": max(a["kv_heads"] for a in after),
                    "packed_q": q.numel() * 2,
                }
            )
    finally:
        backends.KERNEL_OPS.update(saved[0])
        backends._on_cuda, backends._flash_attn = saved[1], saved[2]
    return results


def _largest(shapes) -> tuple | None:
    """The (rows, keys) mask shape with the most elements, or None when no call had a mask."""
    return max((sh for sh in shapes if sh), default=None, key=lambda sh: sh[0] * sh[1])


def _plan_parts(q, sk, q_vis, k_frame) -> list[dict]:
    g = HQ // HKV
    qp = torch.zeros((), dtype=q.dtype).expand(1, q.shape[1] * g, HKV, D)
    return [
        {"q0": p.q0, "q1": p.q1, "k0": p.k0, "k1": p.k1, "mask": p.mask is not None}
        for p in masks.tile_plans(
            qp,
            k_frame.new_empty(1, sk, 1, 1).expand(1, sk, HKV, D),
            False,
            q_vis.repeat_interleave(g, 1),
            k_frame,
            group=g,
        )
    ]


def _call_bytes(call) -> dict:
    """Fresh bytes one recorded op call needed: K/V with more than Hkv heads are copies; the bias
    and its bool mask."""
    _, q, k, bias = call
    kv = 2 * k.numel() * k.element_size() if k.shape[1] > HKV else 0
    mask = 0 if bias is None else bias.untyped_storage().nbytes() + bias.shape[-2] * bias.shape[-1]
    return {
        "bytes": kv + mask,
        "kv_heads": k.shape[1],
        "mask_shape": None if bias is None else tuple(bias.shape[-2:]),
    }


# ------------------------------------------------------------------ output


def _fmt_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def _shown(rows: list[dict], formats: dict) -> list[dict]:
    """Rows with their figures written as the tables show them."""
    return [{name: fmt(r) for name, fmt in formats.items()} for r in rows]


CPU_TABLE = {
    "queries": lambda r: r["queries"],
    "keys": lambda r: f"{r['keys']:,}",
    "today (ms)": lambda r: f"{r['today_ms']:.0f}",
    "packed (ms)": lambda r: f"{r['packed_ms']:.0f}",
    "speed-up": lambda r: f"{r['speedup']:.1f}x",
}
CUDA_TABLE = {
    "call": lambda r: r["call"],
    "queries": lambda r: f"{r['queries']:,}",
    "keys": lambda r: f"{r['keys']:,}",
    "kernel calls": lambda r: r["kernel_calls"],
    "today": lambda r: _fmt_bytes(r["today_max"]),
    "packed": lambda r: _fmt_bytes(r["after_max"]),
    "largest mask today": lambda r: r["today_mask"] or "-",
    "largest mask packed": lambda r: r["after_mask"] or "-",
    "K/V heads at ops": lambda r: r["after_kv_heads"],
    "packed q copy (once per attn_fwd)": lambda r: _fmt_bytes(r["packed_q"]),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--keys", type=int, nargs="+", default=[50_000, 200_000], help="keys for the CPU timings"
    )
    p.add_argument(
        "--queries", type=int, nargs="+", default=[1, 24], help="query tokens (1 = a decoded token)"
    )
    p.add_argument(
        "--iters", type=int, default=3, help="timed calls per case (median), after one warm-up"
    )
    p.add_argument(
        "--frames", type=int, default=3600, help="frames for the CUDA bytes (an hour at 1 fps)"
    )
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    report = {"command": command_line(), "machine": machine()}
    if not args.skip_time:
        report["cpu"] = cpu_times(args.keys, args.queries, args.iters)
        head = f"CPU, float32, one thread, {HQ} q / {HKV} kv heads, d {D}: ms per attn_fwd call"
        print(f"{head} (median of {args.iters})\n{markdown(_shown(report['cpu'], CPU_TABLE))}")
    if not args.skip_memory:
        report["cuda_bytes"] = cuda_bytes(args.frames, 24)
        print(f"\nCUDA path, bf16, {args.frames} frames on one GPU: largest allocation per kernel "
              f"call (K/V copies + bias + bool mask)\n"
              f"{markdown(_shown(report['cuda_bytes'], CUDA_TABLE))}")  # fmt: skip
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
