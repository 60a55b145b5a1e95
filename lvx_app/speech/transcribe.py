"""One piece of audio through faster-whisper: its batched pipeline on the piece's speech, each
chunk judged by faster-whisper's loop and silence rules and decoded again with its temperature
fallback where they say so (`decode`), with word timestamps. Sampling at a fallback temperature
starts from a fixed seed (CTranslate2 seeds a decoding thread's generator once, when it first
samples, so a model that sampled is loaded afresh for the next piece: `sharded._LazyModel`), and no
piece is conditioned on another, so a piece's words depend on that piece alone (the same on any
number of ranks, and the same when transcribed again). A fast energy gate runs before the model:
silent audio never loads it, and the voice activity detector keeps noise and music from its
decoder."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lvx_app.speech import decode as decoding
from lvx_app.speech.audio import SAMPLE_RATE, read_audio
from lvx_app.speech.onnx_import import import_onnxruntime_privately
from lvx_app.speech.pieces import MIN_GAP_S, Piece

SILENCE = 1e-4  # -80 dBFS
QUIET = 10 ** (-55 / 20)  # a 0.1 s stretch below -55 dBFS (RMS) holds no speech to detect
SEED = 0  # the sampling seed of the temperature fallback
CueTuple = tuple[float, float, str]  # (start s, end s, text): a cue as it travels and is cached
Word = tuple[float, float, str]  # (start s, end s, the word with its leading space)


@dataclass
class Heard:
    """What a piece gave: its words at their times in the video, the times of packets that could
    not be decoded, the seconds of speech the detector found."""

    words: list[Word] = field(default_factory=list)
    bad: list[float] = field(default_factory=list)
    speech_s: float = 0.0
    doubtful_s: float = 0.0  # seconds of speech in chunks that failed the rules at temperature 0
    sampled: bool = False  # a window fell back to sampling: the model's random stream moved on


@dataclass
class Listened:
    """A piece's audio read and gated: its samples (None when it is silent: not kept), where they
    start, the times of packets heard as silence."""

    audio: np.ndarray | None
    lo: float
    bad: list[float]


def listen(path: str, piece: Piece, duration: float) -> Listened:
    """`piece`'s audio (with its overlaps at cuts in speech) through the energy gate; the voice
    activity detector runs once, inside faster-whisper, on what passes."""
    lo, hi = piece.audio_span(duration)
    bad: list[float] = []
    audio = read_audio(path, lo, hi, bad)
    return Listened(None if silent(audio) else audio, lo, bad)


def transcribe_piece(
    model_of, path: str, piece: Piece, duration: float, language, listened: Listened | None = None
) -> Heard:
    """The words of `piece` (and of its overlaps at cuts in speech: `join` keeps them once), from
    its audio as `listen` gives it (read here unless given). `model_of()` gives the loaded model,
    asked for only when the piece holds speech."""
    got = listened or listen(path, piece, duration)
    heard = Heard(bad=got.bad)
    if got.audio is None:
        return heard  # silence costs its decoding and one pass of arithmetic alone
    import ctranslate2

    ctranslate2.set_random_seed(SEED)
    decoded = decoding.decode(model_of(), got.audio, language)
    heard.speech_s, heard.sampled = decoded.speech_s, decoded.sampled
    heard.doubtful_s = decoded.doubtful_s
    for segment in decoded.segments:
        heard.words += [(got.lo + w.start, got.lo + w.end, w.word) for w in segment.words or ()]
    return heard


def detect_language(model, audio: np.ndarray) -> tuple[str, float]:
    """(language code, probability) of the speech in `audio`, by the model's own detector."""
    language, probability, _ = model.detect_language(audio, vad_filter=True)
    return language, float(probability)


def silent(audio) -> bool:
    """Whether `audio` holds nothing to detect: digital silence, or no 0.1 s stretch louder than
    QUIET. Costs one pass of arithmetic, no detector."""
    if not len(audio) or float(abs(audio).max()) < SILENCE:
        return True
    step = SAMPLE_RATE // 10
    usable = len(audio) // step * step
    frames = audio[:usable].reshape(-1, step) if usable else audio[None]
    loudest = float(np.sqrt((frames.astype(np.float64) ** 2).mean(axis=1)).max())
    return loudest < QUIET


def speech_spans(audio) -> list[tuple[int, int]]:
    """(start, end) samples of the speech in `audio`, by faster-whisper's Silero detector (never
    run on audio the energy gate calls silent)."""
    if silent(audio):
        return []
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    import_onnxruntime_privately()  # no file left in the temp folder
    options = VadOptions(min_silence_duration_ms=int(MIN_GAP_S * 1000), speech_pad_ms=100)
    return [(s["start"], s["end"]) for s in get_speech_timestamps(audio, options)]


__all__ = ["SAMPLE_RATE", "CueTuple", "Heard", "Word", "speech_spans", "transcribe_piece"]
