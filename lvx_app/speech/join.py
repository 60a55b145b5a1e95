"""The pieces' words joined into one stream and cut into cues at sentence ends.

A cut in silence was decoded without overlap, so the pieces' words just follow each other. At a cut
in speech both pieces heard the overlap: the piece before keeps its words that start before the cut
(with `MARGIN_S` of slack), the piece after those that end after it (the same slack), and a word the
second heard that the first already holds (the same word, starting within `SAME_S`) is dropped, so a
word across the cut is kept once and none is lost. Cues end at a sentence's end, a long pause or a
length limit, never at a cut, and never overlap."""

from __future__ import annotations

import re

from lvx_app.speech.pieces import Piece
from lvx_app.speech.transcribe import CueTuple, Word
from lvx_app.subtitles import clean_text

MARGIN_S = 0.5  # how far past a cut in speech a piece keeps the words it heard
SAME_S = 1.0  # two hearings of a word at a cut starting this close are the same word
PAUSE_S = 2.0  # a pause this long between words ends a cue
MOST_WORDS = 40  # a cue never holds more words than this
_SENTENCE_END = re.compile(r"[.!?。！？…]['\"”’)\]]*$")


def join(heard: list[tuple[Piece, list[Word]]]) -> list[Word]:
    """Every piece's words, in order, each word at a cut kept once."""
    out: list[Word] = []
    for piece, words in sorted(heard, key=lambda pw: pw[0].index):
        if piece.overlap_after:
            words = [w for w in words if w[0] < piece.end + MARGIN_S]
        if piece.overlap_before:
            held = [w for w in out if w[1] > piece.start - MARGIN_S - SAME_S]
            words = [w for w in words if w[1] > piece.start - MARGIN_S and not _heard(w, held)]
        out += sorted(words)
    return out


def _heard(word: Word, held: list[Word]) -> bool:
    said = _bare(word[2])
    return any(_bare(h[2]) == said and abs(h[0] - word[0]) < SAME_S for h in held)


def _bare(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())


def cues(words: list[Word]) -> list[CueTuple]:
    """Cues of whole sentences: a cue ends after a word that ends a sentence, before a pause of
    PAUSE_S or more, or at MOST_WORDS; its end never passes the next cue's start."""
    groups: list[list[Word]] = []
    for word in words:
        last = groups[-1] if groups else None
        if (
            last is None
            or _SENTENCE_END.search(last[-1][2].strip())
            or word[0] - last[-1][1] >= PAUSE_S
            or len(last) >= MOST_WORDS
        ):
            groups.append([word])
        else:
            last.append(word)
    made: list[CueTuple] = []
    for group in groups:
        text = clean_text("".join(w[2] for w in group))
        if text:
            end = max(w[1] for w in group)
            made.append((round(float(group[0][0]), 3), round(float(end), 3), text))
    for i in range(len(made) - 1):
        start, end, text = made[i]
        made[i] = (start, min(end, made[i + 1][0]), text)
    return made
