"""The video's first user turn: the video, then the subtitle block, then the question; and the
tokenized prompt made from a sampling plan before any frame is decoded, with its subtitle lines
placed. A speech transcript goes in whole when it fits (each line at its time, the frames' times
beside them), so every word the video says is within the model's reach; otherwise the lines at
the sampled frames and the most others nearest them that fit `--subtitle-tokens` and the positions,
each at its time, and each question carries the other lines that share its words
(`question_lines`). Subtitles from a file, and a budget too small for the lines at the frames, place
the lines at the sampled frames that fit, spread over the video (the Video-MME way)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from lvx_app.engine.limits import TURN_ROOM, check_video_prompt
from lvx_app.engine.question_lines import to_frame
from lvx_app.engine.records import EngineWarning, VideoOpening, VideoRequest
from lvx_app.subtitles import Cue, fit_lines, select_lines, subtitle_block, timed_block
from lvx_models.api import VIDEO


def video_text(block: str, question: str = "") -> str:
    """The first user turn: the video, the subtitle block (the text the eval prompt starts with),
    the question."""
    if not block:
        return VIDEO + "\n" + question
    return VIDEO + "\n" + block + "\n" + question.lstrip()


def video_messages(opening: VideoOpening, block: str, question: str = "") -> list[dict]:
    """The conversation's first messages: the system message, then the first user turn with the
    text before the video, the video, the subtitle block and the question."""
    system = [{"role": "system", "content": opening.system}] if opening.system else []
    return system + [{"role": "user", "content": opening.before + video_text(block, question)}]


class VideoPrompt(NamedTuple):
    """The video's prompt as made from its plan, before any frame is decoded."""

    block: str  # the subtitle lines placed
    placed: int
    dropped: int
    prompt: Any  # the processor's tokenized prompt


def video_prompt(
    processor, context: int, request: VideoRequest, cues: Sequence[Cue], plan, rank: int
) -> VideoPrompt:
    """The video's prompt for `plan` with its subtitle lines placed; a prompt past the model's
    `context` positions is refused here. Rank 0 warns of lines left out."""
    n_frames = len(plan)
    budget = request.video.subtitle_tokens
    timed = _transcript(processor, context, request, cues, plan.timestamps) if cues else None
    if timed is not None:
        if timed.placed < len(cues) and rank == 0:
            _warn_placed(timed.placed, len(cues), budget, "nearest")
        return timed
    block, placed, dropped = _frame_lines(processor, cues, plan.timestamps, budget, rank)
    prompt = processor.build_chat_prompt(
        video_messages(request.opening, block), videos=[n_frames], add_generation_prompt=False
    )
    check_video_prompt(context, int(prompt.input_ids.numel()), n_frames, prompt.placeholder_len)
    if request.speech and budget and rank == 0:
        _warn_placed(placed, len(cues), budget, "at")
    return VideoPrompt(block, placed, dropped, prompt)


def _warn_placed(placed: int, lines: int, budget: int, where: str) -> None:
    warnings.warn(
        EngineWarning(
            f"{placed} of {lines} transcript lines placed (those {where} the sampled frames): "
            f"the whole transcript does not fit the {budget:,}-token subtitle budget or the "
            "model's positions; each question carries the other lines that share its words "
            "(raise --subtitle-tokens, or lower --fps, to place them all)"
        )
    )


def _transcript(processor, context: int, request: VideoRequest, cues, timestamps):
    """The prompt with a speech transcript's lines, each at its time: every line when they fit
    the subtitle budget and leave room for a question within the model's positions, else every
    line at a sampled frame and the most of the others nearest the frames that do; None when
    the lines at the frames alone do not fit (`_frame_lines` then spreads what fits over the
    video), or the cues are no transcript."""
    budget = request.video.subtitle_tokens
    if not request.speech or not budget:
        return None

    def placed(chosen: Sequence[Cue]) -> VideoPrompt | None:
        block = timed_block(sorted(chosen, key=lambda c: (c.start, c.end)), timestamps)
        if len(processor.encode_text(block)) > budget:
            return None
        messages = video_messages(request.opening, block)
        prompt = processor.build_chat_prompt(
            messages, videos=[len(timestamps)], add_generation_prompt=False
        )
        if int(prompt.input_ids.numel()) + TURN_ROOM > context:
            return None
        at_frames = set(select_lines(cues, timestamps)) - {c.text for c in chosen}
        return VideoPrompt(block, len(chosen), len(at_frames), prompt)

    whole = placed(cues)
    if whole is not None:
        return whole
    frames = sorted(timestamps)
    distance = {id(c): to_frame(c, frames) for c in cues}
    nearest = sorted(cues, key=lambda c: (distance[id(c)], c.start))
    at_frames = sum(distance[id(c)] == 0 for c in cues)
    best = placed(nearest[:at_frames]) if at_frames else None
    if best is None:  # not even the lines at the frames: those spread over the video, untimed
        return None
    lo, hi = at_frames + 1, len(cues) - 1  # the most lines nearest the frames that fit
    while lo <= hi:
        mid = (lo + hi) // 2
        got = placed(nearest[:mid])
        if got is not None:
            best, lo = got, mid + 1
        else:
            hi = mid - 1
    return best


def _frame_lines(
    processor, cues: Sequence[Cue], timestamps: Sequence[float], budget: int, rank: int
) -> tuple[str, int, int]:
    """(block, lines placed, lines dropped): the lines at the sampled frames that fit the token
    budget (`--subtitle-tokens`; 0 asks for none, so dropping them all is no news)."""
    lines = select_lines(cues, timestamps)
    kept = fit_lines(lines, budget, lambda text: len(processor.encode_text(text)))
    dropped = len(lines) - len(kept)
    if dropped and budget and rank == 0:
        warnings.warn(
            EngineWarning(
                f"{dropped} of {len(lines)} subtitle lines dropped to fit the {budget:,}-token "
                "subtitle budget; the kept lines are spread over the whole video"
            )
        )
    return subtitle_block(kept), len(kept), dropped
