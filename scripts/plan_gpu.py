"""Memory and time plan of a released model on an hour-long video, from the model's real shapes
(every figure projected).

    python3 scripts/plan_gpu.py                                # the tables for mPLUG-Owl3-7B-241101
    python3 scripts/plan_gpu.py --model mPLUG-Owl3-2B-241014   # another release (published.py)
    python3 scripts/plan_gpu.py --family mllama                # Llama-3.2-11B-Vision
    python3 scripts/plan_gpu.py --model Llama-3.2-90B-Vision   # and its 90B
    python3 scripts/plan_gpu.py --check-rss                    # the formula against this CPU's RSS
    python3 scripts/plan_gpu.py --json runs/plan.json          # the same figures as JSON

The formula is `scripts/memory_plan.py`; `--check-rss` runs the model code the engine runs on one
rank (random weights, float32, random features) in a subprocess per case and compares its peak RSS
growth with the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(ROOT)
    import scripts  # noqa: F401

from lvx_app.engine.memory_plan import band_tiles, live_band_masks
from lvx_models.api import FAMILIES as REGISTRY
from lvx_models.api import ModelConfig
from scripts.harness import dumps, markdown, show, write_json
from scripts.memory_plan import (
    GB,
    Workload,
    kernel_calls,
    largest_video,
    memory_plan,
    param_counts,
    plan_rows,
    time_plan,
)
from scripts.random_model import small_config

# what one H100 "80 GB" shows to torch (about 78 GiB)
GPU_BYTES = 78 * 2**30
MINUTES = [10, 30, 60, 180]
GPU_COUNTS = [1, 2, 4, 8]  # the largest-video-per-GPU-count table
# family -> (its releases, the one planned when none is named), every registered family's
FAMILIES = {
    f.name: (f.published, next(iter(f.published))) for f in REGISTRY.values() if f.published
}
RELEASES: dict[str, ModelConfig] = {n: c for f, _ in FAMILIES.values() for n, c in f.items()}
RSS_CASES = [(64, "cache"), (64, "recompute")]  # (frames, kv mode) measured by --check-rss
RSS_TOLERANCE = 0.15
# visual_kv's chunk in the RSS check: 8 of the 64 frames at small shapes. CPU RSS counts a buffer's
# pages only once written, so with one chunk the K/V buffers would not count while the chunk's
# float32 work is at its peak (on a GPU they are allocated, and counted, before it); with 8 chunks
# the last one's peak has almost all of them written.
RSS_CHUNK_BYTES = 8 * 729 * 256 * 8


def _status_bytes(*fields: str) -> int:
    """The sum of /proc/self/status fields given in kB (e.g. RssAnon, RssFile, VmHWM), in bytes."""
    values = dict(
        line.split(":", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if ":" in line
    )
    return sum(int(values[f].split()[0]) for f in fields) * 1024


def _anon_now() -> int:
    return _status_bytes("RssAnon", "RssShmem")


def _anon_peak() -> int:
    """Peak resident memory less the file-backed pages (library code) resident now: under memory
    pressure the kernel evicts torch's library pages and faults them back in, which would count as
    growth in a plain RSS difference."""
    return _status_bytes("VmHWM") - _status_bytes("RssFile")


def measure_rss(frames: int, mode: str, answer_tokens: int) -> dict:
    """One rank's chat on `frames` random frames at small shapes, float32 CPU: peak RSS growth over
    the model."""
    from lvx_models.mplug_owl3 import hyper
    from lvx_models.mplug_owl3.modeling import Owl3Model

    hyper.VISUAL_KV_CHUNK_BYTES = RSS_CHUNK_BYTES
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = small_config()
    model = Owl3Model(cfg).eval()
    work = Workload(minutes=frames / 60, kv_mode=mode, dtype_bytes=4, answer_tokens=answer_tokens)
    starts = 18 + 5 * torch.arange(frames)
    prefix = work.prompt_tokens
    ids = torch.randint(0, cfg.vocab_size, (1, prefix + work.question_tokens))
    base = _anon_now()
    with torch.no_grad():
        e = torch.randn(frames, cfg.vision.num_patches, cfg.hidden_size)
        visual = model.prepare_visual(e, starts, precompute=mode == "cache")
        if mode == "cache":
            del e  # as Session.load_video: E is dropped once the K/V are made
        cache = model.new_cache()
        model(ids[:, :prefix], cache=cache, visual=visual, last_only=True)
        token = (
            model(ids[:, prefix:], cache=cache, visual=visual, last_only=True)[0, -1]
            .argmax()
            .view(1, 1)
        )
        for _ in range(answer_tokens):
            token = (
                model(token, cache=cache, visual=visual, last_only=True)[0, -1].argmax().view(1, 1)
            )
    return {"frames": frames, "kv mode": mode, "measured_bytes": _anon_peak() - base}


def check_rss(cases=RSS_CASES, answer_tokens: int = 2) -> list[dict]:
    """Measure each case in its own process and put the plan's prediction beside it (encode is not
    run: the features are random, so the plan's peak over the other stages is compared)."""
    cfg = small_config()
    counts = param_counts(cfg)
    # glibc returns a freed block to the OS only if it was mmapped; a fixed threshold keeps its
    # dynamic raise from parking freed tensors in the heap, so RSS follows the live tensors
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    # one process per case, side by side
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--measure-rss", str(f), m, str(answer_tokens)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for f, m in cases
    ]
    rows = []
    for (frames, mode), proc in zip(cases, procs):
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(
                f"the RSS measurement of {frames} frames ({mode}) failed with exit code "
                f"{proc.returncode}"
            )
        row = json.loads(out.strip().splitlines()[-1])
        work = Workload(
            minutes=frames / 60,
            kv_mode=mode,
            dtype_bytes=4,
            answer_tokens=answer_tokens,
            visual_kv_chunk_bytes=RSS_CHUNK_BYTES,
            device="cpu",  # the CPU kernel's tiles
        )
        plan = memory_plan(cfg, work, counts)
        row["planned_bytes"] = (
            max(v for k, v in plan.stages.items() if k != "encode") - plan.resident["weights"]
        )
        row["error"] = row["planned_bytes"] / row["measured_bytes"] - 1
        rows.append(row)
    return rows


def largest_rows(cfg: ModelConfig) -> list[dict]:
    """The largest video each kv mode takes at 1 fps on one GPU: memory, the model's trained
    positions, and what lvx says one frame past it."""
    counts = param_counts(cfg)
    return [
        largest_video(cfg, Workload(minutes=1, kv_mode=mode), GPU_BYTES, counts)
        for mode in ("cache", "recompute")
    ]


def largest_by_gpus(cfg: ModelConfig, gpus: list[int] = GPU_COUNTS) -> list[dict]:
    """The largest video at 1 fps per GPU count and kv mode, and what sets it: each rank's memory
    or the model's trained positions (which no GPU count moves)."""
    counts = param_counts(cfg)
    rows = []
    for n in gpus:
        for mode in ("cache", "recompute"):
            row = largest_video(cfg, Workload(minutes=1, ranks=n, kv_mode=mode), GPU_BYTES, counts)
            row.pop("past it lvx says")
            frames = round(row["largest min"] * 60)
            tokens = frames * cfg.visual_tokens_per_frame
            rows.append({"GPUs": n, **row, "frames": frames, "visual tokens M": tokens / 1e6})
    return rows


def time_rows(cfg: ModelConfig, minutes: float) -> list[dict]:
    counts = param_counts(cfg)
    rows = []
    for n in (1, 8):
        for mode in ("cache", "recompute"):
            t = time_plan(cfg, Workload(minutes=minutes, ranks=n, kv_mode=mode), counts=counts)
            ingest = t["ingest (vision tower + projector)"]["seconds"] + t["visual K/V"]["seconds"]
            stages = ("header prefill", "video-prompt prefill")
            prefill = sum(t[name]["seconds"] for name in stages if name in t)
            rows.append(
                {
                    "H100s": n,
                    "kv mode": mode,
                    "ingest s (GPU part)": round(ingest, 2),
                    # the header's rows prefilled on their own (Llama-3.2-Vision) count in it
                    "video-prompt prefill s": round(prefill, 2),
                    "TTFT s": round(t["question prefill (TTFT)"]["seconds"], 3),
                    "decode step ms": round(1e3 * t["decode step"]["seconds"], 2),
                    "tokens/s": round(t["tokens/s"], 1),
                }
            )
    return rows


def stage_rows(cfg: ModelConfig, minutes: float) -> list[dict]:
    t = time_plan(cfg, Workload(minutes=minutes))
    return [
        {"stage (1 GPU, resident K/V)": k, **{kk: round(vv, 3) for kk, vv in v.items()}}
        for k, v in t.items()
        if isinstance(v, dict)
    ]


def kernel_rows(cfg: ModelConfig, minutes: float) -> list[dict]:
    """Attention kernel calls per layer on the busiest rank (the attention's own planner, GPU
    tiles): the video-prompt prefill and a decoded token, on 1 and 8 GPUs."""
    rows = []
    for n in (1, 8):
        work = Workload(minutes=minutes, ranks=n)
        calls = [kernel_calls(cfg, work, rank) for rank in range(n)]
        c = max(calls, key=lambda c: c.prefill_text + c.prefill_visual)  # the busiest rank's
        rows.append(
            {
                "GPUs": n,
                "prefill, text layer (masked)": f"{c.prefill_text} ({c.prefill_text_masked})",
                "prefill, visual (masked)": f"{c.prefill_visual} ({c.prefill_visual_masked})",
                "decoded token, text / visual": f"{c.decode_text} / {c.decode_visual}",
            }
        )
    return rows


def three_hours(cfg: ModelConfig) -> str:
    """Whether 3 h at 1 fps fits one GPU with --kv-mode recompute, and the recommendation (the
    plan's own numbers)."""
    work = Workload(minutes=180, kv_mode="recompute")
    plan = memory_plan(cfg, work)
    tokens = work.frames * cfg.visual_tokens_per_frame
    e = plan.resident["features E"] / GB
    verdict = "fits" if plan.peak <= GPU_BYTES else "does not fit"
    # one hyper layer's K/V, recomputed
    kv_layer = tokens * 2 * cfg.num_key_value_heads * cfg.head_dim * 2 / GB
    masks = live_band_masks(band_tiles(cfg, work.prompt_tokens, tokens)) / GB
    return (
        f"3 h at 1 fps with --kv-mode recompute on one {GPU_BYTES / 2**30:.0f} GiB GPU {verdict} "
        f"(projected): E alone is {e:.1f} GB of bf16 features, the weights "
        f"{plan.resident['weights'] / GB:.1f} GB, and every forward recomputes one hyper layer's "
        f"K/V at a time ({kv_layer:.1f} GB), so the planned peak is {plan.peak / GB:.0f} GB "
        f"({plan.peak_stage}; attn_fwd's band masks, two tiles' at a time, are {masks * 1000:.0f} "
        "MB of it). Recommendation, in order: (1) keep E in pinned CPU memory and stream it per "
        f"hyper layer, or store E ({e / 2:.1f} GB) and K/V in fp8; (2) otherwise fewer frames "
        "(--max-frames, --fps 0.5) or more GPUs: with 8 the plan's peak is "
        f"{memory_plan(cfg, replace(work, ranks=8)).peak / GB:.0f} GB per rank."
    )


def plan_tables(cfg: ModelConfig, model: str, table) -> dict:
    """Every planned table of `model`, each shown with `table(title, rows)` as it is made."""
    out: dict = {}
    out["memory"] = plan_rows(cfg, MINUTES, [1, 8], ["cache", "recompute"])
    out["largest"] = largest_rows(cfg)
    out["largest_by_gpus"] = largest_by_gpus(cfg)
    out["stages_60min"] = stage_rows(cfg, 60)
    out["times_60min"] = time_rows(cfg, 60)
    out["three_hours"] = three_hours(cfg)
    out["kernel_calls_60min"] = kernel_rows(cfg, 60)
    table(f"projected memory per rank, {model} bf16, 1 fps", out["memory"])
    table(f"projected largest video on one {GPU_BYTES / 2**30:.0f} GiB GPU", out["largest"])
    table(
        f"projected largest video per count of {GPU_BYTES / 2**30:.0f} GiB GPUs, 1 fps",
        out["largest_by_gpus"],
    )
    table("projected FLOPs, bytes and time per stage, 60 min", out["stages_60min"])
    table(f"projected times, {model}, 60 min at 1 fps, H100", out["times_60min"])
    print(out["three_hours"])
    table("planned attention kernel calls per layer, 60 min at 1 fps", out["kernel_calls_60min"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check-rss", action="store_true", help="compare the formula with measured peak RSS on CPU"
    )
    parser.add_argument(
        "--measure-rss",
        nargs=3,
        metavar=("FRAMES", "MODE", "ANSWER_TOKENS"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--family",
        choices=list(FAMILIES),
        default="mplug_owl3",
        help="plan its default release ("
        + ", ".join(default for _, default in FAMILIES.values())
        + ")",
    )
    parser.add_argument(
        "--model", choices=list(RELEASES), help="the released checkpoint to plan for"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--markdown", action="store_true", help="print Markdown tables (for docs/benchmarks.md)"
    )
    args = parser.parse_args(argv)
    if args.measure_rss:
        frames, mode, answer = args.measure_rss
        print(dumps(measure_rss(int(frames), mode, int(answer))))
        return

    def table(title: str, rows: list[dict]) -> None:
        print(f"**{title}**\n\n{markdown(rows)}\n") if args.markdown else show(title, rows)

    args.model = args.model or FAMILIES[args.family][1]
    cfg = RELEASES[args.model]
    out = {"model": args.model, "gpu_bytes": GPU_BYTES}
    if args.check_rss:
        out["rss_check"] = check_rss()
        table("planned vs measured peak RSS growth, small shapes, float32 CPU", out["rss_check"])
    else:
        out |= plan_tables(cfg, args.model, table)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
