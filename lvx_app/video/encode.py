"""Stream decoded chunks through the vision encoder into one resident tensor E_local (frames, T, H).

The encoder is any callable `encode_fn(pixel_values) -> features`: pixel values (n, 3, S, S) on the
rank's device in the features' dtype (bf16 on GPU), features (n, T, H) — for mPLUG-Owl3 the SigLIP
tower plus projector, T = 729 — or a `FrameFeatures` (a family's `encode_frames`), whose header
features are collected in host memory until the prompt's first rows are prefilled. Chunks may
arrive in any order; each is written at its offset. Only one chunk of pixels lives on the device at
a time, so device memory is E_local plus one encoder batch.

Pixels are prepared by the model family's own `FramePrep` (`lvx_models.api`; mPLUG-Owl3's
bicubic square when none is given): chunks already resized by the decode workers (uint8 (n, 3, S,
S)) only need its `normalize`; raw frames (n, H, W, 3) go through its `pixel_values`.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from lvx_app.devices import default_dtype
from lvx_models.api import FrameFeatures, FramePrep, square_prep

EncodeFn = Callable[[torch.Tensor], torch.Tensor | FrameFeatures]


def frame_numel(
    encode_fn: EncodeFn, image_size: int, device: torch.device, dtype: torch.dtype
) -> int:
    """Values `ShardEncoder` keeps per frame on `device`: E's, and its header features' when the
    device is the host that holds them."""
    out = _black_frame(encode_fn, image_size, device, dtype)
    held = out if device.type == "cpu" else out[:1]
    return sum(t[0].numel() for t in held if t is not None)


def _black_frame(encode_fn: EncodeFn, image_size: int, device, dtype) -> FrameFeatures:
    with torch.no_grad():
        out = encode_fn(torch.zeros(1, 3, image_size, image_size, device=device, dtype=dtype))
    return out if isinstance(out, FrameFeatures) else FrameFeatures(out)


class ShardEncoder:
    """Collects one rank's features. `add(offset, frames)` encodes a chunk; `result()` returns
    E_local, `header_features` the header features (None when the encoder gives none)."""

    def __init__(
        self,
        encode_fn: EncodeFn,
        num_frames: int,
        *,
        image_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        batch_size: int | None = None,
        prep: FramePrep | None = None,
    ) -> None:
        self.encode_fn = encode_fn
        self.prep = prep or square_prep(int(image_size))
        self.num_frames = int(num_frames)
        self.image_size = int(image_size)
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.batch_size = batch_size
        self.features: torch.Tensor | None = None
        self.header_features: torch.Tensor | None = None
        self.encoded = 0

    def _pixels(self, frames: np.ndarray | torch.Tensor, resized: bool) -> torch.Tensor:
        x = (
            torch.from_numpy(np.ascontiguousarray(frames))
            if isinstance(frames, np.ndarray)
            else frames
        )
        if self.device.type == "cuda" and x.device.type == "cpu":
            x = x.pin_memory().to(self.device, non_blocking=True)
        else:
            x = x.to(self.device)
        pv = self.prep.normalize(x) if resized else self.prep.pixel_values(x)
        return pv.to(self.dtype)

    def add(self, offset: int, frames: np.ndarray | torch.Tensor, *, resized: bool = True) -> int:
        """Encode `frames` (uint8 (n,3,S,S) when `resized`, else (n,H,W,3)) into rows [offset,
        offset + n)."""
        n = int(frames.shape[0])
        if offset < 0 or offset + n > self.num_frames:
            raise ValueError(
                f"chunk [{offset}, {offset + n}) is outside the shard's {self.num_frames} frames"
            )
        pv = self._pixels(frames, resized)
        step = self.batch_size or n
        with (
            torch.no_grad()
        ):  # not inference_mode: finetuning uses these features as inputs to autograd
            for i in range(0, n, step):
                out = self.encode_fn(pv[i : i + step])
                out = out if isinstance(out, FrameFeatures) else FrameFeatures(out)
                if out.features.ndim != 3 or out.features.shape[0] != pv[i : i + step].shape[0]:
                    raise ValueError(
                        f"encode_fn must return (n, T, H) features, got {tuple(out.features.shape)}"
                    )
                at = offset + i
                self.features = self._write(self.features, at, out.features, self.device)
                if out.header_features is not None:  # the host holds them (one copy per batch)
                    self.header_features = self._write(
                        self.header_features, at, out.header_features, torch.device("cpu")
                    )
        self.encoded += n
        return n

    def _write(
        self, into: torch.Tensor | None, at: int, out: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """`out` written at row `at` of `into` (made on `device` for every frame at the first
        write)."""
        if into is None:
            into = torch.empty((self.num_frames, *out.shape[1:]), dtype=self.dtype, device=device)
        into[at : at + out.shape[0]] = out.to(self.dtype)
        return into

    def result(self) -> torch.Tensor:
        if self.features is None:  # an empty shard: ask the encoder for its output shapes
            out = _black_frame(self.encode_fn, self.image_size, self.device, self.dtype)
            self.features = self._write(None, 0, out.features[:0], self.device)
            if out.header_features is not None:
                cpu = torch.device("cpu")
                self.header_features = self._write(None, 0, out.header_features[:0], cpu)
        if self.encoded != self.num_frames:
            raise RuntimeError(f"only {self.encoded} of {self.num_frames} frames were encoded")
        return self.features


def encode_stream(
    chunks: Iterable[tuple[int, np.ndarray | torch.Tensor]],
    encoder: ShardEncoder,
    *,
    resized: bool = True,
) -> Iterator[int]:
    """Feed (offset, frames) chunks into `encoder`; yields the number of frames encoded after each
    chunk."""
    for offset, frames in chunks:
        encoder.add(offset, frames, resized=resized)
        yield encoder.encoded
