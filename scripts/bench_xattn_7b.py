#!/usr/bin/env python
"""LV-XAttn's per-rank block at mPLUG-Owl3-7B's shapes, forward and backward, on one device: how
fast each backend runs it (TFLOP/s) and whether its values are right.

The block is one rank's share of an hour of video at 1 fps over 8 GPUs (28 query heads, 4 K/V
heads, d 128, bf16 on a GPU: 2,263 query rows against a 328,050-key shard), every key visible.
Per backend: median forward and backward times, the kernels each call site really ran (cuDNN's
backward is the memory-efficient kernel's) and every fallback; then its output and lse against a
float64 forward of every row, dq of a sample of rows and dk, dv of a sample of keys against float64
gradients (scripts/reference64.py; the output also by its RMS error, queries drawn for a peaked
softmax, `check_kernels.py`'s bounds). Each backend's row is written as it is measured; one
that raises (a device fault) is that row's failure, and the risky backends run last
(`available_backends`). A backend the engine never picks (cuDNN) cannot fail the run.

    python scripts/bench_xattn_7b.py --device cuda --out xattn_7b.json
    python scripts/bench_xattn_7b.py --device cpu --frames 16 --iters 1      # the CPU rehearsal
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

import torch

from lvx_app.attention import attn_bwd, attn_fwd, available_backends
from lvx_kernels.backends import can_run, kernel_tally
from scripts.check_kernels import ENGINE_PICKS
from scripts.harness import Rows, command_line, machine, median_seconds, show
from scripts.reference64 import (
    LSE_TOLERANCE,
    OUT_MAX_TOLERANCE,
    OUT_RMS_TOLERANCE,
    PEAK,
    errors,
    forward64,
    grads64,
)
from scripts.xattn_problem import DTYPES, KEYS_PER_FRAME, shapes

HQ, HKV, D = 28, 4, 128
SAMPLE = 64  # query rows (dq) and keys (dk, dv) checked in float64


def block(device: str, s_q: int, s_kv: int, dtype: torch.dtype) -> dict:
    """The block's tensors, the float64 reference and the rows and keys its gradients sample."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    q = (PEAK * torch.randn(1, s_q, HQ, D, device=dev, generator=g)).to(dtype)  # peaked softmax
    k, v = (torch.randn(1, s_kv, HKV, D, device=dev, dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, device=dev, dtype=dtype, generator=g)
    rows = torch.linspace(0, s_q - 1, min(SAMPLE, s_q), device=dev).long()
    keys = torch.linspace(0, s_kv - 1, min(SAMPLE, s_kv), device=dev).long()
    out64, lse64 = forward64(q, k, v, D**-0.5)
    grads = grads64(dout, q, k, v, out64, lse64, D**-0.5, rows, keys)
    return {"qkvd": (q, k, v, dout), "rows": rows, "keys": keys, "ref": (out64, lse64, *grads)}


def _checked(b: dict, out, lse, dq, dk, dv) -> dict:
    """Errors of one backend's results against the float64 reference, and what is off."""
    got = (out, lse, dq[:, b["rows"]], dk[:, b["keys"]], dv[:, b["keys"]])
    names = ("out", "lse", "dq", "dk", "dv")
    found = {n: errors(x, ref) for n, x, ref in zip(names, got, b["ref"])}
    tol = OUT_MAX_TOLERANCE[out.dtype]
    off = [
        f"{n} off by {e['relative']:.2g} of its largest value"
        for n, e in found.items()
        if n != "lse" and (e["relative"] > tol or e["nan"])
    ]
    if found["out"]["rms_relative"] > OUT_RMS_TOLERANCE[out.dtype]:
        off.insert(0, f"out off by {found['out']['rms_relative']:.2g} of its RMS")
    if found["lse"]["max_abs"] > LSE_TOLERANCE or found["lse"]["nan"]:
        off.append(f"lse off by {found['lse']['max_abs']:.2g}")
    errs = {f"{n}_error": e["max_abs"] if n == "lse" else e["relative"] for n, e in found.items()}
    errs["out_rms_relative_error"] = found["out"]["rms_relative"]
    return {"values_ok": not off, "values_off": "; ".join(off), **errs}


def bench_backend(backend: str, b: dict, iters: int, warmup: int) -> dict:
    """One backend's forward and backward times and TFLOP/s, the kernels each call site ran, and
    its values checked."""
    q, k, v, dout = b["qkvd"]
    dev = q.device
    flops_fwd = 4 * q.shape[1] * k.shape[1] * q.shape[2] * q.shape[3]
    with kernel_tally() as fwd_seen:
        out, lse = attn_fwd(q, k, v, backend=backend)
        fwd = median_seconds(lambda: attn_fwd(q, k, v, backend=backend), iters, warmup, dev)
    with kernel_tally() as bwd_seen:
        dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, backend=backend)

        def backward():
            return attn_bwd(dout, q, k, v, out, lse, backend=backend)

        bwd = median_seconds(backward, iters, warmup, dev)
    return {
        "fwd_ms": 1e3 * fwd,
        "bwd_ms": 1e3 * bwd,
        "fwd_tflops": flops_fwd / fwd / 1e12,
        "bwd_tflops": 2.5 * flops_fwd / bwd / 1e12,  # flash-attn's convention: bwd = 2.5 x fwd
        "ran": {"attn_fwd": fwd_seen.ran("fwd"), "attn_bwd": bwd_seen.ran("bwd")},
        "fallbacks": [
            f"{backend} {site}: {what} ({n} calls)"
            for site, seen in (("attn_fwd", fwd_seen), ("attn_bwd", bwd_seen))
            for what, n in seen.fallbacks.items()
        ],
        **_checked(b, out, lse, dq, dk, dv),
    }


def guarded_bench(backend: str, b: dict, iters: int, warmup: int) -> dict:
    """`bench_backend`, with anything it raises (a device fault, an op that crashed) as this row's
    failure: the backends after it still run (the risky ones run last, `available_backends`)."""
    try:
        return bench_backend(backend, b, iters, warmup)
    except Exception as exc:  # noqa: BLE001 - one backend's fault is that row's failure
        why = (str(exc).strip().splitlines() or [""])[0][:200]
        return {"values_ok": False, "error": f"raised {type(exc).__name__}: {why}",
                "fallbacks": []}  # fmt: skip


def run(args, rows: Rows) -> bool:
    """Every backend that can run the block, each row saved as it is measured; True when every
    backend the engine picks (`ENGINE_PICKS`) gave the right values; another's failure (cuDNN's)
    is reported in its row."""
    s_q, s_kv = shapes(args.frames, KEYS_PER_FRAME, args.ratio)
    s_q, s_kv = -(-s_q // args.gpus), -(-s_kv // args.gpus)
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    print(
        f"{rows.extra['machine'].get('device', args.device)}: one block per rank of {args.gpus}: "
        f"S_q={s_q}, S_kv={s_kv}, heads {HQ}/{HKV}, d={D}, {dtype}, every key visible"
    )
    b = block(args.device, s_q, s_kv, dtype)
    rows.save(s_q_block=s_q, s_kv_shard=s_kv, dtype=str(dtype))
    ok = True
    for backend in available_backends(args.device):
        if backend == "math" or not can_run(backend, b["qkvd"][0], False, D):
            why = "materialises the score matrix" if backend == "math" else "cannot run"
            rows.add({"backend": backend, "skipped": why})
            continue
        row = rows.add({"backend": backend, **guarded_bench(backend, b, args.iters, args.warmup)})
        row["counts"] = backend in ENGINE_PICKS
        ok &= row["values_ok"] or not row["counts"]
        rows.save(fallbacks=[f for r in rows.rows for f in r.get("fallbacks", [])], ok=ok)
        if "error" in row:
            print(f"{backend}: FAILED: {row['error']}", flush=True)
            continue
        print(
            f"{backend}: fwd {row['fwd_ms']:.2f} ms ({row['fwd_tflops']:.0f} TFLOP/s), bwd "
            f"{row['bwd_ms']:.2f} ms ({row['bwd_tflops']:.0f} TFLOP/s); values "
            + ("ok" if row["values_ok"] else f"WRONG: {row['values_off']}"),
            flush=True,
        )
    keys = ("backend", "fwd_ms", "fwd_tflops", "bwd_ms", "bwd_tflops", "values_ok", "skipped")
    show("LV-XAttn's per-rank block", rows.rows, keys)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--frames", type=int, default=3600, help="frames in all (an hour at 1 fps)")
    p.add_argument("--gpus", type=int, default=8, help="ranks the problem is split over")
    p.add_argument("--ratio", type=float, default=145.0, help="S_KV / S_Q (Video-MME: ~145)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the rows as JSON here, each as it is measured")
    p.add_argument("--out-key", help="write them under this key of the JSON file (kept beside)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (--device cpu times the CPU kernels)")
    rows = Rows(args.out, args.out_key, command=command_line(), machine=machine(args.device))
    rows.save(fallbacks=[])
    ok = run(args, rows)
    if not any("values_ok" in r for r in rows.rows):  # every backend declined the block
        rows.save(skipped="no backend took the block: nothing was measured")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
