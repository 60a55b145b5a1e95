"""Each cue given the words it was made of, with their times: `join.cues` makes the cues' text
from the words, and the words' times go with them into the cache, `/transcript words`, a saved
WebVTT file and the API's evidence."""

from __future__ import annotations

import bisect

from lvx_app.speech.transcribe import CueTuple, Word
from lvx_app.subtitles import Cue


def with_words(cues: list[CueTuple], words: list[Word]) -> list[Cue]:
    """`cues` as Cues, each holding the words that start within it (from its start to the next
    cue's), stripped of their leading space and timed to the millisecond. A word of no letters or
    digits (a stray mark the cue's text dropped) is left out."""
    starts = [c[0] for c in cues]
    held: list[list[tuple[float, float, str]]] = [[] for _ in cues]
    for start, end, word in words:
        i = bisect.bisect_right(starts, round(float(start), 3)) - 1
        said = word.strip()
        if i >= 0 and any(ch.isalnum() for ch in said):
            held[i].append((round(float(start), 3), round(float(end), 3), said))
    return [Cue(s, e, text, tuple(w)) for (s, e, text), w in zip(cues, held)]
