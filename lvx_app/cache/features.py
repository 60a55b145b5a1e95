"""Frame features: a second `lvx chat` on the same video skips decoding and encoding.

Layout: `<cache dir>/features/<entry id>/shard-RRRRR-of-NNNNN.safetensors`, one file per rank. The
entry id hashes everything that changes the features except the rank: the file's identity (size,
mtime and its first and last MiB), fps, max-frames, the model (its resolved path or hub id) and
revision, a fingerprint of the vision tower and projector weights (`lvx_models.mplug_owl3.
fingerprint`: changed weights at the same path never hit), image size, dtype, the number of shards
and their layout (which frames each rank holds), the plan version and the format version. Each file
holds the tensors `features`, `frame_indices`, `timestamps` and, in its manifest, the whole sampling
plan (as the video layer writes it), this rank's first frame, the features' shape and dtype and the
byte count.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from lvx_app.cache.faults import CorruptEntry
from lvx_app.cache.store import SHARD_FILES, Entry, PerRankKey, Store
from lvx_app.regular_files import regular_file

FEATURES_VERSION = 2  # 2: the key holds the encoder weights' fingerprint
_BLOCK = 1 << 20


def file_identity(path: str | os.PathLike) -> str:
    """A content-ish identity of a file that is cheap for hour-long videos: size, mtime, first and
    last MiB."""
    st = os.stat(path)
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with regular_file(path) as f:  # never a FIFO: it would block the process
        h.update(f.read(_BLOCK))
        if st.st_size > _BLOCK:
            f.seek(max(_BLOCK, st.st_size - _BLOCK))
            h.update(f.read(_BLOCK))
    return h.hexdigest()[:32]


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class FeatureKey(PerRankKey):
    """Everything that determines one rank's features."""

    file_id: str
    fps: float
    max_frames: int | None
    model_id: str
    model_revision: str
    dtype: str
    world_size: int
    rank: int
    image_size: int | None = None
    over_max: str = "thin"
    encoder: str = ""  # fingerprint of the vision tower + projector weights
    format_version: int = FEATURES_VERSION
    layout: str = "contiguous"  # which frames each rank holds (lvx_app/parallel/layout.py)
    num_frames: int | None = None  # exactly this many frames over the whole video (not by fps)
    added_later: ClassVar[tuple[str, ...]] = ("num_frames",)  # see `key_fields`
    plan_version: int = field(kw_only=True)  # the sampling maths' version (lvx_app/video/plan.py)

    @classmethod
    def make(
        cls,
        video: str | os.PathLike,
        *,
        fps: float,
        max_frames: int | None,
        model_id: str,
        model_revision: str = "",
        dtype: torch.dtype | str,
        world_size: int,
        rank: int,
        plan_version: int,
        image_size: int | None = None,
        over_max: str = "thin",
        encoder: str = "",
        layout: str = "contiguous",
        num_frames: int | None = None,
    ) -> "FeatureKey":
        return cls(
            file_identity(video),
            float(fps),
            None if max_frames is None else int(max_frames),
            str(model_id),
            str(model_revision or ""),
            dtype_name(dtype),
            int(world_size),
            int(rank),
            image_size,
            over_max,
            encoder=str(encoder),
            layout=str(layout),
            num_frames=None if num_frames is None else int(num_frames),
            plan_version=int(plan_version),
        )


@dataclass
class CachedShard:
    features: torch.Tensor
    frame_indices: torch.Tensor
    timestamps: torch.Tensor
    plan: dict  # the whole sampling plan, as the video layer saved it
    frame_offset: int
    path: Path


_TENSORS = ("features", "frame_indices", "timestamps")


class FeatureCache(Store):
    """Frame features on disk, one safetensors file per (video, settings, rank)."""

    kind = "features"
    folder_name = "features"
    version = FEATURES_VERSION
    names = SHARD_FILES
    required = frozenset(_TENSORS)
    noun = "the visual-feature cache file"
    content = "the visual features"
    instead = "re-encoding the frames"
    then = "the next run will decode again"

    def load(self, key: FeatureKey, device: torch.device | str = "cpu") -> CachedShard | None:
        """The cached shard for `key`, or None on a miss (a damaged file is deleted, with one
        warning)."""
        got = self.read(key)
        if got is None:
            return None
        manifest, tensors = got
        feats, idx, ts = (tensors[name] for name in _TENSORS)
        return CachedShard(
            feats.to(device),
            idx,
            ts,
            manifest["plan"],
            int(manifest["frame_offset"]),
            self.path(key),
        )

    def save(
        self,
        key: FeatureKey,
        features: torch.Tensor,
        frame_indices: Any,
        timestamps: Any,
        *,
        plan: dict,
        frame_offset: int,
        video: str | os.PathLike,
    ) -> Path | None:
        """Write one shard; None (and one warning) when it could not be saved."""
        feats = features.detach().contiguous().cpu()
        idx = torch.as_tensor(frame_indices, dtype=torch.int64).contiguous()
        ts = torch.as_tensor(timestamps, dtype=torch.float64).contiguous()
        return self.write(
            key,
            {"features": feats, "frame_indices": idx, "timestamps": ts},
            video,
            frame_offset=int(frame_offset),
            features={"shape": list(feats.shape), "dtype": dtype_name(feats.dtype)},
            bytes=sum(t.numel() * t.element_size() for t in (feats, idx, ts)),
            plan=plan,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        )

    def check(self, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
        feats, idx, ts = (tensors[name] for name in _TENSORS)
        info = manifest["features"]
        if list(feats.shape) != info["shape"] or dtype_name(feats.dtype) != info["dtype"]:
            raise CorruptEntry(
                f"features {tuple(feats.shape)} {feats.dtype} do not match the manifest"
            )
        if len(idx) != feats.shape[0] or len(ts) != feats.shape[0]:
            raise CorruptEntry("frame count mismatch")
        nbytes = sum(t.numel() * t.element_size() for t in (feats, idx, ts))
        if nbytes != manifest["bytes"]:
            raise CorruptEntry(f"{nbytes} bytes of tensors, manifest says {manifest['bytes']}")
        int(manifest["frame_offset"]), manifest["plan"]["indices"]  # KeyError: a damaged manifest

    def describe(self, entry: Entry, manifest: dict) -> None:
        super().describe(entry, manifest)
        key = manifest["key"]
        entry.fps, entry.max_frames, entry.dtype = key["fps"], key["max_frames"], key["dtype"]
        revision = key["model_revision"]
        entry.model = key["model_id"] + (f"@{revision}" if revision else "")
        entry.frames = len(manifest["plan"]["indices"])
