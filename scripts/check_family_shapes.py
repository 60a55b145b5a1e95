#!/usr/bin/env python
"""Are the attention kernels right at every registered family's published cross-layer shapes?

For each family of the registry (`lvx_models.api.FAMILIES`) and each distinct cross-layer geometry
of its published releases (`Family.published`: query heads, K/V heads, head size, visual tokens per
frame), the cross-attention calls the engine makes, against float64 (output and lse), on the
backend the engine picks (`check_kernels.check_call`, its tolerances): every key visible (a
question), the media mask (a video prompt: row t sees a growing prefix of frames, the first row
none), the latest frame only (`--media-attention latest-frame`), one decoded token; beside them,
the memory plan's projected peak per GPU for an hour at 1 fps on 8 GPUs with resident visual K/V.
A family registered later is checked with no edit here. One row per (geometry, call), written as
it is checked; exit 1 when any failed.

    python scripts/check_family_shapes.py --device cuda --out shapes.json
    python scripts/check_family_shapes.py --device cpu --frames 2 --rows 16   # rehearsal
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

import torch

from lvx_app.attention import attn_fwd
from lvx_app.engine.memory_plan import Workload, memory_plan
from lvx_models.api import FAMILIES
from scripts.check_kernels import AUTO, Call, add_check_options, check_rows, guarded_check
from scripts.harness import Rows
from scripts.reference64 import PEAK, forward64
from scripts.xattn_problem import DTYPES

GiB = 2**30


def geometries() -> dict[tuple[int, int, int, int], list[tuple[str, str, object]]]:
    """(query heads, K/V heads, head size, visual tokens per frame) -> [(family title, release,
    config)] of every registered family's published releases."""
    out: dict = {}
    for family in FAMILIES.values():
        for release, cfg in family.published.items():
            key = (cfg.cross_attention_heads, cfg.cross_kv_heads, cfg.cross_head_dim,
                   cfg.visual_tokens_per_frame)  # fmt: skip
            out.setdefault(key, []).append((family.title, release, cfg))
    return out


def calls(shape: tuple[int, int, int, int], frames: int, rows: int, device, dtype) -> dict:
    """Every cross-attention call of one geometry, with its float64 reference."""
    hq, hkv, d, per_frame = shape
    g = torch.Generator().manual_seed(0)
    keys = frames * per_frame
    q = (PEAK * torch.randn(1, rows, hq, d, generator=g)).to(device, dtype)
    k, v = (torch.randn(1, keys, hkv, d, generator=g).to(device, dtype) for _ in range(2))
    q_vis = (torch.arange(rows) * (frames + 1) // rows).view(1, rows).to(device)
    k_frame = (torch.arange(keys) // per_frame).view(1, keys).to(device)
    scale = d**-0.5

    def call(qx, mask=None, window=None) -> Call:
        qv, kf = mask or (None, None)
        return Call(
            lambda be: attn_fwd(qx, k, v, q_vis=qv, k_frame=kf, backend=be, window=window),
            forward64(qx, k, v, scale, qv, kf, window=window),
            masked=mask is not None,
            queries=qx.shape[1],
            keys=keys,
        )

    return {
        "every key visible": call(q),
        "media mask": call(q, (q_vis, k_frame)),
        "latest frame": call(q, (q_vis, k_frame), window=1),
        "decoded token": call(q[:, -1:]),
    }


def planned_peak_gib(cfg) -> float:
    """The memory plan's peak per GPU for an hour at 1 fps on 8 GPUs, resident visual K/V."""
    return memory_plan(cfg, Workload(minutes=60, ranks=8)).peak / GiB


def check(args, rows: Rows) -> bool:
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    ok = True
    for shape, releases in geometries().items():
        names = ", ".join(f"{release}" for _, release, _ in releases)
        peaks = {release: round(planned_peak_gib(cfg), 1) for _, release, cfg in releases}
        hq, hkv, d, per_frame = shape
        for name, c in calls(shape, args.frames, args.rows, args.device, dtype).items():
            row = {"family": releases[0][0], "releases": names, "call": name,
                   "heads": f"{hq}/{hkv} x {d}", "keys": c.keys, "queries": c.queries,
                   "dtype": str(dtype).removeprefix("torch."),
                   "planned peak GiB, 60 min on 8 GPUs": peaks}  # fmt: skip
            row |= guarded_check(AUTO, c, dtype)
            ok &= row["ok"]
            rows.add(row)
            state = "ok" if row["ok"] else f"FAILED: {row['why']}"
            print(f"{names:<60} {name:<18} {hq}/{hkv}x{d} {c.keys:>7} keys "
                  f"(ran {'/'.join(row['ran'])}): {state}", flush=True)  # fmt: skip
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add_check_options(p, 16, "frames of each release's keys")
    args = p.parse_args(argv)
    rows = check_rows(p, args)
    ok = check(args, rows)
    rows.save(ok=ok)
    print("every family's shapes are within tolerance" if ok else "some calls FAILED (above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
