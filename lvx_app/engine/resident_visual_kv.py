"""Resident visual K/V on opening a video: read back the ones an earlier open saved, or compute them
from the features and save them when that measured cheaper (recomputing is cheap on a GPU, reading
back can win on a CPU: measure and pick).

The first open times the hyper layers' K/V projection of this rank's frames and estimates reading
them back as their bytes / `VISUAL_KV_READ_BYTES_PER_S`; it saves them only when computing took more
than `VISUAL_KV_SAVE_MARGIN` times that (so a GPU, where the projection takes milliseconds, never
writes gigabytes for nothing). The ranks agree: all save or none, all read back or all compute, and
they read back only when every rank has its file and its features came from the feature cache (the
K/V were made from those features).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

import torch

from lvx_app.cache import VisualKVCache, VisualKVKey
from lvx_app.defaults import VISUAL_KV_READ_BYTES_PER_S, VISUAL_KV_SAVE_MARGIN
from lvx_app.parallel.collectives import nbytes
from lvx_app.video.ingest import VisualShard
from lvx_models.api import VisualInputs

SAVE_MODES = ("auto", "always", "never")


@dataclass
class VisualKVChoice:
    """Where this rank's visual K/V came from and why: what `lvx` reports next to the kv mode."""

    source: str = "computed"  # computed | read back
    saved: bool = False  # written at this open for the next one
    compute_s: float | None = (
        None  # measured wall seconds of the K/V projection (None when read back)
    )
    read_s: float | None = None  # bytes / VISUAL_KV_READ_BYTES_PER_S
    nbytes: int = 0
    mode: str = "auto"

    def line(self) -> str:
        if self.source == "read back":
            return f"read back from the saved visual K/V ({self.nbytes / 2**20:.1f} MiB)"
        if self.compute_s is None:
            return "computed (not saved: no feature cache)"
        figures = (
            f"compute {self.compute_s:.3f} s vs read {self.read_s:.3f} s est. for "
            f"{self.nbytes / 2**20:.1f} MiB"
        )
        why = "save_visual_kv=" + self.mode if self.mode != "auto" else figures
        return f"computed, {'saved for the next open' if self.saved else 'not saved'} ({why})"


def kv_nbytes(kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes of every hyper layer's (k, v)."""
    return sum(nbytes(t) for pair in kv.values() for t in pair)


def _checked(mode: str) -> str:
    if mode not in SAVE_MODES:
        raise ValueError(f"unknown save_visual_kv {mode!r}; use {', '.join(SAVE_MODES)}")
    return mode


def should_save(
    mode: str,
    compute_s: float,
    nbytes: int,
    bytes_per_s: float | None = None,
    margin: float | None = None,
) -> bool:
    """Save the visual K/V when `mode` says so or, for "auto", when computing them was clearly
    slower than reading `nbytes` back at a conservative rate."""
    if _checked(mode) != "auto":
        return mode == "always"
    read_s = nbytes / (bytes_per_s or VISUAL_KV_READ_BYTES_PER_S)
    return compute_s > (margin or VISUAL_KV_SAVE_MARGIN) * read_s


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock timing covers it (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class VisualKVOpener:
    """The visual inputs of one open, from the saved K/V or computed; every rank calls `open` at the
    same point."""

    def __init__(
        self,
        model,
        store: VisualKVCache | None,
        agree: Callable[[int], int],
        mode: str,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model, self.store, self.agree, self.mode, self.clock = (
            model,
            store,
            agree,
            _checked(mode),
            clock,
        )

    def open(
        self,
        shard: VisualShard,
        starts: torch.Tensor,
        key: VisualKVKey | None,
        *,
        resident: bool,
        video: str,
    ) -> tuple[VisualInputs, VisualKVChoice]:
        """`resident`: kv mode "cache" (K/V kept); otherwise they are recomputed per forward and
        never saved.
        `key` None: no feature cache, nothing to save or read."""
        key = key if resident and self.store is not None else None
        saved = (
            self.store.load(key, shard.features.device)
            if key is not None and shard.from_cache
            else None
        )
        if self.agree(int(saved is not None)):
            lazy = self.model.prepare_visual(
                shard.features, starts, shard.positions, precompute=False
            )
            return replace(lazy, kv=saved), VisualKVChoice(
                "read back", nbytes=kv_nbytes(saved), mode=self.mode
            )
        _sync(shard.features.device)
        t0 = self.clock()
        with torch.no_grad():
            visual = self.model.prepare_visual(
                shard.features, starts, shard.positions, precompute=resident
            )
        _sync(shard.features.device)
        choice = VisualKVChoice(mode=self.mode)
        if key is not None:
            choice.compute_s = self.clock() - t0
            choice.nbytes = kv_nbytes(visual.kv)
            choice.read_s = choice.nbytes / VISUAL_KV_READ_BYTES_PER_S
        want = key is not None and should_save(self.mode, choice.compute_s, choice.nbytes)
        if self.agree(int(want)):
            choice.saved = self._save(key, visual, video)
        return visual, choice

    def _save(self, key: VisualKVKey, visual: VisualInputs, video: str) -> bool:
        """Whether they were saved (a store that cannot write says so once and goes on)."""
        return self.store.save(key, dict(visual.kv), video=Path(video).resolve()) is not None
