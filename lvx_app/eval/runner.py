"""The evaluation loop: each video is loaded once and all of its pending questions are answered
against it.

The loop talks to the engine only through :class:`EvalSession`, so it runs the same against the real
torchrun worker group, an in-process engine, or a test double; each video is one `VideoRequest`
built from the run's config. Every answer is written (flushed,
fsynced) before the next question is asked: Ctrl-C or an exception loses nothing already answered,
and a rerun skips it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from lvx_app.config import Config, VideoConfig, updated
from lvx_app.engine.records import QuestionTooLong, VideoRequest
from lvx_app.eval.dataset import Dataset, Question
from lvx_app.eval.extract import extract
from lvx_app.eval.prompt import build_prompt
from lvx_app.eval.results import ResultsWriter
from lvx_app.runtime.service import EngineService
from lvx_app.subtitles import Cue, load_srt, select_lines


@dataclass
class VideoInfo:
    """What :meth:`EvalSession.load_video` reports about the video it made resident."""

    timestamps: list[float]
    """Seconds of each sampled frame, in order, as decoded (real pts, not ``i / fps``). The subtitle
    lines
    given to the model are chosen from these, per the official protocol."""
    duration_s: float | None = None
    """Length of the video in seconds, if known."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything worth keeping with the answers, JSON-serialisable (visual tokens, decode/encode
    seconds, ranks)."""
    transcript: list[Cue] = field(default_factory=list)
    """The video's speech transcribed, with ``--subtitles speech``: the lines at the sampled frames
    go into the prompt as the official subtitles would."""

    @property
    def n_frames(self) -> int:
        return len(self.timestamps)


@runtime_checkable
class EvalSession(Protocol):
    """One model held ready for many videos; the only thing the eval loop needs from the engine.

    The loop calls, per video: ``load_video`` once, ``ask`` once per question, then ``reset``. It
    also calls ``reset`` before giving up on a video whose load failed. It never calls ``ask``
    without a loaded video.

    Optional extras, used when present: ``close()`` (called by
    :func:`lvx_app.eval.videomme.run_videomme` at the end), ``describe() -> dict`` (kept in the
    results header), and an ``answer_info`` attribute (a dict about the last ``ask``: tokens, time
    to first token, truncated…) kept in each answer record.
    """

    def load_video(self, request: VideoRequest) -> VideoInfo:
        """Decode ``request.path`` at ``request.video.fps`` frames per second (at most
        ``max_frames``, thinned uniformly over the whole video when there are more; None = no cap),
        encode the frames and keep the visual tokens resident for the following ``ask`` calls.
        Raise an exception if the file cannot be used."""
        ...

    def ask(self, prompt: str, max_new_tokens: int) -> str:
        """Answer one standalone user turn about the loaded video and return the generated text.

        ``prompt`` is the whole user text (question, options, maybe subtitle lines); the engine puts
        the video where the model's chat template wants it. Greedy decoding, at most
        ``max_new_tokens`` tokens. No chat history is carried from one ``ask`` to the next: every
        question is answered as if first.
        """
        ...

    def reset(self) -> None:
        """Drop the loaded video (visual tokens, caches) so the next ``load_video`` starts clean."""
        ...


@dataclass
class RunStats:
    answered: int = 0
    already_done: int = 0
    missing_video: int = 0  # questions skipped because their video file is missing
    # videoID -> error, questions not answered
    failed_videos: dict[str, str] = field(default_factory=dict)
    # questions the engine refused as too long: recorded with an empty response (scored wrong)
    refused: int = 0
    seconds: float = 0.0


def group_by_video(questions: Sequence[Question]) -> dict[str, list[Question]]:
    """Questions grouped by ``videoID``, videos in first-appearance order, questions in file
    order."""
    groups: dict[str, list[Question]] = {}
    for q in questions:
        groups.setdefault(q.videoID, []).append(q)
    return groups


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )


def run_eval(
    dataset: Dataset,
    questions: Sequence[Question],
    session: EvalSession,
    writer: ResultsWriter,
    config: Config,
    *,
    console: Console | None = None,
    show_progress: bool = True,
    max_consecutive_failures: int = 3,
) -> RunStats:
    # long: the eval loop with its progress bars and failure rules
    """Answer every question of ``questions`` not already in ``writer``'s file.

    A video that fails to load is reported in one line and skipped (its questions stay unanswered,
    so a rerun retries them); ``max_consecutive_failures`` failed loads in a row abort the run with
    the last error, since the engine itself is then likely broken. Exceptions from ``ask`` propagate
    at once.
    """
    console = console or Console()
    stats = RunStats()
    start = time.perf_counter()
    groups = group_by_video(_pending(dataset, questions, writer, stats))
    video = _load_options(config)
    failures_in_a_row = 0
    with _progress(console, show_progress) as progress:
        q_task = progress.add_task("questions", total=sum(len(qs) for qs in groups.values()))
        v_task = progress.add_task("videos", total=len(groups))

        def answered() -> None:
            stats.answered += 1
            progress.advance(q_task)

        for video_key, qs in groups.items():
            path = dataset.video_paths[video_key]
            t0 = time.perf_counter()
            try:
                info = session.load_video(VideoRequest(str(path), video))
            except Exception as e:  # noqa: BLE001 - one bad file must not end a 2,700-question run
                _skip_video(session, stats, console, video_key, path, len(qs), e)
                failures_in_a_row += 1
                if failures_in_a_row >= max_consecutive_failures:
                    raise
                progress.advance(q_task, len(qs))
                progress.advance(v_task)
                continue
            failures_in_a_row = 0
            stats.refused += _answer_video(
                dataset,
                qs,
                session,
                writer,
                info,
                time.perf_counter() - t0,
                answered,
                subtitles=config.eval.subtitles,
                max_new_tokens=config.generation.max_new_tokens,
                scoring=config.eval.scoring,
            )
            session.reset()
            progress.advance(v_task)
    stats.seconds = time.perf_counter() - start
    if stats.refused:
        console.print(
            f"[yellow]{stats.refused} question(s) were refused as too long to prefill; they are "
            "recorded with an empty response (scored wrong) and a 'refused' field saying why."
        )
    return stats


def _load_options(config: Config) -> VideoConfig:
    """How the run loads each video: the question's prompt carries the subtitle lines, so the
    engine places none; with speech it transcribes the video (its cues come back with the load)."""
    if config.eval.subtitles == "speech":
        return updated(config.video, subtitles="speech", subtitle_tokens=0)
    return updated(config.video, subtitles="none")


def _pending(
    dataset: Dataset, questions: Sequence[Question], writer: ResultsWriter, stats: RunStats
) -> list[Question]:
    """The questions still to answer; those already in the results file or without a video are
    counted in `stats`."""
    pending: list[Question] = []
    for q in questions:
        if q.question_id in writer.done:
            stats.already_done += 1
        elif dataset.video_path(q) is None:
            stats.missing_video += 1
        else:
            pending.append(q)
    return pending


def _skip_video(
    session: EvalSession,
    stats: RunStats,
    console: Console,
    video_key: str,
    path: Any,
    n_questions: int,
    error: Exception,
) -> None:
    """A video that failed to load: reset the session, record the error, say so in one line."""
    session.reset()
    stats.failed_videos[video_key] = f"{type(error).__name__}: {error}"
    console.print(
        f"[yellow]video {video_key} ({path}) failed to load: {type(error).__name__}: {error}; "
        f"its {n_questions} question(s) are skipped, a rerun retries them."
    )


def _answer_video(
    dataset: Dataset,
    qs: Sequence[Question],
    session: EvalSession,
    writer: ResultsWriter,
    info: VideoInfo,
    load_s: float,
    answered: Callable[[], None],
    *,
    subtitles: str,
    max_new_tokens: int,
    scoring: str,
) -> int:
    """Ask every question of the loaded video and write each answer before asking the next; returns
    how many the engine refused as too long (each is written with an empty response and why, so a
    rerun does not ask it again)."""
    refused = 0
    lines: list[str] = []
    if subtitles == "official":
        lines = select_lines(load_srt(dataset.subtitle_path(qs[0])), info.timestamps)
    elif subtitles == "speech":
        lines = select_lines(info.transcript, info.timestamps)
    for q in qs:
        prompt = build_prompt(q.question, q.options, lines)
        t1 = time.perf_counter()
        try:
            response, why = session.ask(prompt, max_new_tokens), None
        except QuestionTooLong as exc:  # the same prompt would be refused again: record it, go on
            response, why = "", str(exc)
            refused += 1
        ask_s = time.perf_counter() - t1
        pred = extract(response, scoring)
        record = answer_record(q, prompt, response, pred, scoring, info, len(lines), load_s, ask_s)
        if why is not None:
            record["refused"] = why
        if getattr(session, "answer_info", None):
            record["answer_info"] = dict(session.answer_info)  # type: ignore[attr-defined]
        if getattr(session, "evidence", None) is not None:  # where in the video it looked
            record["evidence"] = list(session.evidence)  # type: ignore[attr-defined]
        writer.write(record)
        answered()
    return refused


def answer_record(
    q: Question,
    prompt: str,
    response: str,
    pred: str,
    scoring: str,
    info: VideoInfo,
    subtitle_lines: int,
    video_load_s: float,
    ask_s: float,
) -> dict[str, Any]:
    """The JSONL record of one answered question (the writer adds ``"type": "answer"``)."""
    return {
        "question_id": q.question_id,
        "video_id": q.video_id,
        "videoID": q.videoID,
        "duration": q.duration,
        "domain": q.domain,
        "sub_category": q.sub_category,
        "task_type": q.task_type,
        "question": q.question,
        "options": list(q.options),
        "answer": q.answer,
        "response": response,
        "pred": pred,
        "correct": pred == q.answer,
        "scoring": scoring,
        "prompt": prompt,
        "subtitle_lines": subtitle_lines,
        "frames": info.n_frames,
        "video_s": info.duration_s,
        "video_load_s": round(video_load_s, 4),
        "ask_s": round(ask_s, 4),
        "engine": info.extra,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


class EngineEvalSession:
    """:class:`EvalSession` as a client of the engine service over an `lvx_app.runtime` `Engine`:
    each question is asked on a fresh conversation, greedily."""

    CLIENT = "eval"

    def __init__(self, engine: Any):
        self.service = EngineService(engine)
        self.answer_info: dict[str, Any] | None = None
        self.evidence: list[dict[str, float]] | None = None

    def describe(self) -> dict[str, Any]:
        return dict(self.service.engine.describe())

    def load_video(self, request: VideoRequest) -> VideoInfo:
        with self.service.lease(self.CLIENT) as lease:
            summary = lease.load(request)
        drop = ("path", "timestamps", "duration_s", "subtitle_source", "transcript")
        extra = {k: v for k, v in vars(summary).items() if k not in drop}
        return VideoInfo(
            timestamps=list(summary.timestamps),
            duration_s=summary.duration_s,
            extra=extra,
            transcript=list(summary.transcript),
        )

    def ask(self, prompt: str, max_new_tokens: int) -> str:
        self.evidence = None  # a refused question has none
        with self.service.lease(self.CLIENT) as lease:
            lease.start_over()  # every question as if first
            lease.ready()
            pieces = lease.ask(prompt, max_new_tokens=max_new_tokens, temperature=0.0)
            text = "".join(pieces)
            stats = lease.engine.last_answer
        info = stats.to_dict() if hasattr(stats, "to_dict") else None
        drop = ("tokens", "evidence")
        self.answer_info = {k: v for k, v in info.items() if k not in drop} if info else None
        # the answer's moments (start, end, share), with --evidence
        self.evidence = info.get("evidence") if info else None
        return text

    def reset(self) -> None:
        with self.service.lease(self.CLIENT) as lease:
            lease.start_over()

    def close(self) -> None:
        self.service.close()
