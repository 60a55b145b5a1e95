"""Synthetic videos whose frames show their own index (and, for subtitle tests, a subtitle stream),
for `lvx demo`, benchmarks and tests.

Each frame is a grid of `ROWS x COLS` blocks; block b (row-major) is white when bit b of the frame
index is set, black otherwise. A faint moving gradient is added so the encoder sees real motion, but
never enough to flip a block (blocks are 0 +- 40 or 255 -+ 40). `read_index(frame)` decodes a frame
(H,W,3) uint8 or a (3,S,S) tensor of normalised pixel values back to the index, so tests can check
exactly which frames were sampled.

Written with PyAV (its own bundled FFmpeg); nothing is downloaded.
"""

from __future__ import annotations

import fractions
import os
from pathlib import Path

import numpy as np

from lvx_app.subtitles import write_srt  # noqa: F401 - the writer the scripts and tests use

ROWS, COLS = 3, 4  # 12 bits: indices up to 4095
BITS = ROWS * COLS


def frame_image(
    index: int, width: int, height: int, noise: float = 0.0, texture: np.ndarray | None = None
) -> np.ndarray:
    """uint8 (height, width, 3) frame showing `index` as binary blocks.

    `noise` > 0 adds a fixed random texture (amplitude `noise` grey levels) panning 4 px per frame,
    so the encoder has detail and motion to code, like real footage (a few Mbit/s at 720p), instead
    of flat blocks.
    """
    ys = (np.arange(height) * ROWS) // height
    xs = (np.arange(width) * COLS) // width
    block = ys[:, None] * COLS + xs[None, :]
    bits = (index >> block) & 1
    base = np.where(bits == 1, 215.0, 40.0)
    grad = 40.0 * (((np.arange(width)[None, :] + 3 * index) % width) / width)
    img = base + grad
    if noise:
        if texture is None:
            texture = _texture(width, height)
        img = img + noise * np.roll(texture, 4 * index, axis=1)
    img = np.clip(img, 0, 255).astype(np.uint8)
    return np.repeat(img[:, :, None], 3, axis=2)


def read_index(frame) -> int:
    """Decode the index from an RGB frame (H,W,3) uint8, or from pixel values (3,S,S) in [-1, 1]."""
    a = np.asarray(
        frame.detach().cpu().float() if hasattr(frame, "detach") else frame, dtype=np.float64
    )
    if a.ndim == 3 and a.shape[0] == 3 and a.shape[-1] != 3:  # (3,S,S) normalised pixel values
        a = (a.transpose(1, 2, 0) * 0.5 + 0.5) * 255.0
    grey = a.mean(axis=2)
    h, w = grey.shape
    index = 0
    for b in range(BITS):
        r, c = divmod(b, COLS)
        y0, y1 = (r * h) // ROWS, ((r + 1) * h) // ROWS
        x0, x1 = (c * w) // COLS, ((c + 1) * w) // COLS
        cy, cx = (y1 - y0) // 4, (x1 - x0) // 4  # the central half of the block
        if grey[y0 + cy : y1 - cy, x0 + cx : x1 - cx].mean() > 128:
            index |= 1 << b
    return index


def _texture(width: int, height: int) -> np.ndarray:
    """Smooth-ish random texture in [-1, 1]: noise at 1/4 resolution, upsampled."""
    rng = np.random.default_rng(1234)
    small = rng.uniform(-1, 1, size=((height + 3) // 4, (width + 3) // 4))
    return np.kron(small, np.ones((4, 4)))[:height, :width]


def make_video(
    path: str | os.PathLike,
    num_frames: int,
    fps: float | fractions.Fraction = 30,
    width: int = 64,
    height: int = 64,
    *,
    codec: str = "libx264",
    gop: int | None = None,
    noise: float = 0.0,
    crf: int | None = None,
    start_index: int = 0,
) -> Path:
    """Write an H.264 (yuv420p) mp4 whose frame i shows index start_index + i. Returns the path."""
    import av  # PyAV (its own FFmpeg build) is loaded only where a video is written

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rate = (
        fractions.Fraction(fps).limit_denominator(1001)
        if not isinstance(fps, fractions.Fraction)
        else fps
    )
    texture = _texture(width, height) if noise else None
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        opts = {"preset": "veryfast"}
        if crf is not None:
            opts["crf"] = str(crf)
        if gop is not None:
            s.codec_context.gop_size = gop
            opts["keyint"] = str(gop)
        if codec == "libx264":
            s.options = opts
        for i in range(num_frames):
            img = frame_image(start_index + i, width, height, noise=noise, texture=texture)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def concat_video(src: str | os.PathLike, dst: str | os.PathLike, times: int) -> Path:
    """Stream-copy `src` `times` times back to back into `dst` (no re-encode): a long video in
    seconds.

    The frames repeat, so indices are only unique within one copy; decoding cost is that of a real
    long video.
    """
    import av  # PyAV (its own FFmpeg build) is loaded only where a video is written

    dst = Path(dst)
    with av.open(str(src)) as probe:
        packets = [p for p in probe.demux(probe.streams.video[0]) if p.size]
        vs = probe.streams.video[0]
        tb = vs.time_base
        span = max(int(p.pts) for p in packets) - min(int(p.pts) for p in packets)
        step = span + int(round(1 / (vs.average_rate * tb)))  # one frame after the last one
        first_dts = min(int(p.dts) for p in packets)
        first_pts = min(int(p.pts) for p in packets)
        with av.open(str(dst), "w") as out:
            os_ = out.add_stream_from_template(vs)
            for k in range(times):
                for p in packets:
                    q = av.Packet(bytes(p))
                    q.pts = int(p.pts) - first_pts + k * step
                    q.dts = int(p.dts) - first_pts + k * step
                    q.is_keyframe = p.is_keyframe
                    q.time_base = tb
                    q.stream = os_
                    out.mux(q)
    _ = first_dts
    return dst


_ASS_HEADER = (
    "[Script Info]\nScriptType: v4.00+\n\n[V4+ Styles]\nFormat: Name, Fontname, Fontsize, "
    "PrimaryColour, SecondaryColour, "
    "OutlineColour, BackColour, Bold, Italic, Underline, StrikeOut, ScaleX, ScaleY, Spacing, "
    "Angle, BorderStyle, "
    "Outline, Shadow, Alignment, MarginL, MarginR, MarginV, Encoding\nStyle: "
    "Default,Arial,16,&Hffffff,&Hffffff,&H0,&H0,"
    "0,0,0,0,100,100,0,0,1,1,0,2,10,10,10,0\n\n[Events]\nFormat: Layer, Start, End, Style, Name, "
    "MarginL, MarginR, "
    "MarginV, Effect, Text\n"
)


def add_subtitle_stream(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    cues: list[tuple[float, float, str]],
    codec: str = "mov_text",
    language: str | None = "eng",
) -> Path:
    """Copy `src`'s video stream into `dst` with one subtitle stream of `codec` (mov_text for .mp4;
    subrip, webvtt, ass or dvdsub for .mkv) holding `cues` (start s, end s, text), written with
    PyAV. A dvdsub stream gets no cues (a bitmap stream is all a test of "unsupported" needs)."""
    import av

    dst = Path(dst)
    with av.open(str(src)) as inp, av.open(str(dst), "w") as out:
        vin = inp.streams.video[0]
        vout = out.add_stream_from_template(vin)
        sub = out.add_stream(codec)
        if language:
            sub.metadata["language"] = language
        if codec != "dvdsub":
            sub.codec_context.subtitle_header = _ASS_HEADER.encode()
        for packet in inp.demux(vin):
            if packet.dts is not None:
                packet.stream = vout
                out.mux(packet)
        for k, (start, end, text) in enumerate(cues if codec != "dvdsub" else []):
            data = text.encode()
            if codec == "mov_text":
                data = len(data).to_bytes(2, "big") + data
            elif codec in ("ass", "ssa"):
                data = f"{k},0,Default,,0,0,0,,{text}".encode()
            packet = av.Packet(data)
            packet.stream = sub
            packet.pts = packet.dts = int(start / sub.time_base)
            packet.duration = int((end - start) / sub.time_base)
            out.mux(packet)
    return dst
