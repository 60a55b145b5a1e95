#!/usr/bin/env python
"""Do the kernels and the memory plan hold at Llama-3.2-Vision 11B's shapes? Random weights and
features, no checkpoint.

- kernels: the attention calls a cross layer makes on one rank of 8 for an hour at 1 fps (32 query
  / 8 K/V heads, head_dim 128, 450 frames of 1,601 keys: 720,450 keys): the video prompt's rows
  under the media mask, a question's rows seeing every key, a decoded token; each on the backend
  the engine picks, against float64 with the bounds `check_kernels.py` uses;
- memory: an 11B-shaped model (built on the meta device, materialised in bf16 with random
  weights), `--memory-frames` frames of random features, their K/V made in all 8 cross layers,
  the video prompt prefilled, a question and a short answer: the peak allocated memory beside the
  memory plan's (its encode stage left out: no vision tower runs). It fails when the peak is more
  than `OVER` above the plan (`--kv-mode auto` would then choose a mode that runs out).

    python scripts/check_mllama_11b.py --device cuda --out mllama_11b.json
    python scripts/check_mllama_11b.py --device cpu --small --out mllama_11b.json  # rehearsal

`--small` keeps the 11B's heads and 1,601 keys a frame for the kernels (2 frames) and takes the tiny
stand-in model for the memory part, whose peak a CPU does not measure (only the plan is written).
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
from lvx_app.engine.memory_plan import GB, Workload, memory_plan
from lvx_models.mllama.config import MllamaConfig
from scripts.check_kernels import AUTO, Call, check_call
from scripts.harness import Rows, command_line, machine
from scripts.reference64 import PEAK, forward64
from scripts.xattn_problem import DTYPES

HOUR_PER_RANK = 450  # frames of one rank of 8 for an hour at 1 fps
OVER = 0.15  # how far the measured peak may run above the plan


def _randn(g, *shape, device, dtype, times: float = 1.0) -> torch.Tensor:
    return (times * torch.randn(*shape, generator=g)).to(device, dtype)


def kernel_calls(cfg: MllamaConfig, frames: int, rows: int, device, dtype) -> dict[str, Call]:
    """A cross layer's calls on one rank's `frames` frames, with their float64 references."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, per = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.visual_tokens_per_frame,
    )
    keys, scale = frames * per, d**-0.5
    q = _randn(g, 1, rows, hq, d, device=device, dtype=dtype, times=PEAK)
    k, v = (_randn(g, 1, keys, hkv, d, device=device, dtype=dtype) for _ in range(2))
    q_vis = (torch.arange(rows) * (frames + 1) // rows).view(1, rows).to(device)  # row 0 sees none
    k_frame = (torch.arange(keys) // per).view(1, keys).to(device)

    def call(qx, mask) -> Call:
        qv, kf = mask or (None, None)
        return Call(
            lambda be: attn_fwd(qx, k, v, q_vis=qv, k_frame=kf, scale=scale, backend=be),
            forward64(qx, k, v, scale, qv, kf),
            masked=mask is not None,
            queries=qx.shape[1],
            keys=keys,
        )

    return {
        "video prompt, media mask": call(q, (q_vis, k_frame)),
        "question, every key visible": call(q, None),
        "decoded token": call(q[:, -1:], None),
    }


def check_kernels(args, cfg: MllamaConfig, rows: Rows) -> bool:
    dtype = DTYPES["bfloat16" if args.device == "cuda" else "float32"]
    ok = True
    for name, c in kernel_calls(cfg, args.frames, args.rows, args.device, dtype).items():
        row = {"part": "kernels", "call": name, "queries": c.queries, "keys": c.keys}
        row |= check_call(AUTO, c, dtype)
        ok &= row["ok"]
        rows.add(row)
        state = "ok" if row["ok"] else f"FAILED: {row['why']}"
        print(
            f"{name:<30} {c.keys:,} keys: out {row['out_rms_relative_error']:.2e} RMS, "
            f"lse {row['lse_max_abs_error']:.2e} ({'/'.join(row['ran'])}): {state}",
            flush=True,
        )
    return ok


def random_model(cfg: MllamaConfig, device: str, dtype: torch.dtype):
    """The engine's Mllama model at `cfg` with seeded random weights, built on the meta device and
    materialised in `dtype` on `device` (the 11B never exists in float32)."""
    from lvx_models.mllama.modeling import MllamaModel
    from lvx_models.mllama.text import rope_inv_freq
    from lvx_models.mllama.video_model import MllamaVideoModel

    with torch.device("meta"):
        model = MllamaModel(cfg)
    model = model.to(dtype).to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0 if "norm" in name else 0.5)
    # the RoPE frequencies, a buffer left empty by `to_empty` (as the loader sets them)
    model.language_model.model.inv_freq = rope_inv_freq(cfg.text).to(device)
    return MllamaVideoModel(model).eval()


def check_memory(args, cfg: MllamaConfig, rows: Rows) -> bool:
    """The chat on random features; the peak allocated growth over the weights beside the plan's."""
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    work = Workload(
        minutes=args.memory_frames / 60,
        kv_mode="cache",
        dtype_bytes=dtype.itemsize,
        answer_tokens=args.answer_tokens,
        device=args.device,
    ).for_model(cfg)
    plan = memory_plan(cfg, work)
    planned = max(v for k, v in plan.stages.items() if k != "encode") - plan.resident["weights"]
    model = random_model(cfg, args.device, dtype)
    frames, p = work.frames, cfg.visual_tokens_per_frame
    starts = cfg.prompt_header_tokens + torch.arange(frames) * cfg.prompt_positions_per_frame
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(
        0, cfg.vocab_size, (1, work.prompt_tokens + work.question_tokens), generator=g
    )
    ids[0, starts] = cfg.image_token_index
    ids = ids.to(args.device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.no_grad():
        e = torch.randn(frames, p, cfg.hidden_size, device=args.device, dtype=dtype)
        visual = model.prepare_visual(e, starts, precompute=True)
        del e  # as the engine: the features go once the K/V are made
        cache = model.new_cache()
        prefix = work.prompt_tokens
        model(ids[:, :prefix], cache=cache, visual=visual, last_only=True)
        logits = model(ids[:, prefix:], cache=cache, visual=visual, last_only=True)
        for _ in range(args.answer_tokens):
            token = logits[0, -1].argmax().view(1, 1)
            logits = model(token, cache=cache, visual=visual, last_only=True)
    measured = torch.cuda.max_memory_allocated() - base if cuda else None
    row = {
        "part": "memory",
        "frames": frames,
        "visual tokens": frames * p,
        "planned_gb": planned / GB,
        "planned_stage": plan.peak_stage,
        "measured_gb": None if measured is None else measured / GB,
    }
    row["ok"] = measured is None or measured <= planned * (1 + OVER)
    if measured is not None:
        row["error"] = planned / measured - 1
    rows.add(row)
    said = "not measured on a CPU" if measured is None else f"measured {measured / GB:.3f} GB"
    print(
        f"memory, {frames} frames: planned {planned / GB:.3f} GB over the weights, {said}: "
        f"{'ok' if row['ok'] else 'FAILED: over the plan by more than 15%'}",
        flush=True,
    )
    return row["ok"]


def small_config() -> MllamaConfig:
    from lvx_models.mllama.tiny import tiny_config

    return tiny_config(1000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--small", action="store_true", help="rehearsal shapes (see above)")
    p.add_argument("--frames", type=int, help=f"kernel frames of 1,601 keys ({HOUR_PER_RANK})")
    p.add_argument("--rows", type=int, default=64, help="query rows of the kernel calls")
    p.add_argument("--memory-frames", type=int, help="frames of the memory part (256)")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, help="write the rows as JSON here, each as it is checked")
    p.add_argument("--out-key", help="write them under this key of the JSON file (kept beside)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (--device cpu --small rehearses on a CPU)")
    args.frames = args.frames or (2 if args.small else HOUR_PER_RANK)
    args.memory_frames = args.memory_frames or (8 if args.small else 256)
    rows = Rows(args.out, key=args.out_key, command=command_line(), machine=machine(args.device))
    full = MllamaConfig()  # the published 11B sizes
    ok = check_kernels(args, full, rows)
    ok &= check_memory(args, small_config() if args.small else full, rows)
    rows.save(ok=ok)
    print("Llama-3.2-Vision 11B shapes hold" if ok else "some checks FAILED (above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
