"""A video's speech transcribed by the whole group: every rank decodes and transcribes its own
pieces of the audio (`pieces`), one small all-reduce per step keeps the ranks in step, carries the
progress rank 0 shows and fails every rank with the first failure's line (as ingest does), and the
cues (text, never audio) are gathered at the end. The cache is read first and written by rank 0."""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from lvx_app.cache.features import file_identity
from lvx_app.cache.transcripts import TranscriptCache, TranscriptKey
from lvx_app.config import VideoConfig
from lvx_app.parallel import get_rank, get_world_size
from lvx_app.parallel.collectives import all_min
from lvx_app.speech import join, transcribe
from lvx_app.speech import model as speech_model
from lvx_app.speech.audio import AudioDecodeError, SpeechError, speech_span
from lvx_app.speech.cue_words import with_words
from lvx_app.speech.pieces import CUT_VERSION, Cut, find_cut, my_lines, pieces
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
    duration = speech_span(path)
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
    with sync.agreed([]):  # rank 0 fetches a model the cache lacks; the others then find it there
        first = get_rank() == 0
        found = speech_model.find_model(video.speech_model, device.type) if first else None
    with sync.agreed([]):
        found = found or speech_model.find_model(video.speech_model, device.type)
    language = video.speech_language or ""
    key = TranscriptKey(file_identity(path), found.name, found.weights, language, CUT_VERSION)
    store = TranscriptCache(video.cache_dir) if video.cache else None
    saved = store.load(key, owner=get_rank() == 0) if store is not None else None
    source = f"speech ({found.name})"
    if all_min(int(saved is not None), device):
        return _transcript([Cue(*c) for c in saved], source, name, from_cache=True)
    cues, notes, partial = _made(path, duration, found, language or None, device, sync, progress)
    if store is not None and get_rank() == 0 and not partial:  # a partial one is made again
        store.save(key, [astuple(c) for c in cues], video=Path(path).resolve())
    made = _transcript(cues, source, name)
    made.notes[:0] = notes
    return made


def _transcript(cues: list[Cue], source: str, name: str, from_cache: bool = False) -> Transcript:
    notes = [] if cues else [f"no speech found in the audio of {name}; going on without it"]
    return Transcript(cues, source if cues else "", notes, from_cache)


def _made(path, duration, found, language, device, sync, progress):
    """This rank's pieces transcribed in step with the others, then every rank's words gathered
    and joined into cues, with the notes: the language, pieces whose audio could not be decoded
    (the rest is kept), packets heard as silence, an English-only model that understood little;
    and whether a piece was left out."""
    rank, world = get_rank(), get_world_size()
    numbers, lines = my_lines(duration, rank, world)
    with sync.agreed([]):
        cuts = {line: _cut(path, line) for line in lines}
        mine = pieces(duration, numbers, cuts)
    model = _LazyModel(found, device.type, torch.get_num_threads())
    part = _Part()
    language = _language(model, path, mine, duration, language, sync, part)
    steps = math.ceil((len(my_lines(duration, 0, 1)[0])) / world)
    done = 0
    for step in range(steps):
        with sync.agreed([0]) as seconds:
            if step < len(mine):
                part.add(model, path, mine[step], duration, language)
                seconds[0] = math.ceil(mine[step].end) - math.ceil(mine[step].start)
        done += seconds[0]
        if progress is not None and rank == 0:
            progress(STAGE, done, math.ceil(duration))
    part.english_only = model.english_only()
    part.listened.clear()
    every = [part]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, part)
    words = join.join([pw for p in every for pw in p.heard])
    made = with_words(join.cues(words), words)
    partial = any(p.skipped for p in every)
    return made, _notes(Path(path).name, every, len(words), found.name) + part.said, partial


@dataclass
class _Part:
    """What one rank heard: each piece's words, the lines of pieces left out, the times of
    packets heard as silence, seconds of speech, and whether its model hears English only."""

    heard: list = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bad: list[float] = field(default_factory=list)
    speech_s: float = 0.0
    doubtful_s: float = 0.0
    english_only: bool | None = None
    said: list[str] = field(default_factory=list)  # the language detected (rank 0's)
    listened: dict = field(default_factory=dict)  # pieces read before the steps: not read again

    def add(self, model, path: str, piece, duration: float, language) -> None:
        ahead = self.listened.pop(piece.index, None)
        try:
            got = transcribe.transcribe_piece(model, path, piece, duration, language, ahead)
        except AudioDecodeError as exc:
            self.skipped.append(
                f"{exc}; the speech from {piece.start:.0f} to {piece.end:.0f} s is left out"
            )
            return
        self.heard.append((piece, got.words))
        self.bad += got.bad
        self.speech_s += got.speech_s
        self.doubtful_s += got.doubtful_s
        if got.sampled:
            model.renew()


def _notes(name: str, every: list[_Part], words: int, model: str) -> list[str]:
    notes = [line for p in every for line in p.skipped]
    bad = sorted({t for p in every for t in p.bad})
    if bad:
        at = f"at {bad[0]:.1f} s" if len(bad) == 1 else f"from {bad[0]:.1f} to {bad[-1]:.1f} s"
        notes.append(
            f"{len(bad)} damaged audio packet(s) of {name} could not be decoded ({at}); "
            "heard as silence, the rest is transcribed"
        )
    speech_s = sum(p.speech_s for p in every)
    doubtful_s = sum(p.doubtful_s for p in every)
    if any(p.english_only for p in every) and speech_s >= ENGLISH_CHECK_S:
        if words < MIN_WORDS_PER_S * speech_s or doubtful_s > DOUBTFUL_SHARE * speech_s:
            notes.append(
                f"the speech model {model} hears English only and understood little of the "
                f"{speech_s:.0f} s of speech in {name} ({words} words): if it is another "
                "language, pass a multilingual --speech-model such as base or small"
            )
    return notes


ENGLISH_CHECK_S = 10.0  # seconds of speech before an English-only model's yield is judged
MIN_WORDS_PER_S = 0.5  # fewer words per second of speech: not understood (speech runs ~2.5)
DOUBTFUL_SHARE = 0.5  # more of the speech failing the rules at temperature 0: not understood


class _LazyModel:
    """The speech model, loaded the first time a piece holds speech (silence never loads it)."""

    def __init__(self, found, device_type: str, threads: int) -> None:
        self.found, self.device_type, self.threads = found, device_type, threads
        self.model = None
        self.multilingual: bool | None = None

    def __call__(self):
        if self.model is None:
            self.model = speech_model.load_model(self.found, self.device_type, self.threads)
        return self.model

    def renew(self) -> None:
        """Load the model afresh for the next piece: its decoding thread's random generator,
        seeded once when it first sampled, has moved on, and the next piece's sampling must start
        from the seed as it would on a rank where it came first."""
        if self.model is not None:
            self.multilingual = self.model.model.is_multilingual
        self.model = None

    def english_only(self) -> bool | None:
        if self.model is not None:
            return not self.model.model.is_multilingual
        return None if self.multilingual is None else not self.multilingual


def _language(model, path, mine, duration, language, sync, part) -> str | None:
    """The language every piece is transcribed in: the one asked for, else detected once, by rank
    0 on its first piece that holds speech (a multilingual model only), and told to the user. The
    pieces read on the way are kept in `part.listened` (never read twice)."""
    found: list[tuple[str, float] | None] = [None]
    with sync.agreed([]):
        if language is None and get_rank() == 0:
            found[0] = _detected(model, path, mine, duration, part.listened)
    if get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return language
    code, probability = found[0]
    part.said.append(
        f"the speech in {Path(path).name} is in language {code!r} (detected, p={probability:.2f})"
    )
    return code


def _detected(model, path, mine, duration, listened: dict) -> tuple[str, float] | None:
    for piece in mine:
        try:
            got = listened[piece.index] = transcribe.listen(path, piece, duration)
        except AudioDecodeError:
            return None  # the step loop says so
        if got.audio is not None and transcribe.speech_spans(got.audio):
            if not model().model.is_multilingual:
                return None
            return transcribe.detect_language(model(), got.audio)
    return None


def _cut(path: str, line: float) -> Cut:
    """The cut for a grid line; the line itself where the audio around it cannot be decoded (the
    pieces on either side say so)."""
    try:
        return find_cut(path, line, transcribe.speech_spans)
    except AudioDecodeError:
        return Cut(line)
