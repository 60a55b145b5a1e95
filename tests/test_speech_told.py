"""The user is told where subtitles came from: `--subtitles speech` over a video's own subtitles
says what it sets aside; `/transcript` without a transcript says why (subtitles, no audio track,
no extra), and offers `--subtitles speech` only where it would give one; the chat line names the
speech model and whether its transcript was read back."""

from __future__ import annotations

import shutil

import pytest

from lvx_app.config import VideoConfig
from lvx_app.engine.describe import placed_line
from lvx_app.engine.records import VideoRequest, VideoSummary
from lvx_app.subtitles import Cue

pytest.importorskip("faster_whisper")


def test_speech_over_subtitles_says_what_it_replaces(short_video, tmp_path):
    video = tmp_path / "film.mp4"
    shutil.copy(short_video, video)
    (tmp_path / "film.srt").write_text("1\n00:00:01,000 --> 00:00:02,000\nHello.\n")
    request = VideoRequest.of(str(video), VideoConfig(subtitles="speech"))
    track = request.subtitle_track()
    assert request.resolved(track).speech
    assert track.notes == ["--subtitles speech: the speech is transcribed in place of film.srt"]


def test_the_transcript_hint_fits_the_video(short_video):
    from lvx_app.cli import chat

    silent = VideoSummary(short_video, 10, 1.0, 10.0, 100, False, 1.0)
    assert chat.no_transcript_line(silent) == "no transcript: the video has no audio track"
    subtitled = VideoSummary(short_video, 10, 1.0, 10.0, 100, False, 1.0, subtitle_source="a.srt")
    assert chat.no_transcript_line(subtitled) == "no transcript: the subtitles came from a.srt"


def test_the_placed_line_names_the_model_and_the_cache():
    cues = [Cue(0.0, 1.0, "a."), Cue(2.0, 3.0, "b.")]
    read = VideoSummary(
        "v.mp4", 1, 0.05, 10.0, 729, False, 1.0, subtitle_lines=2, transcript=cues,
        subtitle_source="speech (base)", transcript_from_cache=True,
    )  # fmt: skip
    assert placed_line(read, read.subtitle_source) == (
        "2 of 2 transcript line(s) placed, from speech (base), read back from the cache"
    )


def test_the_transcript_is_saved_as_srt(tmp_path):
    from rich.console import Console

    from lvx_app.cli.chat import save_transcript
    from lvx_app.subtitles import read_subtitle_file

    cues = [Cue(1.25, 2.5, "The bridge is open."), Cue(3.0, 4.0, "Rain fell.")]
    summary = VideoSummary("v.mp4", 1, 1.0, 10.0, 729, False, 1.0, transcript=cues)
    console = Console(record=True, width=200)
    save_transcript(summary, str(tmp_path / "talk.srt"), console)
    assert read_subtitle_file(tmp_path / "talk.srt").cues == cues
    save_transcript(summary, str(tmp_path / "no" / "such" / "talk.srt"), console)
    said = console.export_text().splitlines()
    assert said[0] == f"saved 2 cue(s) to {tmp_path / 'talk.srt'}"
    assert said[1].startswith("could not write ") and len(said) == 2
