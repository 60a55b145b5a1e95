"""The page's view of a video's transcript (its speech transcribed): one line per cue under the
player, its time a link that seeks the player there (the `#lvx-seek-` links of `SEEK_JS`); the
lines said where the last answer looked (its evidence) are marked."""

from __future__ import annotations

from collections.abc import Sequence

from lvx_app.engine.records import Moment
from lvx_app.subtitles import Cue
from lvx_app.video.plan import format_timestamp

NEAR_S = 1.0  # a line this close to a moment the answer looked at is marked
MOST_LINES = 400  # a page of lines; beyond it the chat's /transcript (or the API) has them all


def _escaped(text: str) -> str:
    """`text` shown as it is, not read as Markdown or HTML."""
    for ch in "\\`*_{}[]()<>#+-!|":
        text = text.replace(ch, "\\" + ch)
    return text


def seen(cue: Cue, moments: Sequence[Moment]) -> bool:
    """Whether `cue` is said within NEAR_S of a moment the answer looked at."""
    return any(cue.start <= m.end + NEAR_S and cue.end >= m.start - NEAR_S for m in moments)


def transcript_markdown(
    cues: Sequence[Cue],
    seek_prefix: str,
    moments: Sequence[Moment] | None = None,
    most: int = MOST_LINES,
) -> str:
    """The transcript as Markdown lines, each starting with its time as a seek link, those near the
    last answer's `moments` marked ▶ and bold; "" when there is none."""
    if not cues:
        return ""
    lines = []
    for c in cues[:most]:
        text = _escaped(c.text)
        if moments and seen(c, moments):
            text = f"▶ **{text}**"
        lines.append(f"[{format_timestamp(c.start)}]({seek_prefix}{c.start:.2f}) {text}")
    more = f"\n\n… and {len(cues) - most} more lines" if len(cues) > most else ""
    return f"**Transcript** ({len(cues)} lines)\n\n" + "  \n".join(lines) + more
