"""Transcripts of a video's speech: reopening a video without subtitles never runs the speech model
again.

Layout: `<cache dir>/transcripts/<id>/transcript.safetensors`, one file for all ranks (the cues are
the same on any number of ranks: the audio is cut on a grid that does not depend on it): each cue's
start and end (`times`, float64 (n, 2)) and their texts as UTF-8 JSON bytes (`text`); then each
cue's words: how many (`word_counts`, int64 (n,)), their start and end (`word_times`, float64
(m, 2)) and the words themselves (`words`, UTF-8 JSON). A file saved without the words (before
they were kept) loads with none: its cues hold no word times until it is made again. The id hashes
the video (`file_identity`), the speech model's weights (its model.bin's identity) and the options
that change the words (language, the format of the cutting). Rank 0 writes it; a full disk is one
warning and the load goes on.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lvx_app.cache.faults import CorruptEntry
from lvx_app.cache.store import Entry, Store, stable_hash

TRANSCRIPT_VERSION = 1


@dataclass(frozen=True)
class TranscriptKey:
    """Everything that decides a video's transcript."""

    file_id: str  # the video's file_identity
    model: str  # the speech model's name as asked (small, a folder...)
    weights: str  # file_identity of its model.bin
    language: str  # --speech-language, "" = detected
    cutting: int  # lvx_app.speech.pieces.CUT_VERSION: how the audio is cut into pieces

    def entry_id(self) -> str:
        return stable_hash(asdict(self))

    def file_name(self) -> str:
        return "transcript.safetensors"


class TranscriptCache(Store):
    """Transcripts on disk, one safetensors file per (video, speech model, options)."""

    kind = "transcript"
    folder_name = "transcripts"
    version = TRANSCRIPT_VERSION
    names = re.compile(r"transcript\.safetensors")
    required = frozenset({"times", "text"})
    noun = "the saved transcript"
    content = "the transcript"
    instead = "transcribing the speech again"
    then = "the next open will transcribe the speech again"

    def save(self, key: TranscriptKey, cues: list, *, video: str | os.PathLike) -> Path | None:
        """Write the cues ((start, end, text, words) each, words as (start, end, word)); None (and
        one warning) when it could not be saved."""
        words = [w for cue in cues for w in cue[3]]
        tensors = {
            "times": _times([(c[0], c[1]) for c in cues]),
            "text": _json([c[2] for c in cues]),
            "word_counts": torch.tensor([len(c[3]) for c in cues], dtype=torch.int64),
            "word_times": _times([(w[0], w[1]) for w in words]),
            "words": _json([w[2] for w in words]),
        }
        shapes = {n: list(t.shape) for n, t in tensors.items()}
        return self.write(key, tensors, video, cues=len(cues), shapes=shapes)

    def load(self, key: TranscriptKey, *, owner: bool = True) -> list | None:
        """The saved cues as (start, end, text, words), or None. The `owner` (rank 0) reports and
        deletes a damaged file."""
        got = self.read(key, owner=owner)
        if got is None:
            return None
        _, tensors = got
        texts = json.loads(bytes(tensors["text"].numpy()).decode())
        words = _words(tensors, len(texts))
        return [
            (float(s), float(e), str(t), w)
            for (s, e), t, w in zip(tensors["times"].tolist(), texts, words)
        ]

    def check(self, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
        super().check(manifest, tensors)
        try:
            texts = json.loads(bytes(tensors["text"].numpy()).decode())
            said = json.loads(bytes(tensors["words"].numpy()).decode()) if "words" in tensors else 0
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptEntry(f"unreadable text ({exc})") from None
        counts = {int(manifest["cues"]), tensors["times"].shape[0]}
        if not isinstance(texts, list) or counts != {len(texts)}:
            raise CorruptEntry("the cue count does not match the manifest")
        if "words" in tensors:
            _check_words(tensors, len(texts), said)

    def describe(self, entry: Entry, manifest: dict) -> None:
        key = manifest["key"]
        entry.video, entry.file_id = manifest["video"], key["file_id"]
        entry.version, entry.model = manifest.get("version"), key["model"]
        entry.tokens = int(manifest.get("cues", 0))  # shown as the entry's size in lines


def _times(pairs: list[tuple[float, float]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.float64).reshape(-1, 2)


def _json(texts: list[str]) -> torch.Tensor:
    text = json.dumps(texts, ensure_ascii=False).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def _check_words(tensors: dict[str, torch.Tensor], cues: int, said) -> None:
    """CorruptEntry unless the words, their times and the count per cue agree with each other."""
    counts, times = tensors.get("word_counts"), tensors.get("word_times")
    if counts is None or times is None or not isinstance(said, list):
        raise CorruptEntry("the words are saved without their counts or times")
    per_cue = counts.tolist()
    if len(per_cue) != cues or min(per_cue, default=0) < 0 or sum(per_cue) != len(said):
        raise CorruptEntry("the word count does not match the cues")
    if times.shape != (len(said), 2):
        raise CorruptEntry("the word times do not match the words")


def _words(tensors: dict[str, torch.Tensor], cues: int) -> list[tuple]:
    """Each cue's words as (start, end, word) tuples; all empty for a file saved without them."""
    if "words" not in tensors:
        return [()] * cues
    said = json.loads(bytes(tensors["words"].numpy()).decode())
    times = tensors["word_times"].tolist()
    out, at = [], 0
    for n in tensors["word_counts"].tolist():
        pairs = zip(times[at : at + n], said[at : at + n])
        out.append(tuple((float(s), float(e), str(w)) for (s, e), w in pairs))
        at += n
    return out
