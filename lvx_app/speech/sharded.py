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
from lvx_app.speech.audio import audio_duration
from lvx_app.speech.pieces import CUT_VERSION, find_cut, my_lines, pieces
from lvx_app.subtitles import Cue
from lvx_app.video.ingest import _Sync as Agreement

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
    the cache, or made by the group. No audio track, or no speech in it, is a note, not an error."""
    name = Path(path).name
    duration = audio_duration(path)
    if not duration:
        return Transcript(notes=[f"{name} has no audio track; going on without a transcript"])
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
    cues = _made(path, duration, found, language or None, device, sync, progress)
    if store is not None and get_rank() == 0:
        store.save(key, [(c.start, c.end, c.text) for c in cues], video=Path(path).resolve())
    return _transcript(cues, source, name)


def _transcript(cues: list[Cue], source: str, name: str, from_cache: bool = False) -> Transcript:
    notes = [] if cues else [f"no speech found in the audio of {name}; going on without it"]
    return Transcript(cues, source if cues else "", notes, from_cache)


def _made(path, duration, found, language, device, sync, progress) -> list[Cue]:
    """This rank's pieces transcribed in step with the others, then every rank's cues gathered."""
    rank, world = get_rank(), get_world_size()
    numbers, lines = my_lines(duration, rank, world)
    with sync.agreed([]):
        cuts = {line: find_cut(path, line, transcribe.speech_spans) for line in lines}
        mine = pieces(duration, numbers, cuts)
        threads = torch.get_num_threads()
        model = speech_model.load_model(found, device.type, threads) if mine else None
    steps = math.ceil((len(my_lines(duration, 0, 1)[0])) / world)
    cues: list[tuple[float, float, str]] = []
    done = 0
    for step in range(steps):
        with sync.agreed([0]) as seconds:
            if step < len(mine):
                piece = mine[step]
                cues += transcribe.transcribe_piece(model, path, piece, duration, language)
                seconds[0] = math.ceil(piece.end) - math.ceil(piece.start)
        done += seconds[0]
        if progress is not None and rank == 0:
            progress(STAGE, done, math.ceil(duration))
    every = [cues]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, cues)
    return sorted((Cue(*c) for part in every for c in part), key=lambda c: (c.start, c.end))
