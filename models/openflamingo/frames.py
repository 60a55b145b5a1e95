"""A frame as open_clip's `openai` preprocessing makes an image for CLIP ViT-L/14: resized so its
shorter side is S (bicubic, as PIL does it), center-cropped to S x S, rescaled by 1/255 and
normalized with the openai mean and std (`Resize(S)`, `CenterCrop(S)`, `ToTensor`, `Normalize`)."""

from __future__ import annotations

import numpy as np
import torch

from ..pixels import resize_uint8

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def shorter_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) after torchvision's `Resize(size)`: the shorter side becomes `size`, the
    longer one `int(size * long / short)` (truncated, as torchvision does)."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


def resize_crop_uint8(frames, size: int) -> torch.Tensor:
    """uint8 frames (n, H, W, 3) -> uint8 (n, 3, size, size): the shorter side resized to `size`,
    then the center `size` x `size` (the crop's corner rounded as torchvision's `CenterCrop`). The
    decode workers' half of `frame_prep`."""
    frames = torch.as_tensor(np.asarray(frames) if not torch.is_tensor(frames) else frames)
    frames = frames[None] if frames.ndim == 3 else frames
    h, w = int(frames.shape[-3]), int(frames.shape[-2])
    new_h, new_w = shorter_side_size(h, w, size)
    resized = resize_uint8(frames, new_h, new_w)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return resized[..., top : top + size, left : left + size].contiguous()


def normalize_openai(u8: torch.Tensor) -> torch.Tensor:
    """uint8 (n, 3, S, S) -> float32 pixel values: `ToTensor` (x / 255) then `Normalize` with the
    openai mean and std."""
    u8 = torch.as_tensor(u8)
    mean = torch.tensor(OPENAI_MEAN, dtype=torch.float32, device=u8.device).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_STD, dtype=torch.float32, device=u8.device).view(1, 3, 1, 1)
    return u8.to(torch.float32).div(255.0).sub(mean).div(std)
