"""Saved video prompts: reopening a video skips the prefill of its prompt, not only decoding and
encoding.

Layout: `<cache dir>/prefixes/<prefix id>/prompt-of-NNNNN.safetensors`, one file for all NNNNN
ranks: the text K/V of every decoder layer after the video prompt was prefilled (`k.<layer>`,
`v.<layer>`) and the positions of those keys (`key_positions`). Every rank holds the same whole
cache once the prefill is done (the sharded prefill replicates it), so rank 0 writes it and every
rank reads it back. The prefix id hashes what decides the prompt's K/V except the number of ranks:
the feature entry (video, sampling, encoder weights, dtype; `CacheKey` without its world size), the
checkpoint's identity (every file of it), the prompt format version, a hash of the prompt's token
ids (chat template and anything placed in the prompt, such as subtitles) and the device type. The
file's manifest holds the whole key, also the world size (the prefill's floats depend on how it was
sharded) and the feature entry with its world size, and must match it exactly.

Visual K/V are not part of a saved prompt (they do not depend on it): they are recomputed from the
cached features when the video is opened, or read back from their own files when the first open
measured that cheaper (`lvx_app.engine.visual_kv_cache`, decided by `lvx_app.engine.visual_kv`;
docs/benchmarks.md).

Writes are atomic and a file that fails any check is reported in one warning line, deleted (by rank
0, which also names a prompt saved only for another number of ranks), and the prompt is prefilled
again, as for the feature cache (`lvx_app.video.feature_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lvx_app.video.cache_files import entry_folders, leftovers, remove_entries, touch
from lvx_app.video.errors import VideoWarning
from lvx_app.video.feature_cache import (
    SHARD_FILES,
    CacheKey,
    CorruptEntry,
    FeatureCache,
    atomic_save,
    load_or_discard,
    read_entry,
    read_manifest,
    target_matcher,
    tensor_crc,
)

PREFIX_VERSION = 2  # 2: one file for all ranks (1 had one identical file per rank)


def stable_hash(obj) -> str:
    """A short hash of a JSON-able key (sorted, so field order never matters)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class PrefixKey:
    """Everything that decides a saved prompt's K/V (the same on every rank)."""

    features: str  # the feature entry without its world size
    checkpoint: str  # lvx_models.mplug_owl3.fingerprint.checkpoint_identity
    prompt_format: int
    prompt_hash: str  # sha256 of the prompt's int64 token ids
    prompt_tokens: int
    device: str  # device type: cpu / cuda
    world_size: int
    feature_entry: str  # the feature entry of this world size (its layout of frames included)
    file_id: str
    format_version: int = PREFIX_VERSION

    @classmethod
    def make(
        cls,
        feature_key: CacheKey,
        *,
        checkpoint: str,
        prompt_format: int,
        prompt_ids: torch.Tensor,
        device: str,
    ) -> "PrefixKey":
        ids = prompt_ids.to(torch.int64).contiguous().cpu()
        digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:32]
        return cls(
            replace(feature_key, world_size=0, rank=0).entry_id(),
            checkpoint,
            int(prompt_format),
            digest,
            int(ids.numel()),
            device,
            feature_key.world_size,
            feature_key.entry_id(),
            feature_key.file_id,
        )

    def entry_id(self) -> str:
        d = asdict(self)
        for name in ("world_size", "feature_entry"):
            d.pop(name)
        return stable_hash(d)

    def file_name(self) -> str:
        return f"prompt-of-{self.world_size:05d}.safetensors"


@dataclass
class SavedPrefix:
    """A prefilled prompt: per-layer (k, v) of its tokens, (1, S, kv_heads, D), and their
    positions."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    key_positions: torch.Tensor  # (1, S) int64


@dataclass
class PrefixInfo:
    """One saved prompt (or saved visual K/V: tokens 0), as `lvx cache ls` shows it."""

    entry_id: str
    video: str
    world_sizes: list[int]
    tokens: int
    bytes: int
    file_id: str = ""
    problems: list[str] | None = None


def _tensors(saved: SavedPrefix) -> dict[str, torch.Tensor]:
    out = {"key_positions": saved.key_positions.to(torch.int64).contiguous().cpu()}
    for i, (k, v) in enumerate(saved.layers):
        out[f"k.{i}"], out[f"v.{i}"] = k.detach().contiguous().cpu(), v.detach().contiguous().cpu()
    return out


def checksum(tensors: dict[str, torch.Tensor]) -> int:
    """CRC-32 of every tensor's bytes, in name order."""
    crc = 0
    for name in sorted(tensors):
        crc = tensor_crc(tensors[name], crc)
    return crc


def load_checked(
    path: Path, key: dict, version: int, required: frozenset[str]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, tensors) of a saved file whose manifest holds `key` and `version` and whose
    tensors match the manifest's shapes and checksum; raises CorruptEntry otherwise. Touches the
    file ("last used")."""
    manifest, tensors = read_entry(path, key, version, set(required))
    if {name: list(t.shape) for name, t in tensors.items()} != manifest["shapes"]:
        raise CorruptEntry("tensor shapes do not match the manifest")
    if checksum(tensors) != manifest["crc32"]:
        raise CorruptEntry("checksum mismatch")
    touch(path)  # "last used"
    return manifest, tensors


class SavedEntries:
    """`lvx cache ls / rm / clear` for folders of saved files: `entries_dir/<entry id>/<files>`."""

    entries_dir: Path
    required: frozenset[str] = frozenset()  # tensors every file must hold
    files = "shard-*.safetensors"  # one per rank, or one for all ranks
    names = SHARD_FILES  # the same, exactly: what `rm` and `clear` may delete
    has_tokens = False  # `lvx cache ls` shows a token count (saved prompts)

    def _describe(self, manifest: dict) -> tuple[str, int, str, int]:
        """(video, world size, file id, prompt tokens) from one file's manifest."""
        raise NotImplementedError

    def entries(self) -> list[PrefixInfo]:
        out: list[PrefixInfo] = []
        for d in entry_folders(self.entries_dir):
            info = PrefixInfo(
                d.name,
                "?",
                [],
                0,
                sum(f.stat().st_size for f in d.iterdir() if f.is_file()),
                problems=[],
            )
            for f in sorted(d.glob(self.files)):
                try:
                    video, world, info.file_id, info.tokens = self._describe(
                        read_manifest(f, set(self.required))
                    )
                except (CorruptEntry, KeyError) as exc:
                    info.problems.append(f"{f.name}: {exc}")
                    continue
                info.video, info.world_sizes = video, sorted(set(info.world_sizes) | {world})
            out.append(info)
        return out

    def remove(self, target: str) -> list[str]:
        """Delete entries whose id starts with `target` (4+ characters) or made from the video at
        `target`; the ids removed (CacheRemovalError when some could not be)."""
        matches = target_matcher(target)
        chosen = [e.entry_id for e in self.entries() if matches(e.entry_id, e.file_id, e.video)]
        return remove_entries([self.entries_dir / entry for entry in chosen], self.names)

    def clear(self) -> int:
        """Delete every entry; how many were removed (CacheRemovalError when some could not be).
        Files lvx did not write stay."""
        return len(remove_entries(entry_folders(self.entries_dir), self.names))

    def leftovers(self) -> list[Path]:
        """Files in this store's folder that are no entry of lvx's (what `clear` leaves)."""
        return leftovers(self.entries_dir)

    def size_bytes(self) -> int:
        return sum(e.bytes for e in self.entries())


class PrefixCache(SavedEntries):
    """Prefilled video prompts on disk, one safetensors file per (prompt, number of ranks)."""

    required = frozenset({"key_positions"})
    files = "prompt-of-*.safetensors"
    names = re.compile(r"prompt-of-\d{5}\.safetensors")
    has_tokens = True

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = FeatureCache(root).root  # the features' folder
        self.entries_dir = self.root / "prefixes"

    def path(self, key: PrefixKey) -> Path:
        return self.entries_dir / key.entry_id() / key.file_name()

    def save(self, key: PrefixKey, saved: SavedPrefix, *, video: str | os.PathLike) -> Path:
        """Write the prompt K/V atomically (rank 0 alone: every rank holds the same). Returns the
        final path."""
        tensors = _tensors(saved)
        manifest = {
            "version": PREFIX_VERSION,
            "key": asdict(key),
            "video": str(video),
            "layers": len(saved.layers),
            "shapes": {n: list(t.shape) for n, t in tensors.items()},
            "crc32": checksum(tensors),
        }
        final = self.path(key)
        atomic_save(tensors, manifest, final)
        return final

    def load(
        self, key: PrefixKey, device: torch.device | str = "cpu", *, owner: bool = True
    ) -> SavedPrefix | None:
        """The saved prompt, or None. The `owner` (rank 0; every rank reads the same file) deletes a
        corrupt file with one warning and names, in one line, a prompt saved only for another number
        of ranks; the others say nothing."""
        path = self.path(key)
        if not os.path.lexists(path):
            saved = {p for p in path.parent.glob(self.files) if p.is_file()}
            others = sorted({int(p.name.split("-of-")[1].split(".")[0]) for p in saved})
            if others and owner:
                warnings.warn(
                    f"the saved video prompt was made on {'/'.join(map(str, others))} rank(s), "
                    f"this run has {key.world_size}; prefilling it again",
                    VideoWarning,
                    stacklevel=2,
                )
            return None
        return load_or_discard(
            path,
            lambda: self._load(path, key, device),
            f"the saved video prompt {path}",
            "prefilling the prompt again",
            owner=owner,
        )

    def _load(self, path: Path, key: PrefixKey, device: torch.device | str) -> SavedPrefix:
        manifest, tensors = load_checked(path, asdict(key), PREFIX_VERSION, self.required)
        n = int(manifest["layers"])
        if len(tensors) != 2 * n + 1:
            raise CorruptEntry("tensor shapes do not match the manifest")
        layers = [(tensors[f"k.{i}"].to(device), tensors[f"v.{i}"].to(device)) for i in range(n)]
        return SavedPrefix(layers, tensors["key_positions"])

    def _describe(self, manifest: dict) -> tuple[str, int, str, int]:
        k = manifest["key"]
        return manifest["video"], k["world_size"], k["file_id"], k["prompt_tokens"]
