"""The terminal chat (`lvx chat`): load a video, then answer questions with streamed tokens.

Works with any `Engine` (in-process or a torchrun group). Ctrl-C during an answer stops that answer
only; the video and the conversation stay.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from lvx_app.engine.api import Engine, EngineError, GenerationParams, GroupFailed, VideoSummary
from lvx_app.engine.describe import describe_answer, describe_video, printable
from lvx_app.engine.launch import RemoteEngine
from lvx_app.engine.open import open_engine, session_config
from lvx_app.subtitles import Cue, SubtitleError, SubtitleTrack, resolve_subtitles
from lvx_app.video import VideoError, check_video_path

HELP = """commands:
  /help    this list
  /reset   forget the conversation, keep the video
  /stats   memory per rank, cached tokens, timings
  /quit    leave (Ctrl-D works too)
Ctrl-C stops the answer being written."""


class RateColumn(ProgressColumn):
    """Frames per second of the current stage."""

    def render(self, task) -> Text:  # type: ignore[override]
        return Text(f"{task.speed:6.1f} fr/s" if task.speed else "", style="progress.data.speed")


def load_with_progress(
    engine: Engine,
    console: Console,
    path: str,
    fps: float,
    max_frames: int | None,
    subtitles: Sequence[Cue] = (),
) -> VideoSummary:
    """Load a video showing one progress bar per stage (decode, encode, ...)."""
    columns = (
        TextColumn("{task.description:>8}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeRemainingColumn(),
    )
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as bar:
        tasks: dict[str, int] = {}

        def on_progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        return engine.load_video(
            path, fps, max_frames, progress=on_progress, subtitles=list(subtitles) or None
        )


@contextmanager
def _interrupts_go_to(engine: Engine) -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, lambda *_: engine.interrupt())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_answer(engine: Engine, console: Console, question: str, params: GenerationParams) -> str:
    pieces: list[str] = []
    with _interrupts_go_to(engine):
        for piece in engine.ask(question, params):
            pieces.append(piece)
            console.out(printable(piece), end="", highlight=False)
            console.file.flush()
    console.out("")
    console.print(f"[dim]{describe_answer(engine)}[/dim]")
    return "".join(pieces)


def print_stats(engine: Engine, console: Console) -> None:
    stats = engine.stats()
    table = Table(title="session")
    ranks = stats.get("ranks", [])
    if ranks:
        for key in ranks[0]:
            table.add_column(key)
        for row in ranks:
            table.add_row(*(str(v) for v in row.values()))
    console.print(table)
    for key, value in stats.items():
        if key != "ranks":
            console.print(f"{key}: {value}")


def read_line(console: Console, stdin: TextIO) -> str | None:
    """One line from the user; None at end of input."""
    if stdin.isatty():
        try:
            return console.input("[bold cyan]you ›[/] ")
        except EOFError:
            return None
    line = stdin.readline()
    if not line:
        return None
    console.print(f"you › {line.rstrip()}", highlight=False)
    return line.rstrip("\n")


def _command(engine: Engine, console: Console, line: str, params: GenerationParams) -> None:
    """Run one line the user typed: a /command or a question."""
    if line == "/help":
        console.print(HELP)
    elif line == "/reset":
        engine.reset()
        console.print("[dim]conversation cleared; the video stays loaded[/dim]")
    elif line == "/stats":
        print_stats(engine, console)
    elif line.startswith("/"):
        console.print(f"unknown command {line.split()[0]}; /help lists them")
    else:
        console.out("lvx › ", end="", highlight=False)
        stream_answer(engine, console, line, params)


def run_chat(
    engine: Engine,
    *,
    video: str | None,
    fps: float,
    max_frames: int | None = None,
    params: GenerationParams = GenerationParams(),
    console: Console | None = None,
    stdin: TextIO | None = None,
    subtitles: SubtitleTrack | None = None,
) -> int:
    """The REPL. Returns a process exit code."""
    console = console or Console(highlight=False)
    stdin = stdin or sys.stdin
    if video:
        try:
            summary = load_with_progress(
                engine, console, video, fps, max_frames, subtitles.cues if subtitles else ()
            )
        except EngineError as exc:
            console.print(f"[red]error:[/red] {exc}")
            return 2
        console.print(f"[green]video:[/green] {describe_video(summary)}")
        if subtitles is not None and subtitles.source:
            console.print(
                f"[green]subtitles:[/green] {summary.subtitle_lines} line(s) at the sampled "
                "frames, from "
                f"{subtitles.source}",
                highlight=False,
            )
    console.print("[dim]Ask about the video. /help lists commands.[/dim]")
    while True:
        try:
            line = read_line(console, stdin)
        except KeyboardInterrupt:
            console.print("\n[dim](use /quit or Ctrl-D to leave)[/dim]")
            continue
        if line is None or line.strip() in ("/quit", "/exit"):
            return 0
        line = line.strip()
        if not line:
            continue
        try:
            _command(engine, console, line, params)
        except EngineError as exc:
            console.print(f"[red]error:[/red] {exc}")
            if isinstance(exc, GroupFailed):
                return 1


def run_chat_command(
    *,
    video: str,
    gpus: int | None,
    ranks: int | None,
    params: GenerationParams,
    console: Console | None = None,
    subtitles: str = "auto",
    subtitle_lang: str | None = None,
    subtitle_encoding: str | None = None,
    **config_args: Any,
) -> int:
    """`lvx chat`: returns the process exit code."""
    console = console or Console(highlight=False)
    try:
        config = session_config(**config_args)
        check_video_path(video)  # fail before spending minutes loading a model
        track = resolve_subtitles(video, subtitles, subtitle_lang, subtitle_encoding)
    except (EngineError, VideoError, SubtitleError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    for note in track.notes:
        console.print(f"[yellow]warning:[/yellow] {note}", highlight=False)
    try:
        engine = open_engine(config, gpus, ranks, console)
    except EngineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except (
        KeyboardInterrupt
    ):  # Ctrl-C while the model loads: the group is already gone (RemoteEngine kills it)
        return 130
    try:
        code = run_chat(
            engine,
            video=video,
            fps=config.fps,
            max_frames=config.max_frames,
            params=params,
            console=console,
            subtitles=track,
        )
    except (
        KeyboardInterrupt
    ):  # Ctrl-C while the video loads: stop now, quietly, no rank left behind
        (engine.abort if isinstance(engine, RemoteEngine) else engine.close)()
        return 130
    except EngineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        code = 2
    engine.close()
    return code
