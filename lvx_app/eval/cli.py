"""`lvx eval …`: Video-MME runs, shard merging and reports. Thin commands over importable
functions."""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import typer
from rich.console import Console

import lvx_app
from lvx_app.cli_options import CACHE_DIR, DECODE_TIMEOUT, TIMEOUT, new_app
from lvx_app.defaults import DEFAULT_MODEL
from lvx_app.eval.dataset import (
    Dataset,
    DatasetError,
    Question,
    load_dataset,
    parse_durations,
    parse_shard,
    select_questions,
)
from lvx_app.eval.extract import SCORING_MODES
from lvx_app.eval.prompt import PROMPT_VERSION
from lvx_app.eval.report import report_file
from lvx_app.eval.results import ResultsError, ResultsWriter, RunManifest, merge_results
from lvx_app.eval.runner import EvalSession, RunStats, open_engine_session, run_eval

SessionFactory = Callable[[], EvalSession]

eval_app = new_app(
    "eval", "Batch evaluation on Video-MME: run (resumable, shardable), merge shard files, report."
)


class EngineUnavailable(RuntimeError):
    """The engine (lvx_app.engine) is not part of this build."""


@dataclass
class VideoMMERun:
    out: Path
    stats: RunStats
    summary: dict[str, Any]
    missing_videos: list[str]


def default_out(
    model: str, fps: float, max_frames: int | None, subtitles: bool, shard: str | None
) -> Path:
    """``runs/videomme_<model>_fps<f>[_max<n>][_subs][_shard<i>of<k>].jsonl``: other settings, other
    file."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name) or "model"
    parts = [f"videomme_{name}_fps{fps:g}"]
    if max_frames:
        parts.append(f"max{max_frames}")
    if subtitles:
        parts.append("subs")
    if shard:
        i, k = shard.split("/")
        parts.append(f"shard{i}of{k}")
    return Path("runs") / ("_".join(parts) + ".jsonl")


def run_videomme(
    *,
    data: Path | str,
    session_factory: SessionFactory,
    out: Path | str | None = None,
    questions_file: Path | str | None = None,
    model: str = DEFAULT_MODEL,
    revision: str | None = None,
    fps: float = 1.0,
    max_frames: int | None = None,
    subtitles: bool = False,
    limit: int | None = None,
    durations: str | Sequence[str] | None = None,
    shard: str | None = None,
    scoring: str = "official",
    max_new_tokens: int = 16,
    console: Console | None = None,
    show_progress: bool = True,
) -> VideoMMERun:
    # long: to be split: it mixes several steps
    """Run (or resume) Video-MME and report it. ``session_factory`` is called once, only if some
    selected question is still unanswered; a session with a ``close()`` gets it called at the end. A
    session may also offer ``describe() -> dict`` (resolved revision, dtype, ranks…), kept in the
    header.

    Raises DatasetError / ResultsError with a message for the user; KeyboardInterrupt passes through
    after everything answered so far is on disk.
    """
    console = console or Console()
    _check_settings(scoring, fps, max_frames, max_new_tokens)
    dur = parse_durations(durations)
    ds = load_dataset(data, questions_file)
    selected = select_questions(ds.questions, dur, limit, parse_shard(shard))
    missing = _report_missing_videos(ds, selected, console)
    out_path = Path(out) if out else default_out(model, fps, max_frames, subtitles, shard)
    manifest = RunManifest(
        model=model,
        revision=revision,
        fps=fps,
        max_frames=max_frames,
        subtitles=subtitles,
        prompt_version=PROMPT_VERSION,
        scoring=scoring,
        max_new_tokens=max_new_tokens,
        dataset_file=str(ds.question_file),
        dataset_sha256=ds.sha256,
        lvx_version=lvx_app.__version__,
        durations=list(dur) if dur else None,
        limit=limit,
        shard=shard,
    )
    settings = dict(
        fps=fps,
        max_frames=max_frames,
        subtitles=subtitles,
        max_new_tokens=max_new_tokens,
        scoring=scoring,
    )
    with ResultsWriter(out_path, manifest) as writer:
        stats = _answer_pending(
            ds, selected, writer, session_factory, settings, console, show_progress
        )
    extra = {"missing_videos": missing, "failed_videos": stats.failed_videos}
    summary = report_file(out_path, scoring, {q.question_id for q in selected}, console, extra)
    return VideoMMERun(out_path, stats, summary, missing)


def _check_settings(scoring: str, fps: float, max_frames: int | None, max_new_tokens: int) -> None:
    if scoring not in SCORING_MODES:
        raise DatasetError(f"--scoring must be one of {', '.join(SCORING_MODES)}, got {scoring!r}.")
    if fps <= 0 or (max_frames is not None and max_frames < 1) or max_new_tokens < 1:
        raise DatasetError("--fps must be > 0, --max-frames >= 1 and --max-new-tokens >= 1.")


def _report_missing_videos(
    ds: Dataset, selected: Sequence[Question], console: Console
) -> list[str]:
    """The videoIDs of the selected questions whose video file is not there, said in one line."""
    missing = sorted({q.videoID for q in selected if ds.video_path(q) is None})
    if missing:
        n_q = sum(ds.video_path(q) is None for q in selected)
        shown = ", ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        console.print(
            f"[yellow]{len(missing)} video(s) missing, {n_q} question(s) skipped: {shown} "
            f"(looked in {ds.root}/data/ and video/ for <videoID>.mp4|.MP4|.mkv); continuing with "
            "the rest."
        )
    return missing


def _answer_pending(
    ds: Dataset,
    selected: Sequence[Question],
    writer: ResultsWriter,
    session_factory: SessionFactory,
    settings: dict[str, Any],
    console: Console,
    show_progress: bool,
) -> RunStats:
    """Start the session only if some selected question is unanswered, answer those, and close
    it."""
    done = sum(q.question_id in writer.done for q in selected)
    todo = [
        q for q in selected if q.question_id not in writer.done and ds.video_path(q) is not None
    ]
    console.print(
        f"Video-MME: {len(selected)} question(s) selected, {done} already in {writer.path}, "
        f"{len(todo)} to answer."
    )
    if not todo:
        return RunStats()
    session = session_factory()
    describe = getattr(session, "describe", None)
    if callable(describe):
        writer.manifest.engine = dict(describe())
    try:
        return run_eval(
            ds, selected, session, writer, **settings, console=console, show_progress=show_progress
        )
    except KeyboardInterrupt:
        console.print(
            f"[yellow]interrupted: every answer so far is in {writer.path}; rerun the same command "
            "to resume."
        )
        raise
    finally:
        close = getattr(session, "close", None)
        if callable(close):
            close()


def engine_session_factory(
    model: str, revision: str | None, gpus: int | None, ranks: int | None, **engine_options: Any
) -> SessionFactory:
    """A factory for the engine's eval session: ``lvx_app.eval.runner.open_engine_session(model=…,
    revision=…, gpus=…, ranks=…, **engine_options)`` (options such as timeouts and the cache
    folder). Whether the engine is part of this build is checked now (cheap); the engine starts only
    when the factory is called."""
    try:
        importlib.import_module("lvx_app.engine")
    except ModuleNotFoundError as e:
        if e.name and (e.name == "lvx_app.engine" or e.name.startswith("lvx_app.engine.")):
            raise EngineUnavailable(
                "the model engine (lvx_app.engine) is not available in this build"
            ) from None
        raise
    return lambda: open_engine_session(
        model=model, revision=revision, gpus=gpus, ranks=ranks, **engine_options
    )


def _fail(message: str, code: int = 1) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@eval_app.command()
def videomme(
    data: Path = typer.Option(
        ..., "--data", help="Folder with videomme/test-*.parquet, data/<videoID>.mp4, subtitle/."
    ),
    model: str = typer.Option(
        DEFAULT_MODEL, "--model", help="Checkpoint folder or Hugging Face id."
    ),
    revision: Optional[str] = typer.Option(
        None, "--revision", help="Checkpoint revision to pin (recorded)."
    ),
    fps: float = typer.Option(1.0, "--fps", help="Frames sampled per second of video."),
    max_frames: Optional[int] = typer.Option(
        None, "--max-frames", help="Cap on frames per video (thinned uniformly)."
    ),
    gpus: Optional[int] = typer.Option(
        None, "--gpus", help="GPUs (one rank each); 0 = CPU. Default: 1 if a GPU is visible."
    ),
    ranks: Optional[int] = typer.Option(None, "--ranks", help="CPU ranks with --gpus 0."),
    subtitles: bool = typer.Option(
        False,
        "--subtitles/--no-subtitles",
        help="Official w/-subs setting: lines at the sampled frames.",
    ),
    limit: Optional[int] = typer.Option(
        None, "--limit", help="Only the first K selected questions."
    ),
    durations: Optional[str] = typer.Option(
        None, "--durations", help="Comma list of short,medium,long."
    ),
    shard: Optional[str] = typer.Option(
        None, "--shard", help="i/k: this machine's share (0-based), split by video."
    ),
    scoring: str = typer.Option(
        "official", "--scoring", help="official (unparsed dropped) or strict (unparsed = wrong)."
    ),
    max_new_tokens: int = typer.Option(
        16, "--max-new-tokens", help="Answer length cap; the letter is the reply."
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Results JSONL (resumed if it exists). Default under runs/."
    ),
    questions: Optional[Path] = typer.Option(
        None, "--questions", help="Question file, if not under --data/videomme/."
    ),
    timeout: float = TIMEOUT,
    decode_timeout: float = DECODE_TIMEOUT,
    cache_dir: Optional[Path] = CACHE_DIR,
) -> None:
    # long: to be split: it mixes several steps
    """Answer Video-MME with the model, resumably; report accuracy by duration, domain,
    sub-category, task."""
    try:
        options = {"timeout": timeout, "decode_timeout": decode_timeout}
        if cache_dir is not None:
            options["cache_dir"] = str(cache_dir)
        factory = engine_session_factory(model, revision, gpus, ranks, **options)
    except EngineUnavailable as e:
        raise _fail(f"{e}; `lvx eval merge` and `lvx eval report` still work.", code=2) from None
    engine_error = getattr(sys.modules.get("lvx_app.engine"), "EngineError", None)
    user_errors = (DatasetError, ResultsError) + (
        (engine_error,) if isinstance(engine_error, type) else ()
    )
    try:
        run_videomme(
            data=data,
            session_factory=factory,
            out=out,
            questions_file=questions,
            model=model,
            revision=revision,
            fps=fps,
            max_frames=max_frames,
            subtitles=subtitles,
            limit=limit,
            durations=durations,
            shard=shard,
            scoring=scoring,
            max_new_tokens=max_new_tokens,
        )
    except user_errors as e:  # errors the user can act on: one sentence, no traceback
        raise _fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@eval_app.command()
def merge(
    out: Path = typer.Argument(..., help="New merged results file."),
    inputs: list[Path] = typer.Argument(..., help="Shard results files."),
    keep_first: bool = typer.Option(
        False, "--keep-first", help="On a question answered twice keep the first file's answer."
    ),
    scoring: str = typer.Option("official", "--scoring", help="official or strict."),
) -> None:
    """Combine shard JSONL files (same settings, no question twice) and report the whole."""
    if scoring not in SCORING_MODES:
        raise _fail(f"--scoring must be one of {', '.join(SCORING_MODES)}.")
    try:
        merged = merge_results(inputs, out, keep_first=keep_first)
    except ResultsError as e:
        raise _fail(str(e)) from None
    Console().print(f"merged {merged.records} answers from {len(inputs)} file(s) into {merged.out}")
    report_file(merged.out, scoring)


@eval_app.command()
def report(
    results: Path = typer.Argument(..., help="Results JSONL."),
    scoring: str = typer.Option("official", "--scoring", help="official or strict."),
) -> None:
    """Re-score a results file (either scoring mode) and rewrite its summary, plot and official
    JSON."""
    if scoring not in SCORING_MODES:
        raise _fail(f"--scoring must be one of {', '.join(SCORING_MODES)}.")
    if not results.is_file():
        raise _fail(f"{results} does not exist.")
    try:
        report_file(results, scoring)
    except ResultsError as e:
        raise _fail(str(e)) from None
