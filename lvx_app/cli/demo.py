"""`lvx demo`: the whole pipeline on a fresh machine, no downloads.

A synthetic video and a tiny random-weight checkpoint in a model family's published layout
(mPLUG-Owl3 unless `--model-family` names another) go through the same engine as `lvx chat`:
decode, encode, sharded visual tokens, LV-XAttn prefill and decoding, on 2 CPU ranks when no GPU is
visible. The answers are gibberish (random weights); the point is that every stage runs and how
long each takes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lvx_app.cli.chat import load_with_progress, print_seen_at
from lvx_app.cli.examples import CPU_RANKS, ready_lines, write_examples
from lvx_app.config import Config, GenerationConfig, ModelConfig
from lvx_app.defaults import default_cache_dir
from lvx_app.engine.describe import describe_answer, describe_video, printable
from lvx_app.engine.records import EngineError
from lvx_app.runtime.open import open_engine
from lvx_app.video.synthetic import make_video
from lvx_models.api import DEFAULT_FAMILY, FAMILIES, Family, family_named

QUESTIONS = ("What happens in this video?", "What colour is the first frame?")


ANSWER_TOKENS = 24  # each demo answer stops here: random weights rarely end one sooner


def prepare(workdir: Path, family: Family, generation: str) -> tuple[Path, Path]:
    """The tiny checkpoint and the synthetic video (made once, reused on later runs): one folder
    per family and generation, so switching either never reads another's checkpoint."""
    checkpoint = workdir / f"tiny-{family.name}-{generation}"
    if not (checkpoint / "config.json").exists():
        family.write_tiny(checkpoint, generation)
    video = workdir / "demo.mp4"
    if not video.exists():
        make_video(video, num_frames=300, fps=10, width=160, height=96)
    return checkpoint, video


def run_demo(
    config: Config,
    *,
    workdir: Path | None,
    generation: str | None,
    family: str | None = None,
    examples: Path | None = None,
    console: Console | None = None,
) -> int:
    """`lvx demo`: returns the process exit code. `family`: a name in `FAMILIES`; `generation`: a
    name among that family's generations (None: its default)."""
    console = console or Console(highlight=False, soft_wrap=True)
    try:
        chosen = family_named(family or DEFAULT_FAMILY)
    except ValueError as exc:
        console.print(f"[red]error:[/red] --model-family: {exc}")
        return 2
    try:
        named = chosen.generation(generation) if generation else chosen.default_generation
    except ValueError as exc:
        console.print(f"[red]error:[/red] --generation: {exc}")
        return 2
    generation = named.name
    parallel = config.parallel
    if parallel.ranks is None and not torch.cuda.is_available() and not parallel.gpus:
        parallel = replace(parallel, ranks=CPU_RANKS)  # the demo shows sharding, even on a CPU
    workdir = Path(workdir or default_cache_dir() / "demo")
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    checkpoint, video = prepare(workdir, chosen, generation)
    timings = {"make checkpoint + video": time.perf_counter() - t0}
    config = replace(
        config,
        model=ModelConfig(path=str(checkpoint)),
        video=replace(config.video, cache=False, subtitles="none"),
        parallel=replace(parallel, timeout_s=120.0),
        generation=GenerationConfig(max_new_tokens=ANSWER_TOKENS),
    )
    console.print(
        f"[bold]lvx demo[/bold]: tiny random-weight {chosen.title} ({generation}) in {checkpoint}"
    )
    console.print("[yellow]Random weights: the answers are gibberish; the pipeline runs.[/yellow]")
    try:
        stats = _converse(config, video, timings, console)
    except EngineError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 1
    console.print(_timings_table(timings, stats))
    files = write_examples(examples) if examples is not None else None
    others = [f.title for f in FAMILIES.values() if f is not chosen]
    finetunes = chosen.save_weights is not None
    _print_next_steps(console, checkpoint, video, files, finetunes=finetunes, others=others)
    return 0


def _print_next_steps(
    console: Console,
    checkpoint: Path,
    video: Path,
    files: dict[str, Path] | None,
    *,
    finetunes: bool,
    others: list[str],
) -> None:
    """The paths the demo made and a ready-to-run line for every command on them."""
    console.print("\n[bold]made[/bold]")
    console.print(f"  checkpoint  {checkpoint}\n  video       {video}", markup=False)
    for name, path in (files or {}).items():
        console.print(f"  {name:<11} {path}", markup=False)
    console.print("[bold]try next[/bold] (on this CPU; answers are short: random weights)")
    for line in ready_lines(checkpoint, video, files, finetunes=finetunes, others=others):
        console.out(f"  {line}", highlight=False)


def _converse(config: Config, video: Path, timings: dict[str, float], console: Console) -> dict:
    """Open the engine, load the video, ask the demo's questions; `timings` gets each step's."""
    t = time.perf_counter()
    with open_engine(config, console) as engine:
        timings["start ranks + load model"] = time.perf_counter() - t
        summary = load_with_progress(engine, console, str(video))
        timings["decode + encode video"] = summary.seconds
        console.print(f"[green]video:[/green] {escape(describe_video(summary))}")
        for i, question in enumerate(QUESTIONS, 1):
            console.print(f"[bold cyan]you ›[/] {escape(question)}")
            answer = "".join(engine.ask(question))
            console.print(f"[bold]lvx ›[/] {escape(printable(answer))}", highlight=False)
            print_seen_at(engine.last_answer, console)  # where in the video it looked
            console.print(f"[dim]{describe_answer(engine.last_answer)}[/dim]")
            timings[f"answer {i} (TTFT)"] = engine.last_answer.ttft_s
            timings[f"answer {i} (total)"] = engine.last_answer.total_s
        return engine.stats()


def _timings_table(timings: dict[str, float], stats: dict) -> Table:
    where = f"{stats['world size']} {stats['device'].split(':')[0]} rank(s)"
    table = Table(title=f"lvx demo timings ({where})")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for step, seconds in timings.items():
        table.add_row(step, f"{seconds:.2f}")
    return table
