"""Saved visual K/V: the hyper layers' K/V of one rank's frames, read back on reopen instead of
recomputed from the features when the first open measured that reading is clearly cheaper
(`lvx_app.engine.visual_kv` decides).

Layout: `<cache dir>/visual-kv/<entry id>/shard-RRRRR-of-NNNNN.safetensors`, one file per rank,
tensors `k.<layer>` and `v.<layer>` for every hyper layer (1, S_local, kv_heads, D). Their own
folder, not the saved prompt's: visual K/V depend on the feature entry and the checkpoint, not on
the prompt's text, so one copy serves every prompt of a video (with or without subtitles), and `lvx
cache ls` shows their size apart from the prompts'. Not inside the feature entry either: that folder
holds exactly the feature shards (`lvx cache ls` counts them). The entry id hashes the feature entry
(`CacheKey.entry_id()`: video, sampling, encoder weights, dtype, world size and layout), the
checkpoint's identity (it holds the hyper layers' `v_kv_proj` and norm weights), a hash of every
frame's placeholder start (the MI-RoPE positions of K), the device type, the dtype and the format
version; each file's manifest holds the whole key and the rank and must match it exactly. Writes are
atomic; a file that fails any check is reported in one warning line, deleted, and the K/V are
recomputed, as for the feature cache (`lvx_app.video.feature_cache`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lvx_app.engine.prefix_cache import SavedEntries, checksum, load_checked, stable_hash
from lvx_app.video.feature_cache import (
    CacheKey,
    CorruptEntry,
    FeatureCache,
    atomic_save,
    load_or_discard,
)

VISUAL_KV_VERSION = 1

VisualKV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # hyper layer index -> (k, v)


@dataclass(frozen=True)
class VisualKVKey:
    """Everything that decides one rank's visual K/V."""

    features: str  # the feature entry id, with its world size and layout
    checkpoint: str  # lvx_models.mplug_owl3.fingerprint.checkpoint_identity
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
        feature_key: CacheKey,
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

    def entry_id(self) -> str:
        d = asdict(self)
        d.pop("rank")
        return stable_hash(d)

    def shard_name(self) -> str:
        return f"shard-{self.rank:05d}-of-{self.world_size:05d}.safetensors"


def _tensors(kv: VisualKV) -> dict[str, torch.Tensor]:
    out = {}
    for layer, (k, v) in kv.items():
        out[f"k.{layer}"], out[f"v.{layer}"] = (
            k.detach().contiguous().cpu(),
            v.detach().contiguous().cpu(),
        )
    return out


class VisualKVCache(SavedEntries):
    """Visual K/V on disk, one safetensors file per (feature entry, checkpoint, rank)."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = FeatureCache(root).root
        self.entries_dir = self.root / "visual-kv"

    def path(self, key: VisualKVKey) -> Path:
        return self.entries_dir / key.entry_id() / key.shard_name()

    def save(self, key: VisualKVKey, kv: VisualKV, *, video: str | os.PathLike) -> Path:
        """Write this rank's visual K/V atomically. Returns the final path."""
        tensors = _tensors(kv)
        manifest = {
            "version": VISUAL_KV_VERSION,
            "key": asdict(key),
            "video": str(video),
            "layers": sorted(kv),
            "shapes": {n: list(t.shape) for n, t in tensors.items()},
            "crc32": checksum(tensors),
        }
        final = self.path(key)
        atomic_save(tensors, manifest, final)
        return final

    def load(self, key: VisualKVKey, device: torch.device | str = "cpu") -> VisualKV | None:
        """This rank's saved visual K/V, or None. A corrupt file is deleted with one warning."""
        path = self.path(key)
        if not os.path.lexists(path):
            return None
        return load_or_discard(
            path,
            lambda: self._load(path, key, device),
            f"the saved visual K/V {path}",
            "recomputing them from the features",
        )

    def _load(self, path: Path, key: VisualKVKey, device: torch.device | str) -> VisualKV:
        manifest, tensors = load_checked(path, asdict(key), VISUAL_KV_VERSION, self.required)
        layers = [int(layer) for layer in manifest["layers"]]
        if set(tensors) != {f"{kv}.{layer}" for layer in layers for kv in "kv"}:
            raise CorruptEntry("tensor names do not match the manifest")
        return {
            layer: (tensors[f"k.{layer}"].to(device), tensors[f"v.{layer}"].to(device))
            for layer in layers
        }

    def _describe(self, manifest: dict) -> tuple[str, int, str, int]:
        k = manifest["key"]
        return manifest["video"], k["world_size"], k["file_id"], 0
