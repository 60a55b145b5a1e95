"""`lvx chat`: load a video, then answer questions in the terminal with streamed tokens.

Works with any `Engine` (in-process or a torchrun group). Ctrl-C during an answer stops that answer
only; the video and the conversation stay. Under a torchrun you start yourself (several machines),
the same command runs as one rank of the group: rank 0 reads the questions, the others follow it.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape
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

from lvx_app.cli.options import exit_code
from lvx_app.config import Config
from lvx_app.engine.describe import (
    describe_answer,
    describe_video,
    placed_line,
    printable,
    shortened,
)
from lvx_app.engine.moments import label, seen_line
from lvx_app.engine.records import AnswerStats, EngineError, GroupFailed, VideoRequest, VideoSummary
from lvx_app.parallel.group import run_rank
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_app.runtime.engine_handle import Engine
from lvx_app.runtime.open import open_engine
from lvx_app.runtime.rank_main import follower_line, join_group
from lvx_app.subtitles import SubtitleTrack
from lvx_app.video import VideoError, check_video_path
from lvx_app.video.plan import format_timestamp

HELP = """commands:
  /help    this list
  /reset   forget the conversation, keep the video
  /stats   memory per rank, prompt and text tokens, timings
  /evidence  every moment of the video the last answer looked at, with its share
  /transcript  what is said in the video, with times (its speech transcribed)
  /transcript words  the same, each line followed by its words' start times
  /transcript save FILE.srt  the transcript as subtitles you can keep (FILE.vtt: with each
             word's time, as WebVTT karaoke timestamps)
  /quit    leave (Ctrl-D works too)
Ctrl-C stops the answer being written."""


class RateColumn(ProgressColumn):
    """Frames per second of the current stage."""

    def render(self, task) -> Text:  # type: ignore[override]
        return Text(f"{task.speed:6.1f} fr/s" if task.speed else "", style="progress.data.speed")


def load_with_progress(engine: Engine, console: Console, video: str | VideoRequest) -> VideoSummary:
    """Load a video (a path: the engine's options) showing one progress bar per stage (decode,
    encode, ...)."""
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
        tasks: dict[str, Any] = {}

        def on_progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        return engine.load_video(video, progress=on_progress)


@contextmanager
def _interrupts_go_to(engine: Engine) -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, lambda *_: engine.interrupt())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_answer(engine: Engine, console: Console, question: str) -> str:
    pieces: list[str] = []
    with _interrupts_go_to(engine):
        for piece in engine.ask(question):
            pieces.append(piece)
            console.out(printable(piece), end="", highlight=False)
            console.file.flush()
    console.out("")
    print_seen_at(engine.last_answer, console)
    console.print(f"[dim]{describe_answer(engine.last_answer)}[/dim]")
    return "".join(pieces)


def print_seen_at(answer: AnswerStats | None, console: Console) -> None:
    """One line under the answer: the moments of the video it looked at most."""
    line = seen_line(getattr(answer, "evidence", None) or [])
    if line:
        console.print(line, style="cyan", highlight=False, markup=False)


def print_evidence(answer: AnswerStats | None, console: Console) -> None:
    """`/evidence`: every moment the last answer looked at, largest share first."""
    found = getattr(answer, "evidence", None)
    if not found:
        console.print("no evidence yet: ask a question about the video (with --evidence)")
        return
    for moment in found:
        console.print(f"{label(moment):>20}  {moment.share:6.1%}", highlight=False, markup=False)


def print_transcript(summary: VideoSummary | None, console: Console, words: bool = False) -> None:
    """`/transcript`: the video's speech as transcribed, one line per cue with its times; with
    `words` (`/transcript words`) each cue's words follow, each after its start time."""
    cues = getattr(summary, "transcript", None)
    if not cues:
        console.print(no_transcript_line(summary), highlight=False, markup=False)
        return
    for cue in cues:
        times = f"{format_timestamp(cue.start)}-{format_timestamp(cue.end)}"
        console.print(f"{times:>17}  {printable(cue.text)}", highlight=False, markup=False)
        if words and cue.words:
            said = "  ".join(f"{word_time(s)} {printable(w)}" for s, _, w in cue.words)
            console.print(f"{'':>17}  {said}", highlight=False, markup=False)
    if words and not any(cue.words for cue in cues):
        console.print(NO_WORD_TIMES, highlight=False, markup=False)


NO_WORD_TIMES = (
    "no word times: this transcript was read back from a cache entry saved without them; remove "
    "it (`lvx cache ls` shows its id, `lvx cache rm ID`) and load the video again"
)


def word_time(seconds: float) -> str:
    """A word's start to the hundredth of a second: "0:02.42", "12:31.05", "1:02:03.10"."""
    whole, hundredths = divmod(round(max(0.0, seconds) * 100), 100)
    return f"{format_timestamp(whole)}.{hundredths:02d}"


def save_transcript(summary: VideoSummary | None, name: str, console: Console) -> None:
    """`/transcript save FILE`: the transcript written as an SRT file, or as WebVTT with each
    word's time when FILE ends in .vtt."""
    from lvx_app.subtitles import write_srt, write_vtt

    cues = getattr(summary, "transcript", None)
    if not cues:
        console.print(no_transcript_line(summary), highlight=False, markup=False)
        return
    if not name:
        console.print("name the file: /transcript save talk.srt (or talk.vtt)", markup=False)
        return
    vtt = name.lower().endswith(".vtt")
    try:
        path = (write_vtt if vtt else write_srt)(Path(name).expanduser(), cues)
    except OSError as exc:
        console.print(f"could not write {name}: {exc.strerror or exc}", markup=False)
        return
    timed = " with their words' times" if vtt and any(c.words for c in cues) else ""
    console.print(f"saved {len(cues)} cue(s){timed} to {path}", highlight=False, markup=False)


def no_transcript_line(summary: VideoSummary | None) -> str:
    """Why `/transcript` has nothing to show, and what would give one where something would."""
    from lvx_app.speech.audio import audio_duration
    from lvx_app.speech.choice import install_hint, speech_available

    if summary is None:
        return "no transcript: no video is loaded"
    if summary.subtitle_source:
        return f"no transcript: the subtitles came from {printable(summary.subtitle_source)}"
    if not audio_duration(summary.path):
        return "no transcript: the video has no audio track"
    if not speech_available():
        return f"no transcript: transcribing speech needs faster-whisper ({install_hint()})"
    return "no transcript: no speech was found, or --subtitles none was given (--subtitles speech)"


RANKS_PER_TABLE = 4  # keeps a table of ranks within 80 columns


def rank_tables(ranks: list[dict[str, Any]]) -> list[Table]:
    """The ranks' rows of `/stats`, one row per figure and a column per rank (up to four ranks a
    table), so the table fits 80 columns however many figures a rank reports."""
    keys = list(dict.fromkeys(k for row in ranks for k in row if k != "rank"))
    tables = []
    for first in range(0, len(ranks), RANKS_PER_TABLE):
        group = ranks[first : first + RANKS_PER_TABLE]
        table = Table(title="per rank" if first == 0 else None)
        table.add_column("", overflow="fold")
        for row in group:
            table.add_column(f"rank {row.get('rank', '?')}", justify="right", no_wrap=True)
        for key in keys:
            table.add_row(key, *(str(row.get(key, "")) for row in group))
        tables.append(table)
    return tables


def print_stats(engine: Engine, console: Console) -> None:
    stats = engine.stats()
    for key, value in stats.items():
        if key != "ranks":
            console.print(f"{key}: {value}", highlight=False, markup=False)
    for table in rank_tables(stats.get("ranks", [])):
        console.print(table)


def read_line(console: Console, stdin: TextIO) -> str | None:
    """One line from the user; None at end of input."""
    if stdin.isatty():
        try:
            return console.input("[bold cyan]you ›[/] ")
        except EOFError:  # Ctrl-D: leave the shell's prompt on a line of its own
            console.out("")
            return None
    line = stdin.readline()
    if not line:
        return None
    console.print(f"you › {printable(shortened(line.rstrip()))}", highlight=False, markup=False)
    return line.rstrip("\n")


def _command(engine: Engine, console: Console, line: str) -> None:
    """Run one line the user typed: a /command or a question."""
    if line == "/help":
        console.print(HELP)
    elif line == "/reset":
        engine.reset()
        console.print("[dim]conversation cleared; the video stays loaded[/dim]")
    elif line == "/stats":
        print_stats(engine, console)
    elif line == "/evidence":
        print_evidence(engine.last_answer, console)
    elif line in ("/transcript", "/transcript words"):
        print_transcript(engine.loaded, console, words=line.endswith("words"))
    elif line.startswith("/transcript save"):
        save_transcript(engine.loaded, line.removeprefix("/transcript save").strip(), console)
    elif line.startswith("/"):
        console.print(f"unknown command {line.split()[0]}; /help lists them", markup=False)
    else:
        engine.check_question(line)  # a pasted book is refused before anything is printed
        console.out("lvx › ", end="", highlight=False)
        stream_answer(engine, console, line)


def run_chat(
    engine: Engine,
    *,
    video: str | None,
    subtitles: SubtitleTrack | None = None,
    console: Console | None = None,
    stdin: TextIO | None = None,
) -> int:
    """Load `video` (if given; with `subtitles`, or those the config's `--subtitles` finds), then
    the REPL. Returns a process exit code."""
    console = console or Console(highlight=False, soft_wrap=True)
    stdin = stdin or sys.stdin
    if isinstance(stdin, io.TextIOWrapper) and not stdin.isatty():
        # a piped byte that is not UTF-8 (Latin-1 "caf\xe9") is read as U+FFFD, not a crash
        stdin.reconfigure(errors="replace")
    if video:
        cues = tuple(subtitles.cues) if subtitles is not None else None
        speech = getattr(subtitles, "speech", False)  # the ranks transcribe it (`_subtitles`)
        request = VideoRequest(video, engine.config.video, cues, speech=speech)
        try:
            summary = load_with_progress(engine, console, request)
        except EngineError as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            return exit_code(exc)
        console.print(f"[green]video:[/green] {escape(describe_video(summary))}")
        source = (subtitles.source if subtitles is not None else "") or summary.subtitle_source
        if source:
            console.print(
                f"[green]subtitles:[/green] {escape(placed_line(summary, str(source)))}",
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
            _command(engine, console, line)
        except EngineError as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            if isinstance(exc, GroupFailed):
                return 1


def _subtitles(video: str, config: Config, console: Console) -> SubtitleTrack:
    """The subtitles `--subtitles` asks for, resolved before the model loads (a bad file fails
    fast), and whether the ranks transcribe the speech (`speech`)."""
    request = VideoRequest(video, config.video)
    track = request.subtitle_track()
    track.speech = request.resolved(track).speech  # a missing [speech] extra fails here, fast
    for note in track.notes:
        console.print(f"[yellow]warning:[/yellow] {escape(note)}", highlight=False)
    return track


def run_chat_command(video: str, config: Config, console: Console | None = None) -> int:
    """`lvx chat`: returns the process exit code."""
    console = console or Console(highlight=False, soft_wrap=True)
    if under_torchrun():
        return run_rank(lambda: _chat_as_rank(video, config, console), "lvx chat")
    try:
        check_video_path(video)  # fail before spending minutes loading a model
        track = _subtitles(video, config, console)
    except (VideoError, EngineError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    try:
        engine = open_engine(config, console)
    except EngineError as exc:  # the model named cannot be used here (a path, its files, memory)
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads: RemoteEngine already killed the group
        return 130
    try:
        code = run_chat(engine, video=video, subtitles=track, console=console)
    except KeyboardInterrupt:  # Ctrl-C while the video loads: stop now, no rank left behind
        engine.abort()
        return 130
    engine.close()
    return code


def under_torchrun() -> bool:
    """Whether this process is a rank of a torchrun group the user started (several machines)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LVX_LINK" not in os.environ


def _chat_as_rank(video: str, config: Config, console: Console) -> int | None:
    """One rank of a user-started torchrun group: rank 0 runs the chat, the others follow it."""
    session, channel = join_group(config)
    line = follower_line("lvx chat", channel)
    if line is not None:
        console.print(line, markup=False)
        worker_loop(session, channel)
        return None
    driver = GroupDriver(session, channel, config)
    try:
        track = _subtitles(video, config, console) if Path(video).exists() else None
        return run_chat(driver, video=video, subtitles=track, console=console)
    except EngineError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return exit_code(exc)
    finally:
        driver.close()
