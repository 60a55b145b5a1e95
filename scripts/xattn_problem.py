"""The cross-attention problem the distributed benchmarks share: Video-MME proportions (729 visual
tokens per frame, a `<|image|>` placeholder of ~5 text tokens, so S_KV / S_Q ≈ 145), the mPLUG-Owl3
media mask, contiguous shards, and interleaved timing of every case on every rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

KEYS_PER_FRAME = 729  # SigLIP's visual tokens per frame
TOKENS_PER_PLACEHOLDER = 5  # `<|image|>` is ~5 text tokens; 729/5 ≈ 145 = Video-MME's S_KV/S_Q
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shapes(frames: int, keys_per_frame: int, ratio: float) -> tuple[int, int]:
    """(S_q, S_kv) of the whole problem."""
    s_kv = frames * keys_per_frame
    return max(1, round(s_kv / ratio)), s_kv


def media_mask(
    s_q: int,
    s_kv: int,
    frames: int,
    keys_per_frame: int,
    per: int = TOKENS_PER_PLACEHOLDER,
    header: int = 0,
):
    """The media mask of a prompt whose frame j's placeholder starts at token header + per·j (by
    default mPLUG-Owl3's G1: 5j); token t sees frame j iff that start < t. Returns (q_vis (1, S_q),
    k_frame (1, S_kv)), int32."""
    t = torch.arange(s_q) - header
    q_vis = torch.div(t + per - 1, per, rounding_mode="floor").clamp(min=0, max=frames)
    k_frame = torch.arange(s_kv) // keys_per_frame
    return q_vis.unsqueeze(0).to(torch.int32), k_frame.unsqueeze(0).to(torch.int32)


def slices(total: int, world: int) -> list[slice]:
    """Contiguous shards, `torch.tensor_split` sizes."""
    bounds = [0]
    for part in torch.arange(total).tensor_split(world):
        bounds.append(bounds[-1] + len(part))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def timed_rounds(cases: dict, warmup: int, iters: int, device: torch.device | None = None) -> dict:
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
