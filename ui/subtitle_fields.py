"""lvx's own fields of an API answer about the video's subtitles: where they came from and how
many reached the prompt (`lvx_subtitles`, the same words the chat and the page print), and, in the
evidence, what the transcript says at each moment the answer looked at, word by word."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from lvx_app.engine.describe import placed_line
from lvx_app.engine.records import AnswerStats, Moment, VideoSummary
from lvx_app.subtitles import Cue
from lvx_ui.transcript_view import seen


def subtitles_field(summary: VideoSummary, stats: AnswerStats) -> dict[str, Any]:
    """`lvx_subtitles`: the source ("movie.en.srt", "stream 2 (mov_text, eng) of movie.mp4",
    "speech (base)"; null without subtitles), whether it is a transcript and was read back from
    the cache, the lines in the video prompt, the transcript's lines, those placed with this
    question, and the line the chat prints."""
    source = summary.subtitle_source or None
    return {
        "source": source,
        "transcript": bool(summary.transcript),
        "from_cache": bool(summary.transcript and summary.transcript_from_cache),
        "lines_placed": summary.subtitle_lines,
        "transcript_lines": len(summary.transcript),
        "question_lines": stats.transcript_lines,
        "line": placed_line(summary, source) if source else "no subtitles",
    }


def evidence_field(moments: Sequence[Moment], transcript: Sequence[Cue]) -> list[dict[str, Any]]:
    """`lvx_evidence`: each moment's start, end and share; with a transcript, also what is said
    there (`said`: the lines within `transcript_view.NEAR_S` of it, each with its words' times)."""
    out = []
    for moment in moments:
        record = asdict(moment)
        if transcript:
            record["said"] = [_line(c) for c in transcript if seen(c, [moment])]
        out.append(record)
    return out


def _line(cue: Cue) -> dict[str, Any]:
    words = [{"start": s, "end": e, "word": w} for s, e, w in cue.words]
    return {"start": cue.start, "end": cue.end, "text": cue.text, "words": words}
