"""How the audio is cut for the ranks: pieces of about `PIECE_S` seconds on a grid that does not
depend on the number of ranks (so 1 and 8 ranks transcribe the same pieces and make the same cues),
each cut moved to the silence nearest the grid line, found by the voice activity detector on a
short stretch around it. A piece whose cut lies in silence is transcribed without overlap (nothing
is heard twice); where speech runs through the search window the cut stays on the grid line, the
pieces either side are transcribed with `OVERLAP_S` of audio past it, and `join` keeps each word
of the overlap once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lvx_app.speech.audio import SAMPLE_RATE, read_audio

CUT_VERSION = 3  # bump when the cutting or decoding changes (the transcript cache's key holds it)
PIECE_S = 60.0  # long enough for Whisper's 30 s windows, short enough to spread an hour over 8
SEARCH_S = 8.0  # how far from the grid line a cut may move to find silence
OVERLAP_S = 2.0  # audio either side of a piece, so a word cut in two is heard whole
MIN_GAP_S = 0.3  # the shortest silence a cut is put in


@dataclass(frozen=True)
class Cut:
    """Where two pieces meet, and whether it lies in silence (no overlap needed)."""

    at: float
    silent: bool = True


@dataclass(frozen=True)
class Piece:
    index: int
    start: float  # the cut before it (s)
    end: float
    overlap_before: bool = False  # the cut before it lies in speech: decoded from OVERLAP_S before
    overlap_after: bool = False

    def audio_span(self, duration: float) -> tuple[float, float]:
        """What is decoded for it: the piece and, at a cut in speech, its overlap, within the
        audio."""
        lo = self.start - OVERLAP_S if self.overlap_before else self.start
        hi = self.end + OVERLAP_S if self.overlap_after else self.end
        return max(0.0, lo), min(duration, hi)


def grid(duration: float) -> list[float]:
    """The grid lines between pieces (none for audio shorter than two pieces' worth)."""
    n = max(1, math.floor(duration / PIECE_S))
    return [duration * i / n for i in range(1, n)]


def my_lines(duration: float, rank: int, world_size: int) -> tuple[list[int], list[float]]:
    """(this rank's piece numbers, the grid lines it needs: those around its pieces)."""
    lines = grid(duration)
    n = len(lines) + 1
    mine = list(range(rank * n // world_size, (rank + 1) * n // world_size))
    return mine, [lines[i] for i in sorted({j for p in mine for j in (p - 1, p)} - {-1, n - 1})]


def pieces(duration: float, numbers: list[int], cuts: dict[float, Cut]) -> list[Piece]:
    """The pieces `numbers`, their ends the cuts found for their grid lines."""
    ends = [Cut(0.0), *(cuts.get(line, Cut(line)) for line in grid(duration)), Cut(duration)]
    return [
        Piece(i, ends[i].at, ends[i + 1].at, not ends[i].silent, not ends[i + 1].silent)
        for i in numbers
    ]


def find_cut(path: str, line: float, detect) -> Cut:
    """The middle of the silence nearest `line` (within SEARCH_S), by `detect` (samples -> speech
    spans in samples); `line` itself when the stretch is all silence, and `line` in speech when no
    silence is long enough. Every rank that asks for a line decodes the same stretch, so they
    agree."""
    start = max(0.0, line - SEARCH_S)
    audio = read_audio(path, start, line + SEARCH_S)
    spans = [(s / SAMPLE_RATE + start, e / SAMPLE_RATE + start) for s, e in detect(audio)]
    if not spans:
        return Cut(line)
    edges = [start, *[t for span in spans for t in span], start + len(audio) / SAMPLE_RATE]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a >= MIN_GAP_S]
    if not gaps:
        return Cut(line, silent=False)
    middles = [(a + b) / 2 for a, b in gaps]
    return Cut(float(min(middles, key=lambda m: (abs(m - line), m))))
