"""Test audio the voice activity detector takes for speech without any speech synthesiser: a
voiced source (a pulse train at a speaking pitch) through vowel formants changing every syllable;
and the decoder a stand-in speech model runs through."""

from __future__ import annotations

import numpy as np

from lvx_app.speech.audio import SAMPLE_RATE
from lvx_app.speech.decode import Decoded

_VOWELS = ((700, 1200), (300, 2300), (500, 1000), (400, 2000))
_SYLLABLE_S = 0.2


def _resonate(x: np.ndarray, freq: float, bandwidth: float) -> np.ndarray:
    r = np.exp(-np.pi * bandwidth / SAMPLE_RATE)
    a1, a2 = 2 * r * np.cos(2 * np.pi * freq / SAMPLE_RATE), -r * r
    y, y1, y2 = np.zeros_like(x), 0.0, 0.0
    for i, v in enumerate(x):
        y1, y2 = (1 - r) * v + a1 * y1 + a2 * y2, y1
        y[i] = y1
    return y


def _syllables(seed: int) -> list[np.ndarray]:
    """One windowed syllable per vowel (made once: the resonators are a Python loop)."""
    n = int(_SYLLABLE_S * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    pulses = np.diff(np.floor(np.cumsum(120 + 10 * seed + 0 * t) / SAMPLE_RATE), prepend=0) > 0
    out = []
    for f1, f2 in _VOWELS:
        y = pulses.astype(np.float64)
        for freq, bandwidth in ((f1, 80), (f2, 120), (2600, 200)):
            y = _resonate(y, freq, bandwidth)
        out.append((y * np.hanning(n) / np.abs(y).max()).astype(np.float32))
    return out


_MADE: dict[int, list[np.ndarray]] = {}


def voice(seconds: float, seed: int = 0) -> np.ndarray:
    """`seconds` of speech-like sound, 16 kHz mono, its syllables in an order `seed` picks."""
    syllables = _MADE.setdefault(seed % 3, _syllables(seed % 3))
    rng = np.random.default_rng(seed)
    count = max(1, int(seconds / _SYLLABLE_S))
    return 0.3 * np.concatenate([syllables[rng.integers(len(_VOWELS))] for _ in range(count)])


def stand_in_decode(model, audio: np.ndarray, language) -> Decoded:
    """What `lvx_app.speech.decode.decode` gives, from a stand-in model's `transcribe` (faster-
    whisper's call) on the whole stretch: for stand-ins that hear scripted words, not audio."""
    segments, info = model.transcribe(audio, language=language)
    segments = list(segments)
    sampled = any(s.temperature > 0 for s in segments)
    return Decoded(segments, float(info.duration_after_vad), sampled)
