"""Saved visual K/V: the hyper layers' K/V of one rank's frames, read back on reopen instead of
recomputed from the features when the first open measured that reading is clearly cheaper
(`lvx_app.engine.resident_visual_kv` decides).

Layout: `<cache dir>/visual-kv/<entry id>/shard-RRRRR-of-NNNNN.safetensors`, one file per rank,
tensors `k.<layer>` and `v.<layer>` for every hyper layer (1, S_local, kv_heads, D). Their own
folder, not the saved prompt's: visual K/V depend on the feature entry and the checkpoint, not on
the prompt's text, so one copy serves every prompt of a video (with or without subtitles). The entry
id hashes the feature entry (`FeatureKey.entry_id()`: video, sampling, encoder weights, dtype, world
size and layout), the checkpoint's identity (it holds the hyper layers' `v_kv_proj` and norm
weights), a hash of every frame's placeholder start (the MI-RoPE positions of K), the device type,
the dtype and the format version; each file's manifest holds the whole key and the rank and must
match it exactly.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lvx_app.cache.faults import CorruptEntry
from lvx_app.cache.features import FeatureKey
from lvx_app.cache.store import SHARD_FILES, Entry, PerRankKey, Store

VISUAL_KV_VERSION = 1

VisualKV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # hyper layer index -> (k, v)


@dataclass(frozen=True)
class VisualKVKey(PerRankKey):
    """Everything that decides one rank's visual K/V."""

    features: str  # the feature entry id, with its world size and layout
    checkpoint: str  # the family's `checkpoint_identity`
    media_hash: str  # sha256 of every frame's placeholder start (int64)
    device: str  # device type: cpu / cuda
    dtype: str
    world_size: int
    rank: int
    file_id: str  # the video's identity, for `lvx cache rm VIDEO`
    format_version: int = VISUAL_KV_VERSION

    @classmethod
    def make(
        cls,
        feature_key: FeatureKey,
        *,
        checkpoint: str,
        media_starts: torch.Tensor,
        device: str,
        dtype: torch.dtype,
    ) -> "VisualKVKey":
        starts = media_starts.to(torch.int64).contiguous().cpu()
        digest = hashlib.sha256(starts.numpy().tobytes()).hexdigest()[:32]
        return cls(
            feature_key.entry_id(),
            checkpoint,
            digest,
            device,
            str(dtype).removeprefix("torch."),
            feature_key.world_size,
            feature_key.rank,
            feature_key.file_id,
        )


class VisualKVCache(Store):
    """Visual K/V on disk, one safetensors file per (feature entry, checkpoint, rank)."""

    kind = "visual K/V"
    folder_name = "visual-kv"
    version = VISUAL_KV_VERSION
    names = SHARD_FILES
    noun = "the saved visual K/V"
    content = "the visual K/V"
    instead = "recomputing them from the features"
    then = "the next open will compute them again"

    def save(self, key: VisualKVKey, kv: VisualKV, *, video: str | os.PathLike) -> Path | None:
        """Write this rank's visual K/V; None (and one warning) when they could not be saved."""
        tensors = {}
        for layer, (k, v) in kv.items():
            tensors[f"k.{layer}"] = k.detach().contiguous().cpu()
            tensors[f"v.{layer}"] = v.detach().contiguous().cpu()
        shapes = {n: list(t.shape) for n, t in tensors.items()}
        return self.write(key, tensors, video, layers=sorted(kv), shapes=shapes)

    def load(self, key: VisualKVKey, device: torch.device | str = "cpu") -> VisualKV | None:
        """This rank's saved visual K/V, or None (a damaged file is deleted with one warning)."""
        got = self.read(key)
        if got is None:
            return None
        manifest, tensors = got
        return {
            int(layer): (tensors[f"k.{layer}"].to(device), tensors[f"v.{layer}"].to(device))
            for layer in manifest["layers"]
        }

    def check(self, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
        super().check(manifest, tensors)
        layers = [int(layer) for layer in manifest["layers"]]
        if set(tensors) != {f"{kv}.{layer}" for layer in layers for kv in "kv"}:
            raise CorruptEntry("tensor names do not match the manifest")

    def describe(self, entry: Entry, manifest: dict) -> None:
        super().describe(entry, manifest)
        entry.made_from, entry.dtype = manifest["key"]["features"], manifest["key"]["dtype"]
