"""Transcripts of a video's speech: reopening a video without subtitles never runs the speech model
again.

Layout: `<cache dir>/transcripts/<id>/transcript.safetensors`, one file for all ranks (the cues are
the same on any number of ranks: the audio is cut on a grid that does not depend on it): each cue's
start and end (`times`, float64 (n, 2)) and their texts as UTF-8 JSON bytes (`text`). The id hashes
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

    def save(
        self, key: TranscriptKey, cues: list[tuple[float, float, str]], *, video: str | os.PathLike
    ) -> Path | None:
        """Write the cues ((start, end, text) each); None (and one warning) when it could not be
        saved."""
        times = torch.tensor([[s, e] for s, e, _ in cues], dtype=torch.float64).reshape(-1, 2)
        text = json.dumps([t for _, _, t in cues], ensure_ascii=False).encode()
        tensors = {"times": times, "text": torch.frombuffer(bytearray(text), dtype=torch.uint8)}
        shapes = {n: list(t.shape) for n, t in tensors.items()}
        return self.write(key, tensors, video, cues=len(cues), shapes=shapes)

    def load(self, key: TranscriptKey, *, owner: bool = True) -> list[tuple[float, float, str]]:
        """The saved cues, or None. The `owner` (rank 0) reports and deletes a damaged file."""
        got = self.read(key, owner=owner)
        if got is None:
            return None
        _, tensors = got
        texts = json.loads(bytes(tensors["text"].numpy()).decode())
        return [(float(s), float(e), str(t)) for (s, e), t in zip(tensors["times"].tolist(), texts)]

    def check(self, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
        super().check(manifest, tensors)
        try:
            texts = json.loads(bytes(tensors["text"].numpy()).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptEntry(f"unreadable text ({exc})") from None
        counts = {int(manifest["cues"]), tensors["times"].shape[0]}
        if not isinstance(texts, list) or counts != {len(texts)}:
            raise CorruptEntry("the cue count does not match the manifest")

    def describe(self, entry: Entry, manifest: dict) -> None:
        key = manifest["key"]
        entry.video, entry.file_id = manifest["video"], key["file_id"]
        entry.version, entry.model = manifest.get("version"), key["model"]
        entry.tokens = int(manifest.get("cues", 0))  # shown as the entry's size in lines
