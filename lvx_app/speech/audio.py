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
PREROLL_S = 0.25  # decoded before a stretch and dropped: the decoder's state is settled by then


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


def speech_span(path: str | Path) -> float | None:
    """Seconds of `path`'s audio worth transcribing: its first audio stream, cut at the end of its
    video stream when it has one (audio that runs on past the picture is nothing the video shows);
    None when it has no audio."""
    import av

    audio = audio_duration(path)
    if not audio:
        return audio
    try:
        with _container(av, path) as container:
            if not container.streams.video:
                return audio
            stream = container.streams.video[0]
            if stream.duration is None or stream.time_base is None:
                return audio
            start = float((stream.start_time or 0) * stream.time_base)
            return min(audio, start + float(stream.duration * stream.time_base))
    except (av.error.FFmpegError, OSError):
        return audio


def read_audio(
    path: str | Path, start: float, end: float, bad: list[float] | None = None
) -> np.ndarray:
    """The samples from `start` to `end` seconds (fewer when the audio ends first), 16 kHz mono
    float32. Always decoded from a seek to `start`, so every rank that asks for the same stretch
    gets the same samples. A packet that cannot be decoded is heard as silence, its time appended
    to `bad`; a container that cannot be read is a SpeechError line."""
    import av

    first, last = int(round(start * SAMPLE_RATE)), int(round(end * SAMPLE_RATE))
    out: list[np.ndarray] = []
    try:
        with _container(av, path) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            if start > 0:  # to the audio packet before `start` (a video's key frames may be an
                # hour apart: seeking by them would decode that hour again for every stretch)
                at = max(0.0, start - PREROLL_S) / stream.time_base
                container.seek(int(at), stream=stream, any_frame=False)
            got = _Decoded(first, last, out).run(av, container, stream, resampler, bad)
    except NotARegularFile as exc:
        raise SpeechError(str(exc)) from None
    except (av.error.FFmpegError, IndexError, ValueError) as exc:
        raise AudioDecodeError(
            f"the audio of {Path(path).name} could not be decoded near {start:.0f} s ({exc})"
        ) from None
    lead = np.zeros(max(0, got - first), np.float32)  # the audio starts after `start`
    return np.concatenate([lead, *out])[: last - first]


GAP = SAMPLE_RATE // 100  # a jump in the time stamps longer than this is a hole: filled with zeros


class _Decoded:
    """Samples from sample `first` to `last` appended to `out` packet by packet, a packet that
    cannot be decoded skipped (its place filled with silence, so later words keep their times)."""

    def __init__(self, first: int, last: int, out: list) -> None:
        self.first, self.last, self.out = first, last, out
        self.at: int | None = None  # the sample number of the next sample decoded
        self.begin: int | None = None  # the sample number of the first sample appended

    def run(self, av, container, stream, resampler, bad: list[float] | None) -> int:
        """Decode; returns the first appended sample's number (`first` unless the audio starts
        later)."""
        for packet in container.demux(stream):
            try:
                frames = packet.decode()
            except av.error.FFmpegError:  # one damaged packet: heard as silence
                if bad is not None and packet.pts is not None:
                    bad.append(max(0.0, round(float(packet.pts * packet.time_base), 2)))
                continue
            for frame in frames:
                self.frame(frame, resampler)
            if self.at is not None and self.at >= self.last:
                break
        return self.first if self.begin is None else self.begin

    def frame(self, frame, resampler) -> None:
        stamp = int(round(float(frame.pts * frame.time_base) * SAMPLE_RATE)) if frame.pts else 0
        if self.at is None or stamp < self.at - GAP:
            self.at = stamp
        elif stamp > self.at + GAP:
            self.add(np.zeros(stamp - self.at, np.float32))
        for piece in resampler.resample(frame):
            self.add(piece.to_ndarray().reshape(-1).astype(np.float32, copy=False))

    def add(self, data: np.ndarray) -> None:
        if self.at + len(data) > self.first:
            cut = max(0, self.first - self.at)
            self.out.append(data[cut:])
            self.begin = self.at + cut if self.begin is None else self.begin
        self.at += len(data)
