"""Time-to-first-token and decode speed of a chat turn on a long video.

Two measurements, both printed as a rich table and written as JSON:

* `engine` (default, CPU): the real `lvx` engine — tiny random-weight checkpoint, a synthetic video,
  world sizes 1/2/4 CPU ranks under torchrun — load the video, then time one question (TTFT, decode
  tok/s). At every world size > 1 the same chat runs once per entry of `ATTENTIONS` (LV-XAttn, Ring
  pass-KV, all-gather K/V, installed in the engine from outside by scripts/baselines.py), with the
  video-prompt prefill time and the attention bytes each rank sent while loading and while
  answering.
* `model` (`--mode model`, meant for one GPU): mPLUG-Owl3-7B-241101 shapes with random weights,
  random visual features for a 10/30/60-minute video at 1 fps (729 tokens per frame, 5 placeholder
  tokens per frame), the same model code the engine runs on one rank: visual K/V preparation,
  prefill of the video prompt, TTFT of a question prefilled on top of that cache (the median of 3,
  after one warm-up question; a short text forward before anything is timed), and decode tokens/s.
  The weights are allocated directly in bf16 on the GPU. Every row lists the attention kernels each
  phase ran and any fallback (also gathered under "fallbacks" in the JSON). `--shape small` runs the
  same path at small shapes so it can be exercised on a CPU.

    python scripts/bench_chat.py --out runs/bench_chat_cpu.json python scripts/bench_chat.py --ranks
    1 2 4 --plot runs/bench_chat_attention.png --out runs/bench_chat_attention.json python
    scripts/bench_chat.py --mode model --device cuda --minutes 10 30 60 --out
    runs/bench_chat_h100.json # prefill per layout (lvx_app/parallel/layout.py) python
    scripts/bench_chat.py --mode layouts --ranks 2 --minutes 10

* `layouts` (`--mode layouts`): the video-prompt prefill of the engine's sharded forward (its hooks,
  small shapes, random weights and features) on gloo CPU ranks with frames and their placeholder
  tokens dealt by each layout, layouts interleaved; the last token's logits are compared with the
  contiguous layout's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.attention.backends import kernel_tally
from scripts.baselines.engine import baseline_entry

QUESTION = "What happens in the video, and when does the scene change?"


# One entry per engine variant compared: its label, the attention scripts/baselines.py installs and
# the config options that select it. Adding a row (e.g. another schedule option) is one entry here.
ATTENTIONS = {
    "LV-XAttn (auto)": ("LV-XAttn", {"xattn_schedule": "auto"}),
    "LV-XAttn ring only": ("LV-XAttn", {"xattn_schedule": "ring"}),
    "Ring pass-KV": ("Ring pass-KV", {}),
    "all-gather K/V": ("all-gather K/V", {}),
}


def _bytes_sent(engine) -> list[int]:
    return [int(r.get("attention bytes sent", 0)) for r in engine.stats()["ranks"]]


def _engine_row(engine, video: Path, fps: float, new_tokens: int, repeats: int = 1) -> dict:
    """Load the video, warm up, then `repeats` timed questions (a reset before each; medians of TTFT
    and tok/s, all answers must agree); bytes are the most any rank sent while loading and in the
    first timed answer."""
    summary = engine.load_video(str(video), subtitles=[], fps=fps)
    stats = engine.stats()["ranks"]
    after_load = [int(r.get("attention bytes sent", 0)) for r in stats]
    prefill_s = max(float(r.get("video prompt prefill s", 0.0)) for r in stats)
    "".join(engine.ask("warm-up?", max_new_tokens=4))
    answers, ttfts, speeds, sent = [], [], [], []
    for _ in range(repeats):
        engine.reset()
        before = _bytes_sent(engine)
        answers.append("".join(engine.ask(QUESTION, max_new_tokens=new_tokens)))
        sent.append(max(a - b for a, b in zip(_bytes_sent(engine), before)))
        ttfts.append(engine.last_answer.ttft_s)
        speeds.append(engine.last_answer.tokens_per_s)
    if len(set(answers)) != 1:
        raise SystemExit(f"the {repeats} repeats of the question gave different answers")
    return {
        "frames": summary.frames,
        "visual_tokens": summary.visual_tokens,
        "ingest_s": summary.seconds,
        "video_prompt_prefill_s": prefill_s,
        "load_mb_sent_per_rank": max(after_load) / 1e6,
        "prompt_tokens": engine.last_answer.prompt_tokens,
        "ttft_s": statistics.median(ttfts),
        "new_tokens": engine.last_answer.new_tokens,
        "tokens_per_s": statistics.median(speeds),
        "answer_mb_sent_per_rank": sent[0] / 1e6,
        "answer": answers[0],
        "ttft_s_all": ttfts,
        "tokens_per_s_all": speeds,
    }


def bench_engine(
    ranks: list[int],
    minutes: float,
    fps: float,
    new_tokens: int,
    workdir: Path,
    attentions: list[str] | None = None,
    repeats: int = 1,
) -> list[dict]:
    from lvx_app.config import Config
    from lvx_app.runtime.open import open_engine
    from lvx_app.video.synthetic import make_video
    from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(workdir / "tiny-g2", "g2")
    video = workdir / f"video_{minutes:g}min.mp4"
    if not video.exists():
        make_video(video, num_frames=int(minutes * 60 * 2), fps=2, width=96, height=64)
    rows = []
    for n in ranks:
        for name in (attentions or list(ATTENTIONS)) if n > 1 else ["LV-XAttn (auto)"]:
            attention, options = ATTENTIONS[name]
            config = Config.from_options(
                model=str(checkpoint), cache=False, gpus=0, ranks=n, **options
            )
            t0 = time.perf_counter()
            engine = open_engine(config, entry=baseline_entry(attention))
            start_s = time.perf_counter() - t0
            try:
                row = _engine_row(engine, video, fps, new_tokens, repeats)
            finally:
                engine.close()
            answer = row.pop("answer")
            rows.append(
                {
                    "attention": name if n > 1 else "one rank",
                    "ranks": n,
                    "start_s": start_s,
                    **row,
                    "answer_chars": len(answer),
                    "answer_crc32": zlib.crc32(answer.encode()),
                }
            )
    return rows


def plot_engine(rows: list[dict], path: Path) -> None:
    """TTFT, decode tokens/s and video-prompt prefill per attention and rank count, one panel
    each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("video_prompt_prefill_s", "video-prompt prefill (s)"),
        ("ttft_s", "question TTFT (s)"),
        ("tokens_per_s", "decode tokens/s"),
    ]
    names = list(dict.fromkeys(r["attention"] for r in rows if r["ranks"] > 1))
    world_sizes = sorted({r["ranks"] for r in rows if r["ranks"] > 1})
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 3.6))
    width = 0.8 / max(1, len(names))
    for ax, (key, label) in zip(axes, metrics):
        for i, name in enumerate(names):
            values = [
                next((r[key] for r in rows if r["attention"] == name and r["ranks"] == n), 0.0)
                for n in world_sizes
            ]
            ax.bar([j + i * width for j in range(len(world_sizes))], values, width, label=name)
        ax.set_xticks(
            [j + width * (len(names) - 1) / 2 for j in range(len(world_sizes))],
            [f"{n} ranks" for n in world_sizes],
        )
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _config(shape: str):
    from lvx_models.mplug_owl3.config import Owl3Config, SiglipVisionConfig

    if shape == "7b":
        return Owl3Config()  # the defaults are mPLUG-Owl3-7B-241101's config
    return Owl3Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        hyper_layers=[2, 4, 6, 8],
        vision=SiglipVisionConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=2
        ),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_model(shape: str, device: torch.device, dtype: torch.dtype):
    """mPLUG-Owl3 at `shape` with random weights (the same on every process: seeded), allocated
    directly in `dtype` on `device` (built on meta and cast there, so the 7B never exists in float32
    on the GPU)."""
    from lvx_models.mplug_owl3.modeling import Owl3Model

    with torch.device("meta"):
        model = Owl3Model(_config(shape))
    model = model.to(dtype).to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0 if "norm" in name else 0.0)
    return model.eval()


TTFT_REPEATS = 3  # timed questions per video length, after one warm-up question; TTFT is the median


def _timed(fn, device: torch.device) -> tuple:
    """(fn(), seconds) with the device synchronised on both sides, no autograd."""
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        result = fn()
    _sync(device)
    return result, time.perf_counter() - t0


def _next_token(model, ids, cache, visual) -> torch.Tensor:
    return model(ids, cache=cache, visual=visual, last_only=True)[0, -1].argmax().view(1, 1)


def _ask(model, question, cache, visual, prefix_len: int, device: torch.device) -> tuple:
    """One question prefilled on the video prompt's cache (any earlier turn dropped first):
    (its first answer token, TTFT)."""
    cache.truncate(prefix_len)
    return _timed(partial(_next_token, model, question, cache, visual), device)


def _decode(model, token, cache, visual, n: int) -> torch.Tensor:
    for _ in range(n):
        token = _next_token(model, token, cache, visual)
    return token


def _model_row(model, minutes: float, fps: float, new_tokens: int, device, dtype) -> dict:
    """One video length: visual K/V, the video prompt, a warm-up question (with a few decoded
    tokens), TTFT_REPEATS timed questions and a timed decode, with the kernels each phase ran."""
    cfg, header = model.config, 18
    frames = int(minutes * 60 * fps)
    starts = header + 5 * torch.arange(frames)
    prefix_len = int(starts[-1]) + 5
    ids = torch.randint(0, cfg.vocab_size, (1, prefix_len + 24), device=device)
    shape = (frames, cfg.vision.num_patches, cfg.hidden_size)
    cache, question, seen = model.new_cache(), ids[:, prefix_len:], {}
    with kernel_tally() as seen["visual K/V"]:
        features = torch.randn(shape, device=device, dtype=dtype)
        visual, kv_s = _timed(partial(model.prepare_visual, features, starts), device)
        del features
    with kernel_tally() as seen["video prompt prefill"]:
        prompt = partial(model, ids[:, :prefix_len], cache=cache, visual=visual, last_only=True)
        _, prefix_s = _timed(prompt, device)
    with kernel_tally() as seen["warm-up question"]:
        token, _ = _ask(model, question, cache, visual, prefix_len, device)
        _timed(partial(_decode, model, token, cache, visual, 2), device)
    with kernel_tally() as seen["question (TTFT)"]:
        asked = [
            _ask(model, question, cache, visual, prefix_len, device) for _ in range(TTFT_REPEATS)
        ]
    with kernel_tally() as seen["decode"]:
        _, decode_s = _timed(
            partial(_decode, model, asked[-1][0], cache, visual, new_tokens), device
        )
    ttfts = [t for _, t in asked]
    return {
        "minutes": minutes,
        "frames": frames,
        "visual_tokens": frames * cfg.vision.num_patches,
        "prompt_tokens": prefix_len + 24,
        "visual_kv_s": kv_s,
        "video_prompt_prefill_s": prefix_s,
        "ttft_s": statistics.median(ttfts),
        "ttft_s_all": ttfts,
        "tokens_per_s": new_tokens / decode_s,
        "kernels": {phase: dict(tally.calls) for phase, tally in seen.items()},
        "fallbacks": sorted({f"{p}: {f}" for p, t in seen.items() for f in t.fallbacks}),
    }


def bench_model(
    minutes: list[float], fps: float, new_tokens: int, device: torch.device, shape: str
) -> list[dict]:
    """One model for every video length; a short text forward first so that kernel start-up and
    library initialisation land in no timed figure."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _random_model(shape, device, dtype)
    _timed(partial(model, torch.zeros(1, 16, dtype=torch.long, device=device)), device)
    rows = []
    for m in minutes:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        row = _model_row(model, m, fps, new_tokens, device, dtype)
        row["peak_gib"] = (
            torch.cuda.max_memory_allocated(device) / 2**30
            if device.type == "cuda"
            else float("nan")
        )
        rows.append({"shape": shape, **row})
    return rows


def model_mode(args, console: Console) -> tuple[list[dict], str, dict]:
    """`--mode model`: (rows, title, {"fallbacks": every kernel fallback, also printed})."""
    device = torch.device(args.device)
    shape = args.shape or ("7b" if device.type == "cuda" else "small")
    rows = bench_model(args.minutes or [10.0, 30.0, 60.0], args.fps, args.new_tokens, device, shape)
    title = f"mPLUG-Owl3 {shape} shapes, random weights, one {device.type} rank"
    fallbacks = sorted({f"{r['minutes']:g} min {f}" for r in rows for f in r["fallbacks"]})
    for line in fallbacks:
        console.print(f"FALLBACK {line}")
    return rows, title, {"fallbacks": fallbacks}


def _layout_prefill_rank(rank: int, world: int, cfg: dict) -> dict:
    """Video-prompt prefill on this gloo rank for each layout (interleaved), with the engine's
    hooks."""
    import torch.distributed as dist

    from lvx_app.engine.parallelize import ShardedAttention
    from lvx_app.parallel.layout import owned, token_owners

    torch.set_num_threads(1)
    model = _random_model("small", torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    frames, header = cfg["frames"], 18
    starts = header + 5 * torch.arange(frames)
    ids = torch.randint(0, model.config.vocab_size, (int(starts[-1]) + 5,), generator=g)
    features = torch.randn(
        frames, model.config.vision.num_patches, model.config.hidden_size, generator=g
    )
    times = {name: [] for name in cfg["layouts"]}
    logits = {}
    for _ in range(cfg["iters"]):
        for layout in cfg["layouts"]:
            mine = owned(frames, world, rank, layout)
            visual = model.prepare_visual(
                features[mine], starts, torch.tensor(mine, dtype=torch.int64)
            )
            who = token_owners(ids.numel(), starts, world, layout)
            tokens = torch.nonzero(who == rank).flatten()
            hooks = ShardedAttention(None, rank, world)
            model.hooks.text, model.hooks.visual = hooks.text, hooks.visual
            hooks.begin(tokens, replicated=False)
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(
                    ids[tokens].view(1, -1),
                    tokens.view(1, -1),
                    cache=model.new_cache(),
                    visual=visual,
                    last_only=True,
                )
            times[layout].append(time.perf_counter() - t0)
            box = (
                out[0, -1].clone() if rank == int(who[-1]) else torch.zeros(model.config.vocab_size)
            )
            dist.all_reduce(box)
            logits[layout] = box.numpy()
    t = torch.tensor([times[name] for name in cfg["layouts"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a prefill lasts as long as its slowest rank
    return {"times": t.tolist(), "logits": logits, "prompt_tokens": int(ids.numel())}


def bench_layouts(
    layouts: list[str], ranks: int, minutes: float, fps: float, iters: int
) -> list[dict]:
    """Video-prompt prefill of the engine's sharded forward at each layout (small shapes, random
    weights)."""
    import statistics

    from scripts.gloo_ranks import run_ranks

    cfg = {"layouts": layouts, "frames": int(minutes * 60 * fps), "iters": iters}
    out = run_ranks(_layout_prefill_rank, ranks, cfg, timeout_s=3600)[0]
    base = out["logits"].get("contiguous", out["logits"][layouts[0]])
    rows = []
    for name, t in zip(layouts, out["times"]):
        rows.append(
            {
                "layout": name,
                "ranks": ranks,
                "frames": cfg["frames"],
                "prompt_tokens": out["prompt_tokens"],
                "prefill_s": statistics.median(t),
                "prefill_s_all": t,
                "max_abs_logit_diff": float(abs(out["logits"][name] - base).max()),
            }
        )
    contiguous = next((r["prefill_s"] for r in rows if r["layout"] == "contiguous"), None)
    for row in rows:
        row["speedup_vs_contiguous"] = contiguous / row["prefill_s"] if contiguous else float("nan")
    return rows


def _table(title: str, rows: list[dict]) -> Table:
    table = Table(title=title)
    # per-repeat lists and per-phase kernels go to the JSON only
    keys = [k for k, v in rows[0].items() if not isinstance(v, (list, dict))]
    for key in keys:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(
            *(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in keys)
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["engine", "model", "layouts"], default="engine")
    parser.add_argument(
        "--layouts", default="contiguous,striped,zigzag", help="layouts mode: which to compare"
    )
    parser.add_argument(
        "--iters", type=int, default=3, help="layouts mode: prefills per layout (median)"
    )
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[1, 2, 4], help="engine mode: CPU world sizes"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        nargs="+",
        default=None,
        help="video length(s); engine default 10, model default 10 30 60",
    )
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shape", choices=["7b", "small"], default=None, help="model mode: 7b (GPU) or small"
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        choices=list(ATTENTIONS),
        default=None,
        help="engine mode: the attentions compared at every rank count > 1 (default: all)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="engine mode: timed questions per row (medians of TTFT and tok/s)",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="engine mode: write a PNG of the comparison here"
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    console, extra = Console(width=200), {}
    meta = {
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if args.mode == "engine":
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lvx-bench-chat-"))
        minutes = (args.minutes or [10.0])[0]
        rows = bench_engine(
            args.ranks, minutes, args.fps, args.new_tokens, workdir, args.attention, args.repeats
        )
        title = (
            f"lvx engine, tiny model, {minutes:g}-min synthetic video at {args.fps:g} fps, CPU "
            "ranks"
        )
        if args.plot:
            plot_engine(rows, args.plot)
    elif args.mode == "layouts":
        minutes, ranks = (
            (args.minutes or [10.0])[0],
            args.ranks[0] if args.ranks != [1, 2, 4] else 2,
        )
        rows = bench_layouts(args.layouts.split(","), ranks, minutes, args.fps, args.iters)
        for row in rows:
            row.pop("prefill_s_all")
        title = (
            f"video-prompt prefill per layout, small shapes, {minutes:g} min at {args.fps:g} "
            f"fps, {ranks} CPU ranks"
        )
    else:
        rows, title, extra = model_mode(args, console)
    console.print(_table(title, rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"meta": meta, "title": title, "rows": rows, **extra}
        args.out.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
