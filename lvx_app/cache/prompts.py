"""Saved video prompts: reopening a video skips the prefill of its prompt, not only decoding and
encoding.

Layout: `<cache dir>/prefixes/<prefix id>/prompt-of-NNNNN.safetensors`, one file for all NNNNN
ranks: the text K/V of every decoder layer after the video prompt was prefilled (`k.<layer>`,
`v.<layer>`) and the positions of those keys (`key_positions`). Every rank holds the same whole
cache once the prefill is done (the sharded prefill replicates it), so rank 0 writes it and every
rank reads it back. The prefix id hashes what decides the prompt's K/V except the number of ranks:
the feature entry (video, sampling, encoder weights, dtype; `FeatureKey` without its world size),
the checkpoint's identity (every file of it), the prompt format version, a hash of the prompt's
token ids (chat template and anything placed in the prompt, such as subtitles) and the device type.
The file's manifest holds the whole key, also the world size (the prefill's floats depend on how it
was sharded) and the feature entry with its world size (the one it was made from), and must match it
exactly.

Visual K/V are not part of a saved prompt (they do not depend on it): `lvx_app.cache.visual_kv`.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from lvx_app.cache.faults import CacheWarning, CorruptEntry
from lvx_app.cache.features import FeatureKey
from lvx_app.cache.files import delete_files, lvx_files
from lvx_app.cache.store import Entry, Store, key_fields, stable_hash

PREFIX_VERSION = 2  # 2: one file for all ranks (1 had one identical file per rank)
PROMPTS_PER_FEATURES = 8  # saved prompts kept per feature entry, the least recently used go first


@dataclass(frozen=True)
class PrefixKey:
    """Everything that decides a saved prompt's K/V (the same on every rank)."""

    features: str  # the feature entry without its world size
    checkpoint: str  # the family's `checkpoint_identity`
    prompt_format: int
    prompt_hash: str  # sha256 of the prompt's int64 token ids
    prompt_tokens: int
    device: str  # device type: cpu / cuda
    world_size: int
    feature_entry: str  # the feature entry of this world size (its layout of frames included)
    file_id: str
    format_version: int = PREFIX_VERSION
    # the frames a text token attends to (`--media-attention`), None for every frame before it
    media_attention: str | None = None
    added_later: ClassVar[tuple[str, ...]] = ("media_attention",)  # see `key_fields`

    @classmethod
    def make(
        cls,
        feature_key: FeatureKey,
        *,
        checkpoint: str,
        prompt_format: int,
        prompt_ids: torch.Tensor,
        device: str,
        owner: str = "",
        media_attention: str = "every-frame-before",
    ) -> "PrefixKey":
        """`owner`: the client whose words the prompt holds ("" for none): a prompt saved for one
        client is never read back for another, whose load would then be quicker for a right guess
        of those words."""
        ids = prompt_ids.to(torch.int64).contiguous().cpu()
        digest = hashlib.sha256(ids.numpy().tobytes() + owner.encode()).hexdigest()[:32]
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
            media_attention=None if media_attention == "every-frame-before" else media_attention,
        )

    def entry_id(self) -> str:
        d = key_fields(self)
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


def _tensors(saved: SavedPrefix) -> dict[str, torch.Tensor]:
    out = {"key_positions": saved.key_positions.to(torch.int64).contiguous().cpu()}
    for i, (k, v) in enumerate(saved.layers):
        out[f"k.{i}"], out[f"v.{i}"] = k.detach().contiguous().cpu(), v.detach().contiguous().cpu()
    return out


class PrefixCache(Store):
    """Prefilled video prompts on disk, one safetensors file per (prompt, number of ranks)."""

    kind = "prompt"
    folder_name = "prefixes"
    version = PREFIX_VERSION
    names = re.compile(r"prompt-of-\d{5}\.safetensors")
    required = frozenset({"key_positions"})
    noun = "the saved video prompt"
    content = "the video prompt"
    instead = "prefilling the prompt again"
    then = "the next open will prefill it again"
    one_row_per_file = True

    def save(self, key: PrefixKey, saved: SavedPrefix, *, video: str | os.PathLike) -> Path | None:
        """Write the prompt K/V (rank 0 alone: every rank holds the same); None (and one warning)
        when it could not be saved."""
        tensors = _tensors(saved)
        shapes = {n: list(t.shape) for n, t in tensors.items()}
        path = self.write(key, tensors, video, layers=len(saved.layers), shapes=shapes)
        if path is not None:
            self._keep_the_newest(key.feature_entry, path)
        return path

    def _keep_the_newest(self, features: str, saved: Path) -> None:
        """At most `PROMPTS_PER_FEATURES` saved prompts made from one feature entry (each
        client's words make a prompt of their own): beyond it, those used least recently are
        removed, never the one just `saved`."""
        rows = [e for e in self.entries() if e.made_from == features and not e.problems]
        rows = [e for e in rows if not (e.path == saved.parent and saved.name in e.names)]
        rows.sort(key=lambda e: e.modified)
        for old in rows[: max(0, len(rows) + 1 - PROMPTS_PER_FEATURES)]:
            delete_files(old.path, lvx_files(old.path, self.names, old.names))

    def load(
        self, key: PrefixKey, device: torch.device | str = "cpu", *, owner: bool = True
    ) -> SavedPrefix | None:
        """The saved prompt, or None. The `owner` (rank 0; every rank reads the same file) deletes a
        damaged file with one warning and names, in one line, a prompt saved only for another number
        of ranks; the others say nothing."""
        path = self.path(key)
        if owner and not os.path.lexists(path):
            self._say_other_world_sizes(path, key.world_size)
        got = self.read(key, owner=owner)
        if got is None:
            return None
        manifest, tensors = got
        n = int(manifest["layers"])
        layers = [(tensors[f"k.{i}"].to(device), tensors[f"v.{i}"].to(device)) for i in range(n)]
        return SavedPrefix(layers, tensors["key_positions"])

    def _say_other_world_sizes(self, path: Path, world_size: int) -> None:
        saved = [p for p in path.parent.glob("prompt-of-*.safetensors") if p.is_file()]
        others = sorted({int(p.name.split("-of-")[1].split(".")[0]) for p in saved})
        if others:
            warnings.warn(
                f"the saved video prompt was made on {'/'.join(map(str, others))} rank(s), "
                f"this run has {world_size}; prefilling it again",
                CacheWarning,
                stacklevel=3,
            )

    def check(self, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
        super().check(manifest, tensors)
        if len(tensors) != 2 * int(manifest["layers"]) + 1:
            raise CorruptEntry("tensor shapes do not match the manifest")

    def describe(self, entry: Entry, manifest: dict) -> None:
        super().describe(entry, manifest)
        key = manifest["key"]
        entry.tokens, entry.made_from = key["prompt_tokens"], key["feature_entry"]
