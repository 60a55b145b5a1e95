"""Mllama's image processing, as the published processor does it: pick the tile arrangement whose
canvas needs the least upscaling (else the least downscaling), resize to fit it keeping the aspect
ratio (PIL bilinear, the published filter), pad right and bottom with black, rescale to [0, 1],
normalize with CLIP's mean and std, split into tiles row by row.

An aspect-ratio id is 1 + the arrangement's index among all (height, width) tile counts whose
product is at most `max_tiles` ((1, 1) is id 1 whatever `max_tiles` is)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@lru_cache(maxsize=16)
def arrangements(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(tiles high, tiles wide) with at most `max_tiles` tiles, in the published order."""
    n = range(1, max_tiles + 1)
    return tuple((a, b) for a in n for b in n if a * b <= max_tiles)


def best_arrangement(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """The arrangement whose canvas fits the image with the smallest upscale >= 1, else the
    largest downscale; ties go to the smallest canvas."""
    options = np.array(arrangements(max_tiles))
    canvas = options * tile
    scales = np.minimum(canvas[:, 0] / height, canvas[:, 1] / width)
    up = scales[scales >= 1]
    chosen = up.min() if len(up) else scales[scales < 1].max()
    picked = options[scales == chosen]
    best = picked[np.argmin(picked[:, 0] * picked[:, 1])]
    return int(best[0]), int(best[1])


def fitted_size(height: int, width: int, canvas_h: int, canvas_w: int, tile: int):
    """The image's size inside the canvas, aspect ratio kept (never below one tile a side unless the
    canvas is)."""
    target_w = int(np.clip(width, tile, canvas_w))
    target_h = int(np.clip(height, tile, canvas_h))
    scale_h, scale_w = target_h / height, target_w / width
    if scale_w < scale_h:
        return min(math.floor(height * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width * scale_h) or 1, target_w)


@dataclass(frozen=True)
class TiledImage:
    tiles: np.ndarray  # (n_tiles, 3, tile, tile) float32, normalized
    arrangement: tuple[int, int]  # (tiles high, tiles wide)
    ratio_id: int


def tile_image(
    image: np.ndarray | Image.Image, tile: int, max_tiles: int, mean=CLIP_MEAN, std=CLIP_STD
) -> TiledImage:
    """One RGB image (H, W, 3) uint8 or PIL -> its normalized tiles."""
    pil = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
    pil = pil.convert("RGB")
    w, h = pil.size
    rows, cols = best_arrangement(h, w, max_tiles, tile)
    new_h, new_w = fitted_size(h, w, rows * tile, cols * tile, tile)
    resized = np.asarray(pil.resize((new_w, new_h), Image.BILINEAR))
    canvas = np.zeros((rows * tile, cols * tile, 3), dtype=np.uint8)
    canvas[:new_h, :new_w] = resized
    x = canvas.astype(np.float32) * np.float32(1 / 255)
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    x = x.transpose(2, 0, 1).reshape(3, rows, tile, cols, tile).transpose(1, 3, 0, 2, 4)
    tiles = np.ascontiguousarray(x.reshape(rows * cols, 3, tile, tile))
    return TiledImage(tiles, (rows, cols), arrangements(max_tiles).index((rows, cols)) + 1)


def fit_and_pad_uint8(frames, size: int) -> torch.Tensor:
    """Video frames uint8 (n, H, W, 3) as one tile each: resized keeping the aspect ratio to fit
    size x size and padded right and bottom with black, exactly `tile_image(.., max_tiles=1)`'s
    canvas -> uint8 (n, 3, size, size). The decode workers' half of `frame_prep`."""
    frames = np.asarray(frames)
    out = np.zeros((len(frames), 3, size, size), dtype=np.uint8)
    for i, frame in enumerate(frames):
        h, w = frame.shape[:2]
        new_h, new_w = fitted_size(h, w, size, size, size)
        pil = Image.fromarray(np.ascontiguousarray(frame)).convert("RGB")
        out[i, :, :new_h, :new_w] = np.asarray(
            pil.resize((new_w, new_h), Image.BILINEAR)
        ).transpose(2, 0, 1)
    return torch.from_numpy(out)


def normalize_uint8(u8, mean=CLIP_MEAN, std=CLIP_STD):
    """uint8 (n, 3, S, S) -> float32 pixel values, `tile_image`'s arithmetic (x * 1/255 - mean) /
    std."""
    u8 = torch.as_tensor(u8)
    x = u8.to(torch.float32) * torch.tensor(np.float32(1 / 255), device=u8.device)
    m = torch.tensor(mean, dtype=torch.float32, device=u8.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=u8.device).view(1, 3, 1, 1)
    return (x - m) / s
