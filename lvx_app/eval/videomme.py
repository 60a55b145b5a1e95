"""A Video-MME run: select the questions, answer those not yet in the results file, report.

The run talks to the model only through an `EvalSession` made by a factory, called once and only
when some selected question is still unanswered: a resumed run that is complete never starts the
engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from lvx_app.config import Config
from lvx_app.eval.dataset import (
    Dataset,
    DatasetError,
    Question,
    load_dataset,
    parse_durations,
    parse_shard,
    select_questions,
)
from lvx_app.eval.prompt import PROMPT_VERSION
from lvx_app.eval.report import report_file
from lvx_app.eval.results import ResultsWriter, RunManifest
from lvx_app.eval.runner import EvalSession, RunStats, run_eval
from lvx_app.speech.choice import missing_line, speech_available
from lvx_app.version import __version__

SessionFactory = Callable[[], EvalSession]


@dataclass
class VideoMMERun:
    out: Path
    stats: RunStats
    summary: dict[str, Any]
    missing_videos: list[str]


def default_out(config: Config) -> Path:
    """``runs/videomme_<model>_fps<f>[_max<n>][_subs][_shard<i>of<k>].jsonl``: other settings, other
    file."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(config.model.path.rstrip("/")).name) or "model"
    parts = [f"videomme_{name}_fps{config.video.fps:g}"]
    if config.video.max_frames:
        parts.append(f"max{config.video.max_frames}")
    if config.eval.subtitles != "none":
        parts.append({"official": "subs", "speech": "speech"}[config.eval.subtitles])
    if config.eval.shard:
        i, k = config.eval.shard.split("/")
        parts.append(f"shard{i}of{k}")
    return Path("runs") / ("_".join(parts) + ".jsonl")


def manifest_for(config: Config, ds: Dataset, durations: Sequence[str] | None) -> RunManifest:
    """The results file's header: every setting that changes the answers."""
    ev = config.eval
    return RunManifest(
        model=config.model.path,
        revision=config.model.revision,
        fps=config.video.fps,
        max_frames=config.video.max_frames,
        subtitles=ev.subtitles,
        prompt_version=PROMPT_VERSION,
        scoring=ev.scoring,
        max_new_tokens=config.generation.max_new_tokens,
        dataset_file=str(ds.question_file),
        dataset_sha256=ds.sha256,
        lvx_version=__version__,
        durations=list(durations) if durations else None,
        limit=ev.limit,
        shard=ev.shard,
    )


def run_videomme(
    config: Config,
    session_factory: SessionFactory,
    *,
    console: Console | None = None,
    show_progress: bool = True,
) -> VideoMMERun:
    """Run (or resume) Video-MME as `config.eval` says and report it. A session with a `close()`
    gets it called at the end; one with `describe() -> dict` (revision, dtype, ranks…) is recorded
    in the results header.

    Raises DatasetError / ResultsError with a message for the user; KeyboardInterrupt passes through
    after everything answered so far is on disk.
    """
    console = console or Console()
    ev = config.eval
    if ev.subtitles == "speech" and not speech_available():  # before any video is loaded
        raise DatasetError(missing_line().replace("--subtitles none", "--subtitles official"))
    durations = parse_durations(ev.durations)
    ds = load_dataset(ev.data, ev.questions)
    selected = select_questions(ds.questions, durations, ev.limit, parse_shard(ev.shard))
    missing = _report_missing_videos(ds, selected, console)
    out_path = Path(ev.out) if ev.out else default_out(config)
    with ResultsWriter(out_path, manifest_for(config, ds, durations)) as writer:
        stats = _answer_pending(
            ds, selected, writer, session_factory, config, console, show_progress
        )
    extra = {"missing_videos": missing, "failed_videos": stats.failed_videos}
    asked = {q.question_id for q in selected}
    summary = report_file(out_path, ev.scoring, asked, console, extra)
    return VideoMMERun(out_path, stats, summary, missing)


def _report_missing_videos(
    ds: Dataset, selected: Sequence[Question], console: Console
) -> list[str]:
    """The videoIDs of the selected questions whose video file is not there, said in one line."""
    missing = sorted({q.videoID for q in selected if ds.video_path(q) is None})
    if missing:
        n_q = sum(ds.video_path(q) is None for q in selected)
        shown = ", ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        console.print(
            f"[yellow]{len(missing)} video(s) missing, {n_q} question(s) skipped: {shown} (looked "
            f"in {ds.root}/data/ and video/ for <videoID>.mp4|.MP4|.mkv); continuing with the rest."
        )
    return missing


def _answer_pending(
    ds: Dataset,
    selected: Sequence[Question],
    writer: ResultsWriter,
    session_factory: SessionFactory,
    config: Config,
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
            ds, selected, session, writer, config, console=console, show_progress=show_progress
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
