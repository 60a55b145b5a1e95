"""A video's audio as Whisper hears it: 16 kHz mono float32, decoded with PyAV one stretch at a
time (an hour of audio is never held whole), so each rank reads only its own pieces of the file."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from lvx_app.regular_files import NotARegularFile, by_descriptor, open_regular
from lvx_app.video.errors import VideoError

SAMPLE_RATE = 16000  # what Whisper's feature extractor takes


class SpeechError(VideoError):
    """Speech that cannot be transcribed (no [speech] extra, a model that cannot be loaded, audio
    that cannot be decoded): one line that says what to do next. It crosses to the frontend as its
    own type."""


class AudioDecodeError(SpeechError):
    """The audio track is there but cannot be decoded: the video loads without a transcript."""


@contextlib.contextmanager
def _container(av, path: str | Path):
    """PyAV's container of the regular file `path` (never a FIFO that blocks: FFmpeg opens the
    very file checked)."""
    fd = open_regular(path)
    try:
        with av.open(by_descriptor(fd, path)) as container:
            yield container
    finally:
        os.close(fd)


def audio_duration(path: str | Path) -> float | None:
    """Seconds of the first audio stream of `path`; None when it has none (or the file cannot be
    opened: the video loader says so in its own words)."""
    import av  # PyAV: only when a video's audio is asked for

    try:
        with _container(av, path) as container:
            if not container.streams.audio:
                return None
            stream = container.streams.audio[0]
            if stream.duration is not None and stream.time_base is not None:
                return float(stream.duration * stream.time_base)
            if container.duration is not None:
                return container.duration / 1_000_000
            return 0.0
    except (av.error.FFmpegError, OSError):
        return None


def read_audio(path: str | Path, start: float, end: float) -> np.ndarray:
    """The samples from `start` to `end` seconds (fewer when the audio ends first), 16 kHz mono
    float32. Always decoded from a seek to `start`, so every rank that asks for the same stretch
    gets the same samples. Audio that cannot be decoded is a SpeechError line."""
    import av

    first, last = int(round(start * SAMPLE_RATE)), int(round(end * SAMPLE_RATE))
    out: list[np.ndarray] = []
    try:
        with _container(av, path) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            if start > 0:
                container.seek(int(start * 1_000_000), any_frame=False)  # to the key frame before
            got = _decode(container, stream, resampler, first, last, out)
    except NotARegularFile as exc:
        raise SpeechError(str(exc)) from None
    except (av.error.FFmpegError, IndexError, ValueError) as exc:
        raise AudioDecodeError(
            f"the audio of {Path(path).name} could not be decoded near {start:.0f} s ({exc})"
        ) from None
    lead = np.zeros(max(0, got - first), np.float32)  # the audio starts after `start`
    return np.concatenate([lead, *out])[: last - first]


def _decode(container, stream, resampler, first: int, last: int, out: list) -> int:
    """Append the samples from sample `first` to `last` to `out`; returns the sample number the
    first appended sample has (`first` unless the audio starts later)."""
    begin = None
    for frame in container.decode(stream):
        at = int(round(float(frame.pts * frame.time_base) * SAMPLE_RATE)) if frame.pts else 0
        for piece in resampler.resample(frame):
            data = piece.to_ndarray().reshape(-1).astype(np.float32, copy=False)
            if at + len(data) > first:
                cut = max(0, first - at)
                out.append(data[cut:])
                begin = at + cut if begin is None else begin
            at += len(data)
        if at >= last:
            break
    return first if begin is None else begin
