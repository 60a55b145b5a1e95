"""NCCL check of LV-XAttn and the decode combine against one process (run under torchrun on 2+
GPUs).

    # --cpu: the same over gloo on CPU ranks torchrun --nproc-per-node 2 scripts/nccl_check.py

Every rank builds the same random 7B-shaped problem (28 query / 4 KV heads, d 128, media mask),
keeps its share of the frames' K/V and of the query rows, runs `lv_xattn_with_lse` and
`decode_xattn` over NCCL, and compares with a float64 `attn_fwd` of the whole problem on its own
GPU. Rank 0 prints one JSON line; the exit code is 1 when an error is above its dtype's tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.attention import attn_fwd
from lvx_app.attention.decode_xattn import decode_xattn
from lvx_app.attention.lv_xattn import lv_xattn_with_lse
from lvx_app.defaults import CHECK_TIMEOUT_S
from lvx_app.parallel.group import destroy_distributed, init_distributed
from lvx_app.parallel.lifeline import die_with_parent
from lvx_app.parallel.shards import shard_bounds
from scripts.harness import dumps

TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # max |out - float64 reference|


def check(dtype: torch.dtype, rank: int, world: int, device: torch.device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    frames, per_frame, rows = 8 * world, 64, 40 * world
    q = torch.randn(1, rows, 28, 128, generator=g)
    k, v = (torch.randn(1, frames * per_frame, 4, 128, generator=g) for _ in range(2))
    # row t sees a growing prefix of frames
    q_vis = (torch.arange(rows) * (frames + 1) // rows).view(1, rows)
    k_frame = torch.arange(frames).repeat_interleave(per_frame).view(1, -1)
    ref, _ = attn_fwd(
        *(x.to(device, torch.float64) for x in (q, k, v)),
        q_vis=q_vis.to(device),
        k_frame=k_frame.to(device),
    )
    f0, f1 = shard_bounds(frames, world, rank)
    r0, r1 = shard_bounds(rows, world, rank)
    ks = slice(f0 * per_frame, f1 * per_frame)
    kl, vl = (x[:, ks].to(device, dtype) for x in (k, v))
    ql, qv, kf = (
        q[:, r0:r1].to(device, dtype),
        q_vis[:, r0:r1].to(device),
        k_frame[:, ks].to(device),
    )
    out, _ = lv_xattn_with_lse(ql, kl, vl, q_vis=qv, k_frame=kf)
    lv_err = (out.double() - ref[:, r0:r1]).abs().max()
    last = q[:, -1:].to(device, dtype)  # a decode token: replicated on every rank, sees every frame
    dec, _ = decode_xattn(last, kl, vl)
    dec_ref, _ = attn_fwd(*(x.to(device, torch.float64) for x in (q[:, -1:], k, v)))
    dec_err = (dec.double() - dec_ref).abs().max()
    errs = torch.stack([lv_err, dec_err]).to(device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "lv_xattn_max_err": float(errs[0]),
        "decode_xattn_max_err": float(errs[1]),
        "tolerance": TOLERANCE[dtype],
        "ok": bool(errs.max() <= TOLERANCE[dtype]),
    }


def main() -> int:
    die_with_parent()  # a rank ends with the torchrun that started it, however that one ended
    # --cpu: the same check over gloo, to test this script
    info = init_distributed(cuda="--cpu" not in sys.argv, timeout_s=CHECK_TIMEOUT_S)
    try:
        results = [
            check(dt, info.rank, info.world_size, info.device)
            for dt in (torch.float32, torch.bfloat16)
        ]
    finally:
        destroy_distributed()
    if info.rank == 0:
        print(dumps({"world_size": info.world_size, "backend": info.backend, "results": results}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
