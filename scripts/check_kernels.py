#!/usr/bin/env python
"""Are the attention kernels right at mPLUG-Owl3-7B's shapes, on every path the engine runs?
Each call against float64 (output and log-sum-exp), once with the backend the engine picks on its
own (`auto`) and once forced onto every backend of the device (flash, cuDNN, efficient, math,
flash-attn where installed; the CPU ones on a CPU).

Shapes: 28 query / 4 K/V heads, head_dim 128, `--frames` frames of 729 keys (48: 34,992 keys),
`--rows` query rows, `--prefix` cached text tokens. The calls, each a path of the engine:
- every key visible: a question's rows against a visual shard all of whose frames they see;
- media mask: row t sees a growing prefix of frames, the first row none (the video prompt);
- decoded token: one row against every key (a decoded token's cross-attention, `_one_token_fwd`);
- bounded decode: the static step's text attention (`attn_fwd_upto`): two batch rows, each one
  token against a buffer twice as long as its `used` keys, large values past `used` (a kernel that
  reads them is far off; two rows check the lse layout of the variable-length kernel);
- causal prefill over a cached prefix: batch 1, `--rows` new tokens after `--prefix` cached ones,
  grouped K/V (the causal square's K/V go in broadcast with stride 0).
Queries are `PEAK` times a unit Gaussian, so the softmax is peaked. A call fails when its output's
RMS error is over `OUT_RMS_TOLERANCE` of the reference's RMS (bf16 4e-3: its kernels' error is
about 2e-3; weights 1% off give 6.7e-3 to 1e-2), its largest error over `OUT_MAX_TOLERANCE` of
the largest value, its lse more than 0.005 off (a 1% error of the softmax sum is 0.00995), or when
the call was handed to another kernel (it was not the one checked). The calls that merge several
kernel calls' parts (`MERGED_CALLS`) run in float32 too, whose tight bounds see one part's weight
or output 1% off, which a bf16 kernel's rounding hides. A backend the engine never picks on its
own (cuDNN: only `--attn-backend cudnn` runs it) is checked and reported but cannot fail the
check; its rows run last (`RISKY_BACKENDS`: a device fault there poisons the process for what
follows), and a row that raises is that row's failure. Before the rows, the aten ops lvx calls are
checked against this torch (`op_signatures`): a mismatch fails the check.
One row per (call, backend, dtype), written as it is checked; exit 1 when any that counts failed.

    python scripts/check_kernels.py --device cuda --out kernels_7b.json
    python scripts/check_kernels.py --device cpu --frames 2 --rows 32 --prefix 256   # rehearsal
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

import torch

from lvx_app.attention import attn_fwd, available_backends
from lvx_kernels.backends import RISKY_BACKENDS, bounds_keys, can_run, kernel_tally
from lvx_kernels.kernels import attn_fwd_upto
from scripts.harness import Rows, command_line, machine
from scripts.op_signatures import mismatches
from scripts.reference64 import (
    LSE_TOLERANCE,
    OUT_MAX_TOLERANCE,
    OUT_RMS_TOLERANCE,
    PEAK,
    errors,
    forward64,
)
from scripts.xattn_problem import DTYPES, KEYS_PER_FRAME

HQ, HKV, D = 28, 4, 128
SCALE = D**-0.5
AUTO = "auto"  # the row of the backend the engine picks on its own
# the backends `choose_backend` picks with no --attn-backend; any other is reported, never failing
ENGINE_PICKS = ("flash_attn", "flash", "efficient", "cpu", "math")
# the calls whose result merges several kernel calls' parts: checked in float32 too, whose kernels
# are exact enough that a part's weight or lse 1% off shows (`TIGHT_LSE_TOLERANCE`, the float32
# output bounds)
CALLS = ("every key visible", "media mask", "decoded token", "bounded decode",
         "causal prefill over a cached prefix")  # fmt: skip
MERGED_CALLS = ("media mask", "causal prefill over a cached prefix")
TIGHT_LSE_TOLERANCE = 2e-4
GARBAGE = 100.0  # what the bounded decode's buffer holds past `used` (scores of thousands if read)


@dataclass
class Call:
    """One engine path: how to run it on a backend, its float64 reference, whether it is masked."""

    run: Callable[[str | None], tuple[torch.Tensor, torch.Tensor]]
    reference: tuple[torch.Tensor, torch.Tensor]
    masked: bool
    queries: int
    keys: int
    bounded: bool = False  # runs through `attn_fwd_upto` (its key count bounds a flash kernel)


def _randn(g, *shape, device, dtype, times: float = 1.0) -> torch.Tensor:
    return (times * torch.randn(*shape, generator=g)).to(device, dtype)


def _bounded_decode(g, keys: int, device, dtype) -> Call:
    """Two batch rows, one token each, against buffers of 2x `keys`: row 0 uses all `keys`, row 1
    half of them; past `used` the buffer holds large values."""
    used = torch.tensor([keys, keys // 2], dtype=torch.int32)
    q = _randn(g, 2, 1, HQ, D, device=device, dtype=dtype, times=PEAK)
    k, v = (_randn(g, 2, 2 * keys, HKV, D, device=device, dtype=dtype) for _ in range(2))
    for t in (k, v):
        for b, n in enumerate(used.tolist()):
            t[b, n:] = GARBAGE
    refs = [forward64(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], SCALE)
            for b, n in enumerate(used.tolist())]  # fmt: skip
    reference = tuple(torch.cat(parts, 0) for parts in zip(*refs))
    used = used.to(device)
    return Call(
        lambda be: attn_fwd_upto(q, k, v, used, backend=be),
        reference,  # type: ignore[arg-type]
        masked=not bounds_keys(q, D),
        queries=1,
        keys=2 * keys,
        bounded=True,
    )


def _causal_prefill(g, rows: int, prefix: int, device, dtype) -> Call:
    """Batch 1: `rows` new tokens after `prefix` cached ones, causal bottom-right (as the text
    self-attention of a prefill over the text cache)."""
    q = _randn(g, 1, rows, HQ, D, device=device, dtype=dtype, times=PEAK)
    k, v = (_randn(g, 1, prefix + rows, HKV, D, device=device, dtype=dtype) for _ in range(2))
    # causal as a mask the reference understands: key j is "frame" j, row i sees prefix + i + 1
    sees = (prefix + torch.arange(rows) + 1).view(1, rows).to(device)
    own = torch.arange(prefix + rows).view(1, -1).to(device)
    return Call(
        lambda be: attn_fwd(q, k, v, causal=True, backend=be),
        forward64(q, k, v, SCALE, sees, own),
        masked=False,
        queries=rows,
        keys=prefix + rows,
    )


def problem(device: str, frames: int, rows: int, dtype: torch.dtype, prefix: int = 4096,
            seed: int = 0) -> dict[str, Call]:  # fmt: skip
    """Every engine path at 7B head shapes, with its float64 reference."""
    g = torch.Generator().manual_seed(seed)
    keys = frames * KEYS_PER_FRAME
    q = _randn(g, 1, rows, HQ, D, device=device, dtype=dtype, times=PEAK)
    k, v = (_randn(g, 1, keys, HKV, D, device=device, dtype=dtype) for _ in range(2))
    q_vis = (torch.arange(rows) * (frames + 1) // rows).view(1, rows).to(device)  # row 0 sees none
    k_frame = (torch.arange(keys) // KEYS_PER_FRAME).view(1, keys).to(device)
    token = q[:, -1:]

    def plain(qx, mask):
        qv, kf = mask or (None, None)
        return Call(
            lambda be: attn_fwd(qx, k, v, q_vis=qv, k_frame=kf, backend=be),
            forward64(qx, k, v, SCALE, qv, kf),
            masked=mask is not None,
            queries=qx.shape[1],
            keys=keys,
        )

    return {
        "every key visible": plain(q, None),
        "media mask": plain(q, (q_vis, k_frame)),
        "decoded token": plain(token, None),
        "bounded decode": _bounded_decode(g, keys, device, dtype),
        "causal prefill over a cached prefix": _causal_prefill(g, rows, prefix, device, dtype),
    }


def _ran_other(backend: str, call: Call, ran: list[str]) -> bool:
    """Whether a forced call ran on a kernel other than its backend's (a bounded decode forced onto
    flash runs flash's variable-length form)."""
    if backend == AUTO:
        return False
    return ran != [backend] and not (call.bounded and ran == ["flash_varlen"])


def check_call(backend: str, call: Call, dtype: torch.dtype) -> dict:
    """One backend (or `AUTO`) on one call: its errors against float64, and whether they pass."""
    with kernel_tally() as seen:
        out, lse = call.run(None if backend == AUTO else backend)
    out_err, lse_err = errors(out, call.reference[0]), errors(lse, call.reference[1])
    lse_tolerance = TIGHT_LSE_TOLERANCE if dtype == torch.float32 else LSE_TOLERANCE
    ran = seen.ran("fwd")
    problems = [
        *(["NaN"] if out_err["nan"] or lse_err["nan"] else []),
        *([f"output off by {out_err['rms_relative']:.2g} of its RMS"]
          if out_err["rms_relative"] > OUT_RMS_TOLERANCE[dtype] else []),
        *([f"output off by {out_err['relative']:.2g} of its largest value"]
          if out_err["relative"] > OUT_MAX_TOLERANCE[dtype] else []),
        *([f"lse off by {lse_err['max_abs']:.2g}"] if lse_err["max_abs"] > lse_tolerance else []),
        *(["-inf lse where rows see keys, or not where they see none"]
          if not lse_err["same_inf"] else []),
        *([f"ran {'/'.join(ran) or 'nothing'}"
           + ("" if backend == AUTO else f" instead of {backend}")
           + "".join(f"; {f}" for f in seen.fallbacks)]
          if seen.fallbacks or _ran_other(backend, call, ran) else []),
    ]  # fmt: skip
    return {
        "ok": not problems,
        "why": "; ".join(problems),
        "out_rms_relative_error": out_err["rms_relative"],
        "out_relative_error": out_err["relative"],
        "lse_max_abs_error": lse_err["max_abs"],
        "lse_max": lse_err["max_ref"],
        "ran": ran,
        "fallbacks": sorted(seen.fallbacks),
    }


def guarded_check(backend: str, call: Call, dtype: torch.dtype) -> dict:
    """`check_call`, with anything the call raises (a device fault, an op that crashed) as this
    row's failure: the rows after it still run."""
    try:
        return check_call(backend, call, dtype)
    except Exception as exc:  # noqa: BLE001 - one row's fault is that row's failure
        why = (str(exc).strip().splitlines() or [""])[0][:200]
        return {"ok": False, "why": f"raised {type(exc).__name__}: {why}", "ran": [],
                "fallbacks": []}  # fmt: skip


def _print(row: dict) -> None:
    if "skipped" in row:
        return
    state = "ok" if row["ok"] else f"FAILED: {row['why']}"
    if not row["ok"] and not row["counts"]:
        state = f"reported (the engine never picks it): {row['why']}"
    figures = (
        f"out {row['out_rms_relative_error']:.2e} RMS, lse {row['lse_max_abs_error']:.2e} "
        if "out_rms_relative_error" in row else ""
    )  # fmt: skip
    print(f"{row['backend']:>10} {row['call']:<36} {row['dtype']:<8} {figures}"
          f"(ran {'/'.join(row['ran'])}): {state}", flush=True)  # fmt: skip


def planned_rows(args, dtype: torch.dtype) -> list[tuple[str, str, torch.dtype]]:
    """(call, backend, dtype) in the order they run: every call in `dtype`, the calls that merge
    several parts in float32 too, the risky backends (`RISKY_BACKENDS`) after all the others."""
    backends = [AUTO, *(args.backends or available_backends(args.device))]
    dtypes = [dtype] + ([torch.float32] if dtype != torch.float32 else [])
    rows = [(name, backend, dt) for dt in dtypes for name in CALLS
            if dt == dtype or name in MERGED_CALLS for backend in backends]  # fmt: skip
    return sorted(rows, key=lambda r: r[1] in RISKY_BACKENDS)


def check(args, rows: Rows) -> bool:
    """Every call on `AUTO` and every backend, each row saved as it is checked; True when every
    row that counts passed and every aten op lvx calls fits this torch (`op_signatures`)."""
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    signatures = mismatches()
    rows.save(signatures=signatures)
    for line in signatures:
        print(f"FAILED op signature: {line}", flush=True)
    problems = {dtype: problem(args.device, args.frames, args.rows, dtype,
                               getattr(args, "prefix", 4096))}  # fmt: skip
    print(
        f"{args.device}: {HQ}/{HKV} heads, d {D}, {args.frames * KEYS_PER_FRAME:,} keys "
        f"({args.frames} frames x {KEYS_PER_FRAME}), {args.rows} query rows, {dtype}"
    )
    ok = not signatures
    for name, backend, dt in planned_rows(args, dtype):
        if dt not in problems:
            problems[dt] = problem(args.device, args.frames, args.rows, dt,
                                   getattr(args, "prefix", 4096))  # fmt: skip
        call = problems[dt][name]
        row = {"backend": backend, "call": name, "dtype": str(dt).removeprefix("torch."),
               "queries": call.queries, "keys": call.keys}  # fmt: skip
        if backend != AUTO and not can_run(backend, _probe(args, dt), call.masked, D):
            rows.add(row | {"skipped": f"{backend} takes no such call (mask or dtype)"})
            continue
        row |= guarded_check(backend, call, dt)
        row["counts"] = backend == AUTO or backend in ENGINE_PICKS
        ok &= row["ok"] or not row["counts"]
        rows.add(row)
        _print(row)
    return ok


def _probe(args, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of the check's device and dtype, for `can_run`."""
    return torch.empty(0, device=args.device, dtype=dtype)


def add_check_options(p: argparse.ArgumentParser, frames: int, frames_help: str) -> None:
    """The options every kernel check takes: the device, the problem's frames and query rows, the
    dtype, where its rows go."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--frames", type=int, default=frames, help=frames_help)
    p.add_argument("--rows", type=int, default=256, help="query rows")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32")
    p.add_argument("--out", type=Path, help="write the rows as JSON here, each as it is checked")
    p.add_argument("--out-key", help="write them under this key of the JSON file (kept beside)")


def check_rows(p: argparse.ArgumentParser, args: argparse.Namespace) -> Rows:
    """Where a kernel check's rows go (its device refused in one line when it has none)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (--device cpu checks the CPU kernels)")
    return Rows(args.out, key=args.out_key, command=command_line(), machine=machine(args.device))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add_check_options(p, 48, "frames of 729 keys (48: 34,992 keys)")
    p.add_argument("--prefix", type=int, default=4096, help="cached text tokens before the rows")
    p.add_argument("--backends", nargs="+", help="default: every backend of the device")
    args = p.parse_args(argv)
    rows = check_rows(p, args)
    ok = check(args, rows)
    reported = [f"{r['backend']} {r['call']}: {r['why']}" for r in rows.rows
                if not r.get("ok", True) and not r.get("counts", True)]  # fmt: skip
    fallbacks = sorted({f for r in rows.rows for f in r.get("fallbacks", [])})
    rows.save(ok=ok, fallbacks=fallbacks, reported=reported)
    if not any("ok" in r for r in rows.rows):  # every backend declined every call
        rows.save(skipped="no backend took any call: nothing was checked")
    print("every kernel checked is within its tolerance" if ok else "some kernels FAILED (above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
