"""Audio tracks for made-up videos: a sentence spoken by espeak-ng (when it is installed) and a
video's copy with an AAC track of given samples, written with PyAV. The demo's example clip speaks
through these; the tests write their clips with them."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from lvx_app.speech.audio import SAMPLE_RATE, read_audio

FRAME = 1024  # samples per AAC frame


def spoken(text: str) -> np.ndarray | None:
    """`text` spoken by espeak-ng at 16 kHz; None when espeak-ng is not installed (or fails)."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "spoken.wav"
        try:
            subprocess.run([espeak, "-w", str(wav), text], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        return read_audio(wav, 0.0, 3600.0)


def place(length_s: float, *parts: tuple[float, np.ndarray]) -> np.ndarray:
    """`length_s` seconds of silence with each (start s, samples) part laid in at its time."""
    out = np.zeros(int(length_s * SAMPLE_RATE), np.float32)
    for start, samples in parts:
        at = int(start * SAMPLE_RATE)
        piece = samples[: max(0, len(out) - at)]
        out[at : at + len(piece)] = piece
    return out


def write_audio(dst: str | Path, samples: np.ndarray, video: str | Path | None = None) -> Path:
    """Write `samples` (16 kHz mono) as an AAC track to `dst`, after `video`'s video stream copied
    when given (an audio-only file otherwise)."""
    import av

    dst = Path(dst)
    with av.open(str(dst), "w") as out:
        if video is not None:
            with av.open(str(video)) as inp:
                vin = inp.streams.video[0]
                vout = out.add_stream_from_template(vin)
                audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
                for packet in inp.demux(vin):
                    if packet.dts is not None:
                        packet.stream = vout
                        out.mux(packet)
        else:
            audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        _encode(out, audio, samples)
    return dst


def _encode(out, stream, samples: np.ndarray) -> None:
    import av

    samples = np.pad(samples.astype(np.float32), (0, -len(samples) % FRAME))
    for i in range(0, len(samples), FRAME):
        frame = av.AudioFrame.from_ndarray(
            samples[None, i : i + FRAME], format="fltp", layout="mono"
        )
        frame.sample_rate, frame.pts = SAMPLE_RATE, i
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)
