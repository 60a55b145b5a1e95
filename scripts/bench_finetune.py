#!/usr/bin/env python
"""Finetuning memory and step time with and without the LV-XAttn K/V recompute, on one device.

The model is `Owl3Model` with random weights at mPLUG-Owl3-7B shapes (H 3584, MLP 18944, 28 query /
4 KV heads, head_dim 128, 729 visual tokens per frame), cut to `--layers` decoder layers that are
all hyper layers (the 24 text-only layers of the real model add the same memory to both modes). The
vision tower is not run: E (frames x 729 x H) is random, as cached features would be. The trainable
set is `--train` (default hyper: v_kv_proj, the case where saving K/V costs most, since v_kv_proj's
input RMSNorm(E) is saved too). The text has 5 tokens per frame (the `<|image|>` placeholder) plus a
64-token prompt, frame j's placeholder at token 10 + 5j. A step is forward + loss on every text
token + backward, through the same `TrainAttention` hooks `lvx finetune` uses; no optimiser step
(identical in both modes).

Measured per mode and frame count: step time (median of `--steps` after one warm-up step), the bytes
autograd saved for backward during the forward (activations, counted once per storage, E and weights
excluded), and on CUDA the peak allocated memory. `--search` finds the largest frame count whose
step runs (CUDA: until a real out-of-memory error, doubling then bisecting to 3 %). On CPU there is
no OOM to find: the script runs tiny shapes (`--shape tiny`) so its code path is exercised, and
`--search` bisects against `--cpu-budget-mb` using the measured saved bytes + E + weights (an
estimate, labelled as such).

    python scripts/bench_finetune.py                                  # CPU, tiny shapes
    python scripts/bench_finetune.py --device cuda --frames 64,128,256 --search --out
    runs/bench_finetune.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.config import TrainConfig
from lvx_app.train.loop import configure_trainable
from lvx_app.train.recompute import TrainAttention, checkpoint_lm_blocks
from lvx_models.mplug_owl3.config import Owl3Config, SiglipVisionConfig
from lvx_models.mplug_owl3.modeling import Owl3Model
from scripts.harness import Rows, command_line, machine, sync

PATCHES = 729
TOKENS_PER_FRAME = 5
PROMPT = 64
SHAPES = {  # hidden, mlp, heads, kv heads
    "7b": (3584, 18944, 28, 4),
    "tiny": (256, 512, 4, 2),
}


def build(
    shape: str,
    layers: int,
    vocab: int,
    device: torch.device,
    dtype: torch.dtype,
    train: str,
    recompute: bool,
    checkpoint_lm: bool,
):
    h, mlp, nh, nkv = SHAPES[shape]
    cfg = Owl3Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        hyper_layers=list(range(1, layers + 1)),
        vision=SiglipVisionConfig(
            hidden_size=32,
            image_size=378,
            intermediate_size=64,
            num_attention_heads=2,
            num_hidden_layers=1,
            patch_size=14,
        ),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Owl3Model(cfg).to(dtype)
    params = configure_trainable(
        model,
        TrainConfig(
            mode=None if train == "lora" else train, lora_rank=16 if train == "lora" else None
        ),
    )
    for _, p in params:
        if p.dtype != torch.float32:
            p.data = p.data.float()
    hooks = TrainAttention(model, recompute=recompute)
    if checkpoint_lm:
        checkpoint_lm_blocks(model, hooks)
    return model, hooks, [p for _, p in params]


def one_step(
    model,
    hooks,
    frames: int,
    e: torch.Tensor,
    device: torch.device,
    autocast: bool,
    count_saved: bool,
) -> int:
    """Forward + backward of one sample; returns the bytes saved for backward (0 unless
    count_saved)."""
    L = PROMPT + TOKENS_PER_FRAME * frames
    g = torch.Generator().manual_seed(frames)
    ids = torch.randint(0, model.config.vocab_size, (1, L), generator=g).to(device)
    pos = torch.arange(L, device=device).view(1, L)
    starts = 10 + TOKENS_PER_FRAME * torch.arange(frames)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {
        e.untyped_storage().data_ptr()
    }
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved else _null()
    with ctx, torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        feed = hooks.feed(pos.cpu(), device)
        visual = model.prepare_visual(e, starts, torch.arange(frames), precompute=False)
        logits = model(ids, pos, visual=visual, feed=feed, hooks=hooks)
        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return sum(seen.values())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure(args, frames: int, recompute: bool, steps: Optional[int] = None) -> Optional[dict]:
    """One configuration: None if it ran out of memory (CUDA)."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = hooks = e = None
    try:
        model, hooks, _ = build(
            args.shape,
            args.layers,
            args.vocab,
            device,
            dtype,
            args.train,
            recompute,
            args.checkpoint_lm,
        )
        e = torch.randn(frames, PATCHES, model.config.hidden_size, device=device, dtype=dtype)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        autocast = device.type == "cuda"
        # warm-up + count
        saved = one_step(model, hooks, frames, e, device, autocast, count_saved=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps if steps is not None else args.steps):
            sync(device)
            t0 = time.perf_counter()
            one_step(model, hooks, frames, e, device, autocast, count_saved=False)
            sync(device)
            times.append(time.perf_counter() - t0)
        row = {
            "frames": frames,
            "recompute": recompute,
            "text_tokens": PROMPT + TOKENS_PER_FRAME * frames,
            "visual_tokens": frames * PATCHES,
            "step_s": statistics.median(times),
            "saved_bytes": saved,
            "e_bytes": e.numel() * e.element_size(),
            "weight_bytes": weights,
        }
        if device.type == "cuda":
            row["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        return row
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        del model, hooks, e
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def fits(args, frames: int, recompute: bool) -> bool:
    if args.device == "cuda":
        return measure(args, frames, recompute, steps=1) is not None
    row = measure(args, frames, recompute, steps=1)  # CPU: estimate against the budget
    return row["saved_bytes"] + row["e_bytes"] + row["weight_bytes"] <= args.cpu_budget_mb * 2**20


def largest(args, recompute: bool) -> int:
    """Largest frame count that fits: double from --search-start, then bisect to within 3 %."""
    lo, hi = 0, args.search_start
    while hi <= args.search_max and fits(args, hi, recompute):
        lo, hi = hi, hi * 2
    if lo == 0:
        return 0
    hi = min(hi, args.search_max + 1)
    while hi - lo > max(1, lo // 33):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(args, mid, recompute) else (lo, mid)
    return lo


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", choices=list(SHAPES), help="default: 7b on cuda, tiny on cpu")
    ap.add_argument(
        "--layers", type=int, default=4, help="decoder layers, all hyper (the 7B has 4 of them)"
    )
    ap.add_argument(
        "--vocab", type=int, default=4096, help="vocabulary (small: the logits are not the point)"
    )
    ap.add_argument("--train", default="hyper", choices=["hyper", "lora", "all"])
    ap.add_argument(
        "--checkpoint-lm", action="store_true", help="also checkpoint the decoder layers"
    )
    ap.add_argument(
        "--frames", help="comma-separated frame counts (default 4,8 cpu; 64,128,256 cuda)"
    )
    ap.add_argument(
        "--steps", type=int, default=3, help="timed steps per configuration (after 1 warm-up)"
    )
    ap.add_argument("--search", action="store_true", help="find the largest frame count per mode")
    ap.add_argument("--search-start", type=int, default=None)
    ap.add_argument("--search-max", type=int, default=16384)
    ap.add_argument(
        "--cpu-budget-mb", type=float, default=512.0, help="CPU --search budget (estimate)"
    )
    ap.add_argument("--out", help="write the results as JSON here, each row as it is measured")
    return ap


def run(args, frames: list[int], rows: Rows) -> None:
    """Both modes at every frame count, each row saved as it is measured."""
    print(f"{'frames':>7} {'mode':>12} {'step s':>8} {'saved GiB':>10} {'peak GiB':>9}  overhead")
    for n in frames:
        pair = {}
        for rec in (False, True):
            row = measure(args, n, rec)
            name = "recompute" if rec else "save K/V"
            if row is None:
                print(f"{n:>7} {name:>12}      OOM")
                continue
            pair[rec] = row
            over = ""
            if rec and False in pair:
                row["time_overhead"] = row["step_s"] / pair[False]["step_s"] - 1
                over = f"{100 * row['time_overhead']:+.1f} %"
            rows.add(row)
            peak = f"{row['peak_bytes'] / 2**30:9.2f}" if "peak_bytes" in row else f"{'-':>9}"
            print(
                f"{n:>7} {name:>12} {row['step_s']:8.3f} {row['saved_bytes'] / 2**30:10.3f} {peak} "
                f" {over}"
            )


def search(args) -> dict:
    """The largest frame count of each mode (CUDA: out of memory; CPU: against a budget)."""
    best = {rec: largest(args, rec) for rec in (False, True)}
    ratio = best[True] / best[False] if best[False] else None
    how = (
        "out-of-memory search"
        if args.device == "cuda"
        else f"estimate vs {args.cpu_budget_mb:.0f} MB budget"
    )
    print(f"largest frame count ({how}): save K/V {best[False]}, recompute {best[True]}")
    return {"save_kv": best[False], "recompute": best[True], "ratio": ratio, "method": how}


def main(argv: list[str] | None = None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no GPU is visible")
    args.shape = args.shape or ("7b" if args.device == "cuda" else "tiny")
    frames = args.frames or ("64,128,256" if args.device == "cuda" else "4,8")
    args.search_start = args.search_start or (64 if args.device == "cuda" else 2)
    rows = Rows(args.out, command=command_line(), machine=machine(args.device), args=vars(args))
    run(args, [int(x) for x in frames.split(",")], rows)
    if args.search:
        rows.save(largest_frames=search(args))


if __name__ == "__main__":
    main()
