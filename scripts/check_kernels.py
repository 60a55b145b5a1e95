#!/usr/bin/env python
"""Are the attention kernels right at mPLUG-Owl3-7B's shapes? Every backend's `attn_fwd` (flash,
cuDNN, efficient, math, flash-attn where installed; the CPU ones on a CPU) against float64: output
and log-sum-exp.

Shapes: 28 query / 4 K/V heads, head_dim 128, `--frames` frames of 729 keys (48: 34,992 keys),
`--rows` query rows; three calls each: every row sees every key, the media mask (row t sees a
growing prefix of frames, the first row none), and one decoded token. Tolerances: the output's
largest error within 2% of its largest value in bf16 (its rounding alone is up to 0.4%; 0.01% in
float32); the lse within 0.005 absolute, which a kernel whose lse is 1% off (or whose softmax sum
is) fails. A backend that hands a call to another kernel fails too: it was not the one checked. One
row per (backend, call), written as it is checked; exit 1 when any failed.

    python scripts/check_kernels.py --device cuda --out kernels_7b.json
    python scripts/check_kernels.py --device cpu --frames 2 --rows 32       # the CPU rehearsal
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

import torch

from lvx_app.attention import attn_fwd, available_backends
from lvx_app.attention.backends import can_run, kernel_tally
from scripts.harness import Rows, command_line, machine
from scripts.reference64 import errors, forward64
from scripts.xattn_problem import DTYPES, KEYS_PER_FRAME

HQ, HKV, D = 28, 4, 128
OUT_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
LSE_TOLERANCE = 5e-3  # absolute: log(1.01) is 0.00995, and a 1% error of an lse near 10 is 0.1


def problem(device: str, frames: int, rows: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """q, k, v at 7B head shapes, the media mask's q_vis / k_frame, and the calls to check."""
    g = torch.Generator().manual_seed(seed)
    keys = frames * KEYS_PER_FRAME
    q = torch.randn(1, rows, HQ, D, generator=g).to(device, dtype)
    k, v = (torch.randn(1, keys, HKV, D, generator=g).to(device, dtype) for _ in range(2))
    q_vis = (torch.arange(rows) * (frames + 1) // rows).view(1, rows).to(device)  # row 0 sees none
    k_frame = (torch.arange(keys) // KEYS_PER_FRAME).view(1, keys).to(device)
    calls = {
        "every key visible": (q, None, None),
        "media mask": (q, q_vis, k_frame),
        "decoded token": (q[:, -1:], None, None),
    }
    return {"k": k, "v": v, "calls": calls}


def check_call(backend: str, q, k, v, q_vis, k_frame, reference) -> dict:
    """One backend on one call: its errors against the float64 reference, and whether they pass."""
    with kernel_tally() as seen:
        out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, backend=backend)
    out_err, lse_err = errors(out, reference[0]), errors(lse, reference[1])
    ran = seen.ran("fwd")
    problems = [
        *(["NaN"] if out_err["nan"] or lse_err["nan"] else []),
        *([f"output off by {out_err['relative']:.2g} of its largest value"]
          if out_err["relative"] > OUT_TOLERANCE[q.dtype] else []),
        *([f"lse off by {lse_err['max_abs']:.2g}"] if lse_err["max_abs"] > LSE_TOLERANCE else []),
        *(["-inf lse where rows see keys, or not where they see none"]
          if not lse_err["same_inf"] else []),
        *([f"ran {'/'.join(ran) or 'nothing'} instead of {backend}"
           + "".join(f"; {f}" for f in seen.fallbacks)]
          if seen.fallbacks or ran != [backend] else []),
    ]  # fmt: skip
    return {
        "ok": not problems,
        "why": "; ".join(problems),
        "out_relative_error": out_err["relative"],
        "lse_max_abs_error": lse_err["max_abs"],
        "lse_max": lse_err["max_ref"],
        "ran": ran,
        "fallbacks": sorted(seen.fallbacks),
    }


def check(args, rows: Rows) -> bool:
    """Every backend on every call, each row saved as it is checked; True when all passed."""
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    p = problem(args.device, args.frames, args.rows, dtype)
    k, v = p["k"], p["v"]
    print(
        f"{args.device}: {HQ}/{HKV} heads, d {D}, {k.shape[1]:,} keys ({args.frames} frames x "
        f"{KEYS_PER_FRAME}), {args.rows} query rows, {dtype}"
    )
    ok = True
    for call, (q, q_vis, k_frame) in p["calls"].items():
        reference = forward64(q, k, v, D**-0.5, q_vis, k_frame)
        for backend in args.backends or available_backends(args.device):
            row = {"backend": backend, "call": call, "queries": q.shape[1], "keys": k.shape[1]}
            if not can_run(backend, q, q_vis is not None, D):
                rows.add(row | {"skipped": f"{backend} takes no such call (mask or dtype)"})
                continue
            result = check_call(backend, q, k, v, q_vis, k_frame, reference)
            ok &= result["ok"]
            rows.add(row | result)
            state = "ok" if result["ok"] else f"FAILED: {result['why']}"
            print(
                f"{backend:>10} {call:<18} out {result['out_relative_error']:.2e} of max, lse "
                f"{result['lse_max_abs_error']:.2e} (lse up to {result['lse_max']:.1f}): {state}",
                flush=True,
            )
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--frames", type=int, default=48, help="frames of 729 keys (48: 34,992 keys)")
    p.add_argument("--rows", type=int, default=256, help="query rows")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32")
    p.add_argument("--backends", nargs="+", help="default: every backend of the device")
    p.add_argument("--out", type=Path, help="write the rows as JSON here, each as it is checked")
    p.add_argument("--out-key", help="write them under this key of the JSON file (kept beside)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (--device cpu checks the CPU kernels)")
    rows = Rows(args.out, key=args.out_key, command=command_line(), machine=machine(args.device))
    ok = check(args, rows)
    rows.save(ok=ok, fallbacks=sorted({f for r in rows.rows for f in r.get("fallbacks", [])}))
    if not any("ok" in r for r in rows.rows):  # every backend declined every call
        rows.save(skipped="no backend took any call: nothing was checked")
    print("every kernel checked is within its tolerance" if ok else "some kernels FAILED (above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
