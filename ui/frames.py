"""A video sent as its frames: the images an evaluation harness extracted (lmms-eval's default, and
vLLM's `data:video/jpeg;base64,<f1>,<f2>,...`), made one video file again so the engine loads it as
any other, one frame per 1/fps seconds, in the order given.

The frames are written losslessly (H.264 at quantiser 0) so the pixels the model sees are the
sender's, up to the 4:2:0 colour the decoder reads anyway; the file is named by the frames and the
rate, so the same frames sent again are the same file and their features come from the cache.
"""

from __future__ import annotations

import fractions
import hashlib
import io
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

IMAGE_TYPES = ("png", "jpeg", "jpg", "webp")  # what a frame's data URL may carry
FRAME_RATES = (0.001, 1000.0)  # frames a second an mp4 of frames holds exactly (a 1/1001 grid)


class FrameError(ValueError):
    """A frame that is no image: one line naming it."""


def frames_name(frames: Sequence[bytes], fps: float) -> str:
    """The file name of these frames at this rate (the same frames, the same file)."""
    digest = hashlib.sha256(f"{fps!r}:{len(frames)}".encode())
    for frame in frames:
        digest.update(hashlib.sha256(frame).digest())
    return digest.hexdigest()[:32] + ".mp4"


def check_rate(fps: float) -> None:
    """Refuse a rate the frames' video cannot hold: beyond it the frames would silently merge
    (or the container's rate overflow)."""
    low, high = FRAME_RATES
    if not low <= fps <= high:
        raise FrameError(
            f"frames sent as images are shown at {low:g} to {high:g} frames a second; "
            f"fps {fps:g} is outside that"
        )


def decode_frames(frames: Sequence[bytes]) -> list[np.ndarray]:
    """Each frame as (H, W, 3) uint8, all the size of the first (others resized to it), both sides
    even (the encoder's 4:2:0 needs them so)."""
    from PIL import Image, UnidentifiedImageError

    out, size = [], None
    for i, raw in enumerate(frames):
        try:
            with Image.open(io.BytesIO(raw)) as image:
                image = image.convert("RGB")
                if size is None:
                    size = (max(2, image.width // 2 * 2), max(2, image.height // 2 * 2))
                if image.size != size:
                    image = image.resize(size, Image.Resampling.BICUBIC)
                out.append(np.asarray(image, dtype=np.uint8))
        except Image.DecompressionBombError:
            most = 2 * Image.MAX_IMAGE_PIXELS  # Pillow's own refusal: beyond it, a bomb
            raise FrameError(
                f"frame {i + 1} is too large an image (at most {most:,} pixels)"
            ) from None
        except (UnidentifiedImageError, OSError, ValueError):
            raise FrameError(f"frame {i + 1} is not a PNG or JPEG image") from None
    return out


def write_frames(path: Path, frames: Sequence[np.ndarray], fps: float) -> Path:
    """An mp4 at `path` whose frame k is `frames[k]`, shown at k / fps seconds (written beside it
    first, then moved in: a reader never sees half a file)."""
    check_rate(fps)
    import av  # PyAV (its own FFmpeg build), as the synthetic videos are written

    part = path.parent / f".{uuid.uuid4().hex}.part"
    try:
        with av.open(str(part), "w", format="mp4") as container:
            stream = container.add_stream(
                "libx264", rate=fractions.Fraction(fps).limit_denominator(1001)
            )
            height, width = frames[0].shape[:2]
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"preset": "veryfast", "qp": "0"}
            for image in frames:
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path
