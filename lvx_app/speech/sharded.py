"""A video's speech transcribed by the whole group: every rank decodes and transcribes its own
pieces of the audio (`pieces`), one small all-reduce per step keeps the ranks in step, carries the
progress rank 0 shows and fails every rank with the first failure's line (as ingest does), and the
cues (text, never audio) are gathered at the end. The cache is read first and written by rank 0."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from lvx_app.cache.features import file_identity
from lvx_app.cache.transcripts import TranscriptCache, TranscriptKey
from lvx_app.config import VideoConfig
from lvx_app.parallel import get_rank, get_world_size
from lvx_app.parallel.collectives import all_min
from lvx_app.speech import model as speech_model
from lvx_app.speech import transcribe
from lvx_app.speech.audio import AudioDecodeError, SpeechError, audio_duration
from lvx_app.speech.pieces import CUT_VERSION, find_cut, my_lines, pieces
from lvx_app.subtitles import Cue
from lvx_app.video.ingest import Agreement

STAGE = "speech (seconds of audio)"  # the progress bar's name


@dataclass
class Transcript:
    """The cues made from a video's speech, where they came from, and what the user is told."""

    cues: list[Cue] = field(default_factory=list)
    source: str = ""  # "speech (small)"; "" when nothing was transcribed
    notes: list[str] = field(default_factory=list)
    from_cache: bool = False


def transcribe_video(
    path: str,
    video: VideoConfig,
    device: torch.device,
    progress: Callable[[str, int, int], None] | None = None,
) -> Transcript:
    """The transcript of `path`'s speech (every rank calls this at the same point): read back from
    the cache, or made by the group. No audio track, no speech in it, audio that cannot be decoded
    and (with `auto`) a speech model that cannot be had are notes; the load goes on without."""
    name = Path(path).name
    duration = audio_duration(path)
    if not duration:
        return Transcript(notes=[f"{name} has no audio track; going on without a transcript"])
    try:
        return _transcribed(path, duration, video, device, progress)
    except AudioDecodeError as exc:
        return Transcript(notes=[f"{exc}; going on without a transcript"])
    except SpeechError as exc:
        if video.subtitles.strip().lower() == "speech":
            raise
        return Transcript(notes=[f"{exc} (found no subtitles, so tried speech)"])


def _transcribed(path: str, duration: float, video: VideoConfig, device, progress) -> Transcript:
    """The transcript read back, or made by the group and saved (rank 0)."""
    name = Path(path).name
    sync = Agreement(None)
    with sync.agreed([]):
        found = speech_model.find_model(video.speech_model, device.type)
    language = video.speech_language or ""
    key = TranscriptKey(file_identity(path), found.name, found.weights, language, CUT_VERSION)
    store = TranscriptCache(video.cache_dir) if video.cache else None
    saved = store.load(key, owner=get_rank() == 0) if store is not None else None
    source = f"speech ({found.name})"
    if all_min(int(saved is not None), device):
        return _transcript([Cue(*c) for c in saved], source, name, from_cache=True)
    cues, skipped = _made(path, duration, found, language or None, device, sync, progress)
    if store is not None and get_rank() == 0 and not skipped:  # a partial one is made again
        store.save(key, [(c.start, c.end, c.text) for c in cues], video=Path(path).resolve())
    made = _transcript(cues, source, name)
    made.notes[:0] = skipped
    return made


def _transcript(cues: list[Cue], source: str, name: str, from_cache: bool = False) -> Transcript:
    notes = [] if cues else [f"no speech found in the audio of {name}; going on without it"]
    return Transcript(cues, source if cues else "", notes, from_cache)


def _made(path, duration, found, language, device, sync, progress) -> tuple[list[Cue], list[str]]:
    """This rank's pieces transcribed in step with the others, then every rank's cues gathered,
    with a line for each piece whose audio could not be decoded (the rest is kept)."""
    rank, world = get_rank(), get_world_size()
    numbers, lines = my_lines(duration, rank, world)
    with sync.agreed([]):
        cuts = {line: _cut(path, line) for line in lines}
        mine = pieces(duration, numbers, cuts)
        threads = torch.get_num_threads()
        model = speech_model.load_model(found, device.type, threads) if mine else None
    steps = math.ceil((len(my_lines(duration, 0, 1)[0])) / world)
    cues: list[tuple[float, float, str]] = []
    skipped: list[str] = []
    done = 0
    for step in range(steps):
        with sync.agreed([0]) as seconds:
            if step < len(mine):
                piece = mine[step]
                try:
                    cues += transcribe.transcribe_piece(model, path, piece, duration, language)
                except AudioDecodeError as exc:
                    skipped.append(
                        f"{exc}; the speech from {piece.start:.0f} to {piece.end:.0f} s is left out"
                    )
                seconds[0] = math.ceil(piece.end) - math.ceil(piece.start)
        done += seconds[0]
        if progress is not None and rank == 0:
            progress(STAGE, done, math.ceil(duration))
    every = [(cues, skipped)]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (cues, skipped))
    made = sorted((Cue(*c) for part, _ in every for c in part), key=lambda c: (c.start, c.end))
    return made, [line for _, lines in every for line in lines]


def _cut(path: str, line: float) -> float:
    """The cut for a grid line; the line itself where the audio around it cannot be decoded (the
    pieces on either side say so)."""
    try:
        return find_cut(path, line, transcribe.speech_spans)
    except AudioDecodeError:
        return line
