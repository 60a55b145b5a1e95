"""`lvx demo`: the whole pipeline on a fresh machine, no downloads.

A synthetic video and a tiny random-weight checkpoint in the official mPLUG-Owl3 layout go through
the same engine as `lvx chat`: decode, encode, sharded visual tokens, LV-XAttn prefill and decoding,
on 2 CPU ranks when no GPU is visible. The answers are gibberish (random weights); the point is that
every stage runs and how long each takes.
"""

from __future__ import annotations

import time
from contextlib import closing
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from lvx_app.engine.api import EngineError, GenerationParams
from lvx_app.engine.describe import describe_answer, describe_video
from lvx_app.engine.open import open_engine, session_config
from lvx_app.frontends.terminal import load_with_progress
from lvx_app.video.synthetic import make_video
from lvx_models.mplug_owl3.config import FORMS
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

QUESTIONS = ("What happens in this video?", "What colour is the first frame?")


def prepare(workdir: Path, generation: str) -> tuple[Path, Path]:
    """The tiny checkpoint and the synthetic video (made once, reused on later runs)."""
    checkpoint = workdir / f"tiny-{generation}"
    if not (checkpoint / "config.json").exists():
        write_tiny_checkpoint(checkpoint, generation)
    video = workdir / "demo.mp4"
    if not video.exists():
        make_video(video, num_frames=300, fps=10, width=160, height=96)
    return checkpoint, video


def run_demo(
    *,
    gpus: int | None,
    ranks: int | None,
    workdir: Path | None,
    generation: str,
    console: Console | None = None,
) -> int:
    # long: the demo's steps in order, each printed as it runs
    console = console or Console(highlight=False)
    if generation not in FORMS:
        console.print(f"[red]error:[/red] --generation must be one of {', '.join(FORMS)}")
        return 2
    if ranks is None and not torch.cuda.is_available() and not gpus:
        ranks = 2
    workdir = Path(workdir or Path.home() / ".cache" / "lvx" / "demo")
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    checkpoint, video = prepare(workdir, generation)
    timings = {"make checkpoint + video": time.perf_counter() - t0}
    config = session_config(
        model=str(checkpoint),
        revision=None,
        fps=1.0,
        max_frames=None,
        dtype="auto",
        kv_cache=None,
        timeout=120.0,
        use_cache=False,
        cache_dir=None,
    )
    console.print(
        f"[bold]lvx demo[/bold]: tiny random-weight mPLUG-Owl3 ({generation}) in {checkpoint}"
    )
    console.print(
        "[yellow]The weights are random, so the answers are gibberish: this shows the pipeline "
        "runs.[/yellow]"
    )
    try:
        t = time.perf_counter()
        with closing(open_engine(config, gpus, ranks, console)) as engine:
            timings["start ranks + load model"] = time.perf_counter() - t
            summary = load_with_progress(engine, console, str(video), 1.0, None)
            timings["decode + encode video"] = summary.seconds
            console.print(f"[green]video:[/green] {describe_video(summary)}")
            for i, question in enumerate(QUESTIONS, 1):
                console.print(f"[bold cyan]you ›[/] {question}")
                answer = "".join(engine.ask(question, GenerationParams(max_new_tokens=24)))
                console.print(f"[bold]lvx ›[/] {answer}", highlight=False)
                console.print(f"[dim]{describe_answer(engine)}[/dim]")
                timings[f"answer {i} (TTFT)"] = engine.last_answer.ttft_s
                timings[f"answer {i} (total)"] = engine.last_answer.total_s
            stats = engine.stats()
    except EngineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    table = Table(
        title=f"lvx demo timings ({stats['world size']} {stats['device'].split(':')[0]} rank(s))"
    )
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for step, seconds in timings.items():
        table.add_row(step, f"{seconds:.2f}")
    console.print(table)
    return 0
