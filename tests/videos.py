"""Test-only videos and encoders; the index-carrying video generator itself is
`lvx_app.video.synthetic`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from lvx_app.video.synthetic import (
    BITS,
    COLS,
    ROWS,
    add_subtitle_stream,
    concat_video,
    frame_image,
    make_video,
    read_index,
)

__all__ = [
    "BITS",
    "COLS",
    "ROWS",
    "add_subtitle_stream",
    "concat_video",
    "frame_image",
    "make_video",
    "read_index",
    "make_not_a_video",
    "make_zero_length",
    "make_truncated",
    "make_audio_only",
    "IndexEncoder",
    "index_from_features",
]


def make_not_a_video(path: str | os.PathLike) -> Path:
    path = Path(path)
    path.write_text("this is a text file, not a video\n" * 50)
    return path


def make_zero_length(path: str | os.PathLike) -> Path:
    path = Path(path)
    path.write_bytes(b"")
    return path


def make_audio_only(path: str | os.PathLike, seconds: float = 1.0) -> Path:
    """An .m4a/.mp4 with one AAC track of silence and no video stream, written with PyAV."""
    import av

    path, rate = Path(path), 16000
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=rate)
        for i in range(int(seconds * rate) // 1024):
            frame = av.AudioFrame.from_ndarray(
                np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono"
            )
            frame.sample_rate, frame.pts = rate, i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


def make_truncated(src: str | os.PathLike, dst: str | os.PathLike, keep: float = 0.5) -> Path:
    """Copy the first `keep` fraction of a video's bytes: a corrupt / partly downloaded file."""
    data = Path(src).read_bytes()
    dst = Path(dst)
    dst.write_bytes(data[: int(len(data) * keep)])
    return dst


class IndexEncoder:
    """A tiny deterministic stand-in for the vision tower + projector: (n, 3, S, S) -> (n, T, H).

    Row 0 of each frame's features holds the mean pixel value of each index block (positive =
    white), so `index_from_features` recovers which frame the features came from; rows 1.. are a
    fixed random linear map of the same block means, so the features look like a real encoder's
    (dense, frame-dependent).
    """

    def __init__(self, tokens: int = 4, hidden: int = 16, seed: int = 0) -> None:
        import torch

        assert hidden >= BITS
        g = torch.Generator().manual_seed(seed)
        self.tokens, self.hidden = tokens, hidden
        self.weight = torch.randn(BITS, (tokens - 1) * hidden, generator=g)

    def __call__(self, pixel_values):
        import torch
        import torch.nn.functional as F

        n = pixel_values.shape[0]
        grey = pixel_values.float().mean(dim=1, keepdim=True)
        blocks = F.adaptive_avg_pool2d(grey, (ROWS, COLS)).reshape(n, BITS)
        row0 = torch.zeros(n, 1, self.hidden, device=pixel_values.device)
        row0[:, 0, :BITS] = blocks
        rest = (blocks @ self.weight.to(blocks.device)).reshape(n, self.tokens - 1, self.hidden)
        return torch.cat([row0, rest], dim=1).to(pixel_values.dtype)


def index_from_features(features) -> list[int]:
    """Frame indices encoded by IndexEncoder features (n, T, H)."""
    bits = (features[:, 0, :BITS].float() > 0).long().cpu()
    weights = (1 << np.arange(BITS)).tolist()
    return [int(sum(b * w for b, w in zip(row, weights))) for row in bits.tolist()]
