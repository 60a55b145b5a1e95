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
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

IMAGE_TYPES = ("png", "jpeg", "jpg", "webp")  # what a frame's data URL may carry
ENCODE_BYTES_PER_PIXEL = 32  # resized, as an array, in the encoder (measured: 27, rounded up)
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


def frame_sizes(frames: Sequence[bytes]) -> list[tuple[int, int]]:
    """Each frame's (width, height) as its header states it, nothing decoded: what decoding them
    will cost is known (`frames_cost`) before it is paid."""
    from PIL import Image, UnidentifiedImageError

    sizes = []
    for i, raw in enumerate(frames):
        try:
            with warnings.catch_warnings():  # the budget judges a large frame, in one line
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(raw))
            with image:
                sizes.append(image.size)
        except Image.DecompressionBombError:
            most = 2 * Image.MAX_IMAGE_PIXELS  # Pillow's own refusal: beyond it, a bomb
            raise FrameError(
                f"frame {i + 1} is too large an image (at most {most:,} pixels)"
            ) from None
        except (UnidentifiedImageError, OSError, ValueError):
            raise FrameError(f"frame {i + 1} is not a PNG or JPEG image") from None
    return sizes


def video_size(first: tuple[int, int]) -> tuple[int, int]:
    """The frames' video size: the first frame's, both sides even (the encoder's 4:2:0 needs
    them so)."""
    return max(2, first[0] // 2 * 2), max(2, first[1] // 2 * 2)


def frames_cost(sizes: Sequence[tuple[int, int]]) -> int:
    """The bytes of memory making the video of frames this size takes: one frame at a time is
    decoded (up to 4 bytes a pixel, then RGB), resized to the video's size, converted and
    encoded (the encoder keeps no frames queued)."""
    width, height = video_size(sizes[0])
    largest = max(w * h for w, h in sizes)
    return largest * 7 + width * height * ENCODE_BYTES_PER_PIXEL


def decoded_frames(frames: Sequence[bytes], size: tuple[int, int]) -> Iterator[np.ndarray]:
    """Each frame as (H, W, 3) uint8 of `size` (resized to it when it differs), one at a time."""
    from PIL import Image, UnidentifiedImageError

    for i, raw in enumerate(frames):
        try:
            with Image.open(io.BytesIO(raw)) as image:
                image = image.convert("RGB")
                if image.size != size:
                    image = image.resize(size, Image.Resampling.BICUBIC)
                yield np.asarray(image, dtype=np.uint8)
        except (UnidentifiedImageError, OSError, ValueError):
            raise FrameError(f"frame {i + 1} is not a PNG or JPEG image") from None


def write_frames(
    path: Path, frames: Iterable[np.ndarray], fps: float, size: tuple[int, int]
) -> Path:
    """An mp4 at `path` of frames `size` (width, height) whose frame k is the k-th of `frames`,
    shown at k / fps seconds (written beside it first, then moved in: a reader never sees half a
    file). The frames are taken one at a time: the encoder queues none (no look-ahead, no
    B-frames), so memory holds about one frame whatever their number."""
    check_rate(fps)
    import av  # PyAV (its own FFmpeg build), as the synthetic videos are written

    part = path.parent / f".{uuid.uuid4().hex}.part"
    try:
        with av.open(str(part), "w", format="mp4") as container:
            stream = container.add_stream(
                "libx264", rate=fractions.Fraction(fps).limit_denominator(1001)
            )
            stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
            stream.options = {"preset": "veryfast", "qp": "0", "tune": "zerolatency"}
            for image in frames:
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path
