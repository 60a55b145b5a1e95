"""Time to first token and decode speed of a chat turn in the real `lvx` engine, LV-XAttn against
the baselines, on CPU ranks.

Tiny random-weight checkpoint, a synthetic video, world sizes 1/2/4 CPU ranks under torchrun: load
the video, then time one question (TTFT, decode tok/s). At every world size > 1 the same chat runs
once per entry of `ATTENTIONS` (LV-XAttn, Ring pass-KV, all-gather K/V, installed in the engine from
outside by scripts/baselines/engine.py), with the video-prompt prefill time and the attention bytes
each rank sent while loading and while answering. Rows are written as they are measured. The same
chat at 7B shapes on one GPU: scripts/bench_chat_7b.py; prefill per layout:
scripts/bench_layouts.py.

    python scripts/bench_chat.py --out runs/bench_chat_cpu.json
    python scripts/bench_chat.py --ranks 1 2 4 --plot runs/attention.png --out runs/attention.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from scripts.baselines.engine import baseline_entry
from scripts.harness import Rows, command_line, machine, pyplot, save_figure, show

QUESTION = "What happens in the video, and when does the scene change?"


# One entry per engine variant compared: its label, the attention scripts/baselines/engine.py
# installs and the config options that select it. Adding a row (e.g. another schedule option) is
# one entry here.
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


def bench_engine(args, workdir: Path, rows: Rows) -> None:
    """One row per (ranks, attention), each saved as it is measured."""
    from lvx_app.config import Config
    from lvx_app.runtime.open import open_engine
    from lvx_app.video.synthetic import make_video
    from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(workdir / "tiny-g2", "g2")
    video = workdir / f"video_{args.minutes:g}min.mp4"
    if not video.exists():
        make_video(video, num_frames=int(args.minutes * 60 * 2), fps=2, width=96, height=64)
    for n in args.ranks:
        for name in (args.attention or list(ATTENTIONS)) if n > 1 else ["LV-XAttn (auto)"]:
            attention, options = ATTENTIONS[name]
            config = Config.from_options(
                model=str(checkpoint), cache=False, gpus=0, ranks=n, **options
            )
            t0 = time.perf_counter()
            engine = open_engine(config, entry=baseline_entry(attention))
            start_s = time.perf_counter() - t0
            try:
                row = _engine_row(engine, video, args.fps, args.new_tokens, args.repeats)
            finally:
                engine.close()
            answer = row.pop("answer")
            rows.add(
                {
                    "attention": name if n > 1 else "one rank",
                    "ranks": n,
                    "start_s": start_s,
                    **row,
                    "answer_chars": len(answer),
                    "answer_crc32": zlib.crc32(answer.encode()),
                }
            )


def plot_engine(rows: list[dict], path: Path) -> None:
    """TTFT, decode tokens/s and video-prompt prefill per attention and rank count, one panel
    each."""
    plt = pyplot()
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
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="CPU world sizes")
    parser.add_argument("--minutes", type=float, default=10.0, help="video length")
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--attention",
        nargs="+",
        choices=list(ATTENTIONS),
        default=None,
        help="the attentions compared at every rank count > 1 (default: all)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed questions per row (medians of TTFT, tok/s)"
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of the comparison here")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here, each as it comes")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    title = (
        f"lvx engine, tiny model, {args.minutes:g}-min synthetic video at {args.fps:g} fps, CPU "
        "ranks"
    )
    rows = Rows(args.out, title=title, command=command_line(), machine=machine())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lvx-bench-chat-"))
    bench_engine(args, workdir, rows)
    show(title, rows.rows)
    if args.plot:
        plot_engine(rows.rows, args.plot)


if __name__ == "__main__":
    main()
