"""SRT subtitles and the official rule for using them: only the lines at the sampled frames.

Video-MME's ``.srt`` files are YouTube auto-captions: cues overlap (rolling captions), text is wrapped in
``<font color="white" size=".72c">`` tags, line endings may be CRLF. In the with-subtitles setting the
official protocol allows only the subtitle lines that cover the timestamps of the frames the model actually
sees (10 frames: at most 10 lines), not the whole transcript.
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

_TIMING = re.compile(
    r"(\d+):(\d{1,2}):(\d{1,2})[,.](\d{1,3})\s*-->\s*(\d+):(\d{1,2}):(\d{1,2})[,.](\d{1,3})"
)
_TAGS = re.compile(r"</?(?:font|i|b|u|c|v)\b[^>]*>", re.IGNORECASE)


@dataclass(frozen=True)
class Cue:
    start: float  # seconds
    end: float
    text: str  # tags stripped, inner line breaks joined with spaces


def _seconds(h: str, m: str, s: str, ms: str) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms.ljust(3, "0")) / 1000


def parse_srt(text: str) -> list[Cue]:
    """Cues in start order. Blocks without a timing line or without text are skipped."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    cues: list[Cue] = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").split("\n")
        for i, line in enumerate(lines):
            m = _TIMING.search(line)
            if m:
                body = " ".join(_TAGS.sub("", t).strip() for t in lines[i + 1 :])
                body = " ".join(body.split())
                if body:
                    start, end = _seconds(*m.groups()[:4]), _seconds(*m.groups()[4:])
                    cues.append(Cue(start, max(start, end), body))
                break
    cues.sort(key=lambda c: (c.start, c.end))
    return cues


def load_srt(path: Path | str | None) -> list[Cue]:
    """Cues of an ``.srt`` file; a missing file (None) means no subtitles."""
    if path is None:
        return []
    return parse_srt(Path(path).read_text(encoding="utf-8", errors="replace"))


def select_lines(cues: Sequence[Cue], timestamps: Sequence[float]) -> list[str]:
    """The subtitle lines at the sampled frame ``timestamps`` (seconds), in time order, deduplicated.

    Each timestamp takes the cue that covers it (``start <= t <= end``); where rolling cues overlap, the
    one that started last (the line on screen most recently). A timestamp in a gap takes nothing, so there
    are never more lines than frames.
    """
    starts = [c.start for c in cues]
    reach = list(itertools.accumulate((c.end for c in cues), max))  # latest end among cues[: i + 1]
    picked: set[int] = set()
    for t in timestamps:
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and reach[i] >= t and cues[i].end < t:
            i -= 1  # an earlier, longer cue still covers t
        if i >= 0 and cues[i].end >= t:
            picked.add(i)
    lines: list[str] = []
    for i in sorted(picked):
        if cues[i].text not in lines:
            lines.append(cues[i].text)
    return lines
