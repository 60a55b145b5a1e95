"""The page's view of a video's transcript (its speech transcribed): one line per cue under the
player, its time a link that seeks the player there (the `#lvx-seek-` links of `SEEK_JS`)."""

from __future__ import annotations

from collections.abc import Sequence

from lvx_app.subtitles import Cue
from lvx_app.video.plan import format_timestamp

MOST_LINES = 400  # a page of lines; beyond it the chat's /transcript (or the API) has them all


def _escaped(text: str) -> str:
    """`text` shown as it is, not read as Markdown or HTML."""
    for ch in "\\`*_{}[]()<>#+-!|":
        text = text.replace(ch, "\\" + ch)
    return text


def transcript_markdown(cues: Sequence[Cue], seek_prefix: str, most: int = MOST_LINES) -> str:
    """The transcript as Markdown lines, each starting with its time as a seek link; "" when there
    is none."""
    if not cues:
        return ""
    lines = [
        f"[{format_timestamp(c.start)}]({seek_prefix}{c.start:.2f}) {_escaped(c.text)}"
        for c in cues[:most]
    ]
    more = f"\n\n… and {len(cues) - most} more lines" if len(cues) > most else ""
    return f"**Transcript** ({len(cues)} lines)\n\n" + "  \n".join(lines) + more
