"""The square frame transform families share, and the app's default frame preparation: bicubic
resize to S x S as PIL does it, rescale 1/255, normalise (mean = std = 0.5 unless a family gives its
own).

mPLUG-Owl3's processor resizes PIL images with PIL's BICUBIC filter (reference mplug_owl3.md §5.3),
then `ToTensor` + `Normalize(0.5, 0.5)`. The same arithmetic runs here on tensors, batched, so a
video's frames never go through PIL:

- PIL's bicubic is the Keys cubic with a = -0.5, widened by the scale factor when shrinking
  (antialiasing), done as two separable passes (horizontal, then vertical) that round and clip to
  uint8 in between. torch's `interpolate(mode="bicubic", antialias=True)` uses the same filter
  (without `antialias` it uses a = -0.75 and no widening, which is far off: up to 130 levels on
  noisy frames).
- On CPU with uint8 input we call torch's uint8 kernel, written to match PIL: it agrees with PIL to
  at most 1-2 grey levels (out of 255) on a small fraction of pixels, from fixed-point rounding. It
  is ~10x faster than float.
- Elsewhere (CUDA) we run the two passes in float32 and round + clip between and after them, as PIL
  does; this also lands within 1-2 levels of PIL. (A single float 2-D pass without the intermediate
  clip differs by up to ~20 levels on noise, because PIL clips the overshoot after the first pass.)
- Which Pillow: lvx follows Pillow <= 12 (horizontal pass first, a pass skipped when its side keeps
  its size), the library the official processor used in 2024, so the frames look like the ones the
  weights were trained on. Pillow 13 is reported to change the pass order when only the height
  shrinks (not measured against Pillow 13); lvx keeps the older order on purpose, and a comparison
  against Pillow 13 may then differ by more than the 1-2 levels above on such frames.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MEAN = 0.5
STD = 0.5
_CHUNK = 32  # frames per interpolate call: bounds the float temporaries for long videos


def _as_uint8_nhwc(frames: Any) -> torch.Tensor:
    """Accept a torch tensor / numpy array (N,H,W,3) or (H,W,3), a PIL image or a list of PIL
    images."""
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise ValueError("no frames given")
        return torch.stack([_as_uint8_nhwc(f)[0] for f in frames])
    if not isinstance(frames, (torch.Tensor, np.ndarray)):  # PIL image (optional dependency)
        frames = np.asarray(frames.convert("RGB"))
    if isinstance(frames, np.ndarray):
        frames = np.ascontiguousarray(frames)
        frames = torch.from_numpy(frames if frames.flags.writeable else frames.copy())
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
        raise ValueError(
            f"expected uint8 RGB frames of shape (N, H, W, 3), got {frames.dtype} "
            f"{tuple(frames.shape)}"
        )
    return frames


def resize_uint8(frames: Any, height: int, width: int | None = None) -> torch.Tensor:
    """PIL-style bicubic resize of uint8 frames (N,H,W,3) -> uint8 (N,3,height,width) on the input's
    device."""
    x = _as_uint8_nhwc(frames)
    width = height if width is None else width
    n, h, w, _ = x.shape
    out = torch.empty((n, 3, height, width), dtype=torch.uint8, device=x.device)
    for i in range(0, n, _CHUNK):
        # NCHW view of NHWC memory (channels-last: the fast uint8 kernel)
        c = x[i : i + _CHUNK].permute(0, 3, 1, 2)
        if (h, w) == (height, width):
            out[i : i + _CHUNK] = c
        elif c.device.type == "cpu":
            out[i : i + _CHUNK] = F.interpolate(
                c, size=(height, width), mode="bicubic", antialias=True
            )
        else:
            out[i : i + _CHUNK] = _resize_two_pass(c, height, width)
    return out


def _resize_two_pass(c: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """PIL's order on any device: horizontal pass, round + clip to uint8 levels, vertical pass,
    round + clip."""
    f = c.float()
    if f.shape[-1] != width:
        f = (
            F.interpolate(f, size=(f.shape[-2], width), mode="bicubic", antialias=True)
            .round_()
            .clamp_(0, 255)
        )
    if f.shape[-2] != height:
        f = (
            F.interpolate(f, size=(height, width), mode="bicubic", antialias=True)
            .round_()
            .clamp_(0, 255)
        )
    return f.to(torch.uint8)


def normalize(u8: torch.Tensor) -> torch.Tensor:
    """uint8 (N,3,H,W) -> float32 in [-1, 1]: ToTensor (/255) then Normalize(mean=0.5, std=0.5)."""
    return u8.float().div_(255.0).sub_(MEAN).div_(STD)


def to_pixel_values(frames: Any, size: int) -> torch.Tensor:
    """Frames uint8 (N,H,W,3) (torch/numpy/PIL) -> float32 (N,3,size,size) pixel values for the
    vision tower.

    Aspect ratio is ignored (as the official processor does for video frames and the global view /
    no-cut case). The result stays on the input tensor's device.
    """
    return normalize(resize_uint8(frames, size, size)).contiguous()


def square_prep(size: int):
    """Frames bicubic to a square of `size`, then `normalize` (mPLUG-Owl3's, and the app's default
    preparation)."""
    from .surface import FramePrep

    return FramePrep(size, resize_uint8, normalize)  # resize_uint8(frames, S): S x S
