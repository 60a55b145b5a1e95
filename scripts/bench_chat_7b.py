"""One chat on one device at mPLUG-Owl3-7B-241101's shapes, by video length: visual K/V, the video
prompt's prefill, time to first token, decode tokens/s and peak memory, the figures the memory plan
projects (scripts/plan_gpu.py); peak reserved memory too, and the kv mode `--kv-mode auto` chooses
for each length (`lvx_app/engine/kv_choice.py`) with the memory it saw.

Random weights allocated directly in bf16 on the GPU, random visual features for each length at
1 fps (729 tokens per frame, 5 placeholder tokens per frame), the model code the engine runs on one
rank: visual K/V preparation, prefill of the video prompt, TTFT of a question prefilled on top of
that cache (the median of 3, after one warm-up question; a short text forward before anything is
timed), and decode tokens/s. Like the engine, every token is read back to the host before the next
step (what the plan's tokens/s includes). Every row lists the attention kernels each phase ran and
any fallback (also gathered under "fallbacks"); the file is rewritten as each figure exists, so a
length that runs out of memory or time leaves the earlier lengths and its own first figures.
`--shape small` runs the same path at small shapes (the CPU rehearsal). Each row carries the memory
plan's peak and reserve for its length; the run fails (exit 1) when a length's measured peak is
more than 15 % above the plan's, or any call fell back to another kernel.

    python scripts/bench_chat_7b.py --device cuda --minutes 10 60 --out chat_7b.json
    python scripts/bench_chat_7b.py --device cpu --shape small --minutes 0.1 --new-tokens 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

import torch

from lvx_app.engine.kv_choice import choose_kv_mode
from lvx_kernels.backends import kernel_tally
from scripts.harness import Rows, command_line, machine, show, timed
from scripts.memory_plan import Workload, memory_plan
from scripts.random_model import random_model

TTFT_REPEATS = 3  # timed questions per video length, after one warm-up question; TTFT is the median
PEAK_OVER_PLAN = 0.15  # a measured peak this far above the plan's fails the chat
HEADER_TOKENS = 18  # chat template tokens before the first frame placeholder (as the plan)


def next_token(model, ids, cache, visual) -> torch.Tensor:
    """The greedy next token, read back to the host as the engine reads every token."""
    token = model(ids, cache=cache, visual=visual, last_only=True)[0, -1].argmax().view(1, 1)
    int(token)  # the engine's one host read per token: the next step waits for it
    return token


def _ask(model, question, cache, visual, prefix_len: int, device) -> tuple:
    """One question prefilled on the video prompt's cache (any earlier turn dropped first):
    (its first answer token, TTFT)."""
    cache.truncate(prefix_len)
    return timed(partial(next_token, model, question, cache, visual), device)


def _decode(model, token, cache, visual, n: int) -> torch.Tensor:
    for _ in range(n):
        token = next_token(model, token, cache, visual)
    return token


def peak_gib(device) -> float | None:
    """The device's peak allocated memory since its last reset (None on a CPU)."""
    cuda = torch.device(device).type == "cuda"
    return torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None


def peak_reserved_gib(device) -> float | None:
    """The peak PyTorch's allocator held reserved since its last reset (None on a CPU)."""
    cuda = torch.device(device).type == "cuda"
    return torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None


def planned_gib(config, minutes: float, fps: float, new_tokens: int, device, dtype) -> dict:
    """The memory plan's peak of live tensors, and what a GPU's allocator reserves for it, for
    this chat (`lvx_app/engine/memory_plan.py`), in GiB."""
    work = Workload(minutes=minutes, fps=fps, dtype_bytes=dtype.itemsize,
                    device=torch.device(device).type, answer_tokens=new_tokens)  # fmt: skip
    plan = memory_plan(config, work)
    return {"plan_peak_gib": plan.peak / 2**30, "plan_reserved_gib": plan.reserved / 2**30}


def over_plan(row: dict) -> str | None:
    """Why a length's measured peak fails its plan (more than PEAK_OVER_PLAN above it), or None
    (on a CPU, with no peak measured, None)."""
    peak, plan = row.get("peak_gib"), row.get("plan_peak_gib")
    if peak is None or not plan or peak <= plan * (1 + PEAK_OVER_PLAN):
        return None
    return (f"{row['minutes']:g} min: peak {peak:.1f} GiB is {100 * (peak / plan - 1):.0f} % over "
            f"the plan's {plan:.1f} GiB (at most {100 * PEAK_OVER_PLAN:.0f} %)")  # fmt: skip


def auto_kv(model, frames: int, device, dtype) -> dict:
    """What `--kv-mode auto` chooses for this video now, as the engine chooses at load (the
    features made, no K/V yet), with the memory it saw."""
    choice = choose_kv_mode("auto", model.config, frames, 1, dtype.itemsize, torch.device(device))
    return {"kv_choice": choice.line(), "kv_choice_figures": choice.as_dict()}


@torch.inference_mode()  # as the engine runs every forward and cache write
def length_row(model, minutes: float, fps: float, new_tokens: int, device, dtype, save=None):
    """One video length: visual K/V, the video prompt, a warm-up question (with a few decoded
    tokens), TTFT_REPEATS timed questions and a timed decode, with the kernels each phase ran;
    `save(row)` as each figure exists (a length stopped half-way keeps its first figures)."""
    cfg = model.config
    frames = max(1, int(minutes * 60 * fps))
    starts = HEADER_TOKENS + 5 * torch.arange(frames)
    prefix_len = int(starts[-1]) + 5
    ids = torch.randint(0, cfg.vocab_size, (1, prefix_len + 24), device=device)
    cache, question, seen = model.new_cache(), ids[:, prefix_len:], {}
    row = {"minutes": minutes, "frames": frames, "visual_tokens": frames * cfg.vision.num_patches,
           "prompt_tokens": prefix_len + 24}  # fmt: skip

    def done(**figures) -> None:
        row.update(figures, kernels={phase: dict(t.calls) for phase, t in seen.items()})
        row["fallbacks"] = sorted({f"{p}: {f}" for p, t in seen.items() for f in t.fallbacks})
        if save is not None:
            save(row)

    with kernel_tally() as seen["visual K/V"]:
        shape = (frames, cfg.vision.num_patches, cfg.hidden_size)
        features = torch.randn(shape, device=device, dtype=dtype)
        row.update(auto_kv(model, frames, device, dtype))
        visual, kv_s = timed(partial(model.prepare_visual, features, starts), device)
        del features
    with kernel_tally() as seen["video prompt prefill"]:
        prompt = partial(model, ids[:, :prefix_len], cache=cache, visual=visual, last_only=True)
        _, prefill_s = timed(prompt, device)
    done(visual_kv_s=kv_s, video_prompt_prefill_s=prefill_s)
    with kernel_tally() as seen["warm-up question"]:
        token, _ = _ask(model, question, cache, visual, prefix_len, device)
        timed(partial(_decode, model, token, cache, visual, 2), device)
    with kernel_tally() as seen["question (TTFT)"]:
        asked = [
            _ask(model, question, cache, visual, prefix_len, device) for _ in range(TTFT_REPEATS)
        ]
    ttfts = [t for _, t in asked]
    done(ttft_s=statistics.median(ttfts), ttft_s_all=ttfts)
    with kernel_tally() as seen["decode"]:
        _, decode_s = timed(
            partial(_decode, model, asked[-1][0], cache, visual, new_tokens), device
        )
    done(tokens_per_s=new_tokens / decode_s)
    return row


def bench(args, rows: Rows) -> None:
    """One model for every video length, its row saved as each figure exists; a short text forward
    first so that kernel start-up and library initialisation land in no timed figure."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, device, dtype)
    with torch.inference_mode():
        timed(partial(model, torch.zeros(1, 16, dtype=torch.long, device=device)), device)
    for minutes in args.minutes:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        entry = rows.add({"shape": args.shape, "minutes": minutes,
                          **planned_gib(model.config, minutes, args.fps, args.new_tokens, device,
                                        dtype)})  # fmt: skip

        def save(figures: dict, entry=entry) -> None:
            entry.update(figures, peak_gib=peak_gib(device),
                         peak_reserved_gib=peak_reserved_gib(device))  # fmt: skip
            rows.save(fallbacks=sorted({f"{r['minutes']:g} min {f}" for r in rows.rows
                                        for f in r.get("fallbacks", [])}))  # fmt: skip

        save(length_row(model, minutes, args.fps, args.new_tokens, device, dtype, save))
        print(
            f"{minutes:g} min: prefill {entry['video_prompt_prefill_s']:.2f} s, TTFT "
            f"{entry['ttft_s']:.3f} s, {entry['tokens_per_s']:.1f} tok/s, peak "
            + (f"{entry['peak_gib']:.1f} GiB" if entry["peak_gib"] is not None else "-"),
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=["7b", "small"], help="default: 7b on a GPU")
    parser.add_argument(
        "--minutes", type=float, nargs="+", default=[10.0, 30.0, 60.0], help="video lengths"
    )
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here, as figures come")
    args = parser.parse_args(argv)
    args.shape = args.shape or ("7b" if torch.device(args.device).type == "cuda" else "small")
    title = f"mPLUG-Owl3 {args.shape} shapes, random weights, one {args.device} rank"
    rows = Rows(args.out, title=title, command=command_line(), machine=machine(args.device))
    rows.save(fallbacks=[])
    bench(args, rows)
    for line in rows.extra["fallbacks"]:
        print(f"FALLBACK {line}")
    show(title, rows.rows)
    over = [why for why in map(over_plan, rows.rows) if why]
    rows.save(over_plan=over)
    for why in over:
        print(f"FAILED memory: {why}", flush=True)
    return 1 if over or rows.extra["fallbacks"] else 0


if __name__ == "__main__":
    sys.exit(main())
