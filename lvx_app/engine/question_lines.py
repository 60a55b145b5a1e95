"""The transcript lines a question is about, placed with it when the whole transcript did not fit
the video prompt.

The video prompt holds the lines nearest the sampled frames when a speech transcript is too long to
go in whole (`video_prompt`); what is said far from the frames is then out of the model's reach, and
"what did they say about the budget" could not be answered. So each question carries, before its
text, the transcript lines that share its words and are not in the video prompt: those sharing the
most (rarer words counting more) first, among equals those nearest a sampled frame, within
`QUESTION_LINE_TOKENS` and the positions the model has left, in time order, each after its time. The
lines are a pure function of the question and the loaded transcript, so a conversation sent again
whole (the API) makes the same tokens and keeps its cached prefix. Eval (`--subtitle-tokens 0`) and
subtitle files place none: their prompts stay as Video-MME's protocol has them.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Sequence

from lvx_app.subtitles import SUBTITLE_HEADER, Cue

QUESTION_LINE_TOKENS = 512  # most tokens of transcript lines one question carries
TEMPLATE_TOKENS = 16  # the chat template's tokens around a question (role headers, ends)
QUESTION_HEADER = (
    "Lines of the video's transcript that share words with the question (each after the time it "
    "is said):"
)
_WORD = re.compile(r"\w+", re.UNICODE)
_TIME = re.compile(r"^\[\d+(?::\d{2}){1,2}\] ")  # a timed line's "[12:34] "
_COMMON = frozenset(
    "the a an and or but of to in on at by for with from as is are was were be been being it its "
    "this that these those there here what which who whom whose when where why how do does did "
    "done have has had not no yes you your we our they their them he she his her him i me my "
    "about into over under than then so if can could would should will shall may might must "
    "video say said says tell told talk talked speaker speakers".split()
)


def question_words(text: str) -> set[str]:
    """The words of `text` worth matching: lower-cased, without the common words every line
    holds."""
    return {w for w in _WORD.findall(text.lower()) if w not in _COMMON}


def ranked_lines(
    cues: Sequence[Cue], question: str, timestamps: Sequence[float], placed: set[str]
) -> list[Cue]:
    """The cues not in `placed` that share a word with `question`: the most shared (each word
    weighed by how rare it is in the transcript) first, then those nearest a sampled frame, then
    the earliest."""
    asked = question_words(question)
    if not asked:
        return []
    said = [question_words(c.text) for c in cues]
    weight = {w: math.log((1 + len(cues)) / (1 + sum(w in s for s in said))) + 1 for w in asked}
    frames = sorted(timestamps)
    scored = []
    for cue, words in zip(cues, said):
        score = sum(weight[w] for w in asked & words)
        if score and cue.text not in placed:
            scored.append((-score, to_frame(cue, frames), cue.start, cue))
    return [cue for *_, cue in sorted(scored, key=lambda s: s[:3])]


def to_frame(cue: Cue, frames: list[float]) -> float:
    """Seconds from `cue` to the nearest sampled frame (0 when one falls within it)."""
    if not frames:
        return math.inf
    i = bisect.bisect_left(frames, cue.start)
    if i < len(frames) and frames[i] <= cue.end:
        return 0.0
    before = cue.start - frames[i - 1] if i else math.inf
    after = frames[i] - cue.end if i < len(frames) else math.inf
    return min(before, after)


def question_block(
    cues: Sequence[Cue],
    question: str,
    timestamps: Sequence[float],
    placed: set[str],
    budget: int,
    count_tokens: Callable[[str], int],
) -> tuple[str, int]:
    """(the block of lines to place before `question`, how many lines it holds): the ranked lines
    that fit `budget` tokens, in time order; ("", 0) when none does."""
    from lvx_app.video.plan import format_timestamp  # (it brings torch: not at the CLI's start)

    chosen: list[Cue] = []
    used = count_tokens(QUESTION_HEADER)
    for cue in ranked_lines(cues, question, timestamps, placed):
        cost = count_tokens(f"\n[{format_timestamp(cue.start)}] {cue.text}")
        if used + cost <= budget:
            chosen.append(cue)
            used += cost
    if not chosen:
        return "", 0
    chosen.sort(key=lambda c: (c.start, c.end))
    lines = [f"[{format_timestamp(c.start)}] {c.text}" for c in chosen]
    return "\n".join([QUESTION_HEADER, *lines]), len(chosen)


def placed_lines(block: str) -> set[str]:
    """The lines a video prompt's subtitle block holds (its header and the lines' times left
    out)."""
    lines = block.split("\n")
    if not lines[0].startswith(SUBTITLE_HEADER):
        return set()
    return {_TIME.sub("", line, count=1) for line in lines[1:]}


def with_lines(question: str, block: str) -> str:
    """`question` with the block of its transcript lines before it."""
    return f"{block}\n{question.lstrip()}" if block else question


def lines_for(loaded, processor, question: str, room: int) -> tuple[str, int]:
    """(`question` with its transcript lines before it, how many) for the `loaded` video
    (`video_context.LoadedVideo`), within `QUESTION_LINE_TOKENS` and the `room` of positions the
    question may take: none when there is no transcript, it went in whole, or the load asked for
    no subtitle lines (`--subtitle-tokens 0`, as eval does)."""
    if loaded is None or loaded.request is None:
        return question, 0
    summary = loaded.summary
    cues = summary.transcript
    if not cues or loaded.request.video.subtitle_tokens <= 0:
        return question, 0
    if summary.subtitle_lines >= len(cues):
        return question, 0
    count = lambda text: len(processor.encode_text(text))  # noqa: E731
    budget = min(QUESTION_LINE_TOKENS, room - count(question) - TEMPLATE_TOKENS)
    placed = placed_lines(loaded.subtitle_block)
    block, n = question_block(cues, question, summary.timestamps, placed, budget, count)
    return with_lines(question, block), n


def lined_turns(turns: Sequence[dict], lined: Callable[[str], tuple[str, int]], marker: str):
    """(`turns` with each user message's transcript lines placed before its text, how many the
    last one got) when a message holds the video (`marker`); as they are, and 0, otherwise. In
    the message with the video the lines go after it, before the text that follows."""
    if not any(marker in t["content"] for t in turns):
        return list(turns), 0
    out, n = [], 0
    for turn in turns:
        if turn["role"] != "user":
            out.append(turn)
            continue
        before, mark, after = turn["content"].rpartition(marker)
        text, n = lined(after)
        out.append({**turn, "content": before + mark + text})
    return out, n
