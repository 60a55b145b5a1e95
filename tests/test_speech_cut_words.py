"""Words at the cuts between pieces, through the whole transcription path (cuts found by the real
voice detector on speech-like sound, pieces read and joined as on a rank) with a stand-in model
that places a word differently by where it lies in the audio it is given, as Whisper's alignment
does near the edges of its window: a word in the first 2.5 s of a stretch late, one in the last
2.5 s early. Every word said comes back once, both at a cut inside speech and just after a cut in
silence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from speech_clips import stand_in_decode, voice

from lvx_app.config import VideoConfig
from lvx_app.speech import decode, pieces, transcribe
from lvx_app.speech import model as speech_model
from lvx_app.speech.audio import SAMPLE_RATE
from lvx_app.speech.sharded import transcribe_video
from lvx_app.speech.tracks import place, write_audio

pytest.importorskip("faster_whisper")
LENGTH_S = 130.0  # two pieces, the grid line at 65 s
EDGE_S = 2.5  # how near a stretch's start or end a word is placed off
LATE_S, EARLY_S = 0.3, 0.5


class _EdgeModel:
    """Hears the words said (absolute times) whose middle lies in the stretch it is given, each
    placed late near the stretch's start and early near its end."""

    model = SimpleNamespace(is_multilingual=False)

    def __init__(self, said, stretches):
        self.said, self.stretches = said, stretches

    def transcribe(self, audio, **_):
        lo = self.stretches[id(audio)][1]
        hi = lo + len(audio) / SAMPLE_RATE
        heard = []
        for start, end, word in self.said:
            if lo <= (start + end) / 2 < hi:
                shift = LATE_S if start - lo < EDGE_S else -EARLY_S if hi - start < EDGE_S else 0
                heard.append(SimpleNamespace(word=f" {word}", start=start + shift - lo,
                                             end=end + shift - lo))  # fmt: skip
        info = SimpleNamespace(duration_after_vad=len(audio) / SAMPLE_RATE)
        return [SimpleNamespace(words=heard, temperature=0.0)], info


def _heard(tmp_path, monkeypatch, bursts, said) -> str:
    """The transcript's text of a clip with speech-like sound at `bursts` ((start, length) s),
    heard by the stand-in as the words `said`."""
    clip = place(LENGTH_S, *[(s, _steady(n, i)) for i, (s, n) in enumerate(bursts)])
    path = write_audio(tmp_path / "talk.m4a", clip)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.bin").write_bytes(b"stand-in")
    stretches: dict[int, tuple] = {}
    reading = transcribe.read_audio

    def read_audio(path, lo, hi, *rest):
        audio = reading(path, lo, hi, *rest)
        stretches[id(audio)] = (audio, lo)  # the samples kept: their id stays theirs
        return audio

    monkeypatch.setattr(transcribe, "read_audio", read_audio)
    model = _EdgeModel(said, stretches)
    monkeypatch.setattr(speech_model, "load_model", lambda *_: model)
    monkeypatch.setattr(decode, "decode", stand_in_decode)
    video = VideoConfig(subtitles="speech", speech_model=str(tmp_path / "model"), cache=False)
    got = transcribe_video(str(path), video, torch.device("cpu"))
    assert all(a.end <= b.start for a, b in zip(got.cues, got.cues[1:]))
    return " ".join(c.text for c in got.cues)


def _steady(seconds: float, seed: int):
    """Speech-like sound without a pause the detector hears: two voices, one a syllable's half
    behind the other."""
    first, second = voice(seconds, seed), voice(seconds, seed + 7)
    first[SAMPLE_RATE // 10 :] += second[: -(SAMPLE_RATE // 10)]
    return first


def _words(first: float, last: float, name: str) -> list[tuple[float, float, str]]:
    """A word every 0.5 s (0.4 s long) from `first` to `last`, named `name`1, `name`2, ..."""
    count = int(round((last - first) / 0.5)) + 1
    return [(first + 0.5 * i, first + 0.5 * i + 0.4, f"{name}{i}") for i in range(count)]


def test_every_word_across_a_cut_in_speech_is_kept_once(tmp_path, monkeypatch):
    """Speech from 52 to 80 s leaves no silence near the grid line: the cut stays at 65 s, both
    pieces hear the words around it, each placing them on its side, and each is kept once."""
    said = _words(60.0, 70.0, "word")
    text = _heard(tmp_path, monkeypatch, [(52.0, 28.0)], said)
    path = tmp_path / "talk.m4a"
    assert not pieces.find_cut(str(path), 65.0, transcribe.speech_spans).silent
    for _, _, word in said:
        assert text.split().count(word) == 1, (word, text)


def test_every_word_just_after_a_cut_in_silence_is_kept_once(tmp_path, monkeypatch):
    """Speech until 64.4 s and again from 65.2 s: the cut goes into the silence between, and the
    words said just after it, which a piece reaching past the cut would place before it, come
    back once and after the cut."""
    said = _words(60.0, 64.0, "before") + _words(65.2, 70.2, "after")
    text = _heard(tmp_path, monkeypatch, [(50.0, 14.4), (65.2, 15.0)], said)
    cut = pieces.find_cut(str(tmp_path / "talk.m4a"), 65.0, transcribe.speech_spans)
    assert cut.silent and 64.4 < cut.at < 65.2, cut
    for _, _, word in said:
        assert text.split().count(word) == 1, (word, text)
