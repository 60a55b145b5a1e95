"""One store of cache entries on disk: the design every kind of entry shares.

An entry's file is `<cache dir>/<kind>/<entry id>/<file name>`: the id hashes the key without what
differs between the files of one entry (the rank, or the number of ranks), the file name says it.
Each file is a safetensors file whose header holds lvx's manifest: the format version, the whole
key, the video it was made from, what the kind adds (shapes, the sampling plan...) and the CRC-32
of every tensor's bytes in name order. A file is used only when all of it matches; one that does not
is reported in one warning line, deleted, and computed again. Writes are atomic, and one that fails
is a warning, never a failed load (`lvx_app.cache.faults`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from safetensors import safe_open

from lvx_app.cache.faults import CacheWarning, CorruptEntry, warn_folder_in_place, warn_not_saved
from lvx_app.cache.files import atomic_save, discard, entry_folders, holds_files, lvx_files, touch
from lvx_app.cache.tensor_file import read_tensors
from lvx_app.defaults import default_cache_dir


def stable_hash(obj) -> str:
    """A short hash of a JSON-able key (sorted, so field order never matters)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def tensor_crc(t: torch.Tensor, crc: int = 0) -> int:
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return crc
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)


def checksum(tensors: dict[str, torch.Tensor]) -> int:
    """CRC-32 of every tensor's bytes, in name order."""
    crc = 0
    for name in sorted(tensors):
        crc = tensor_crc(tensors[name], crc)
    return crc


def key_fields(key) -> dict:
    """A key as its files save and hash it. A field added later (`added_later`) is left out while
    it holds None, so the files an earlier release wrote keep their ids and still match."""
    d = asdict(key)
    for name in getattr(key, "added_later", ()):
        if d.get(name) is None:
            d.pop(name)
    return d


SHARD_FILES = re.compile(r"shard-\d{5}-of-\d{5}\.safetensors")  # one file per rank


class PerRankKey:
    """A key whose entry holds one file per rank (`SHARD_FILES`): its id leaves the rank out."""

    rank: int
    world_size: int

    def entry_id(self) -> str:
        d = key_fields(self)
        d.pop("rank")
        return stable_hash(d)

    def file_name(self) -> str:
        return f"shard-{self.rank:05d}-of-{self.world_size:05d}.safetensors"


def cache_root(root: str | os.PathLike | None) -> Path:
    """The cache folder: `root`, else `$LVX_CACHE_DIR`, else `~/.cache/lvx`."""
    return Path(root).expanduser() if root else default_cache_dir()


def read_manifest(path: Path, tensors: frozenset[str]) -> dict:
    """The manifest in a safetensors file's header, which must hold `tensors` (raises
    CorruptEntry)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
    except Exception as exc:  # noqa: BLE001 - any unreadable header is corruption
        raise CorruptEntry(f"unreadable header ({str(exc)[:120]})") from None
    if "lvx_manifest" not in meta:
        raise CorruptEntry("no manifest in header")
    try:
        manifest = json.loads(meta["lvx_manifest"])
    except json.JSONDecodeError as exc:
        raise CorruptEntry(f"bad manifest ({exc})") from None
    if not isinstance(manifest, dict) or not tensors <= names:
        raise CorruptEntry(f"missing tensors (has {sorted(names)})")
    return manifest


def read_entry(path: Path, key: dict, version: int, tensors: frozenset[str]) -> tuple[dict, dict]:
    """(manifest, tensors on CPU) of a file whose manifest holds `version` and `key` and whose
    tensors match its checksum; raises CorruptEntry otherwise."""
    manifest = read_manifest(path, tensors)
    if manifest.get("version") != version:
        raise CorruptEntry(f"cache version {manifest.get('version')} != {version}")
    if manifest.get("key") != key:
        raise CorruptEntry("key in the manifest does not match")
    try:
        loaded = read_tensors(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable tensor data is corruption
        raise CorruptEntry(f"unreadable tensors ({str(exc)[:120]})") from None
    if checksum(loaded) != manifest.get("crc32"):
        raise CorruptEntry("checksum mismatch")
    return manifest, loaded


def load_or_discard(
    path: Path, load: Callable[[], Any], what: str, instead: str, content: str, owner: bool = True
) -> Any:
    """`load()`, or None after one warning line (by the `owner` alone: a file several ranks read
    has one owner, which reports and deletes it). A damaged file, or a folder in its place that
    holds no file, is deleted; a folder holding someone's files is left alone."""
    try:
        if path.is_dir() and not path.is_symlink() and holds_files(path):
            if owner:
                warn_folder_in_place(path, content)
            return None
        if not path.is_file():
            raise CorruptEntry("a folder, not a file")
        return load()
    except CorruptEntry as exc:
        if owner:
            gone = discard(path)
            warnings.warn(f"{what} was corrupt ({exc}); {gone} and {instead}", CacheWarning, 3)
        return None
    except OSError as exc:  # unreadable, or deleted by the owner between the look and the read
        if owner:
            warnings.warn(f"could not read {what} ({exc}); {instead}", CacheWarning, 3)
        return None


@dataclass
class Entry:
    """One entry (or, for saved prompts, one file of an entry) as `lvx cache ls` lists it."""

    kind: str  # "features" | "prompt" | "visual K/V"
    entry_id: str
    path: Path  # the entry's folder
    names: set[str] = field(default_factory=set)  # its files' names
    video: str = "?"
    file_id: str = ""
    world_size: int = 0
    made_from: str = ""  # the feature entry a saved prompt or visual K/V was made from
    version: int | None = None
    model: str = "?"
    dtype: str = "?"
    fps: float = 0.0
    max_frames: int | None = None
    frames: int = 0
    tokens: int = 0
    shards: int = 0  # complete files present (one per rank)
    bytes: int = 0
    modified: float = 0.0
    problems: list[str] = field(default_factory=list)


class Store:
    """The entries of one kind: key -> file, checked read, atomic write, listing. A kind names its
    folder, format version, file names, required tensors and the words of its warnings."""

    kind: ClassVar[str]  # what `lvx cache ls` calls it
    folder_name: ClassVar[str]
    version: ClassVar[int]
    names: ClassVar[re.Pattern]  # exactly its files' names: what `rm` and `clear` may delete
    required: ClassVar[frozenset[str]] = frozenset()  # tensors every file holds
    noun: ClassVar[str]  # "the saved video prompt", followed by the file's path
    content: ClassVar[str]  # what it keeps: "the video prompt"
    instead: ClassVar[str]  # what a load does without it
    then: ClassVar[str]  # what follows when it could not be saved
    one_row_per_file: ClassVar[bool] = False  # an entry's files are listed apart

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = cache_root(root)
        self.folder = self.root / self.folder_name

    def path(self, key) -> Path:
        return self.folder / key.entry_id() / key.file_name()

    def write(self, key, tensors: dict[str, torch.Tensor], video, **fields) -> Path | None:
        """Save `tensors` under `key` with the manifest; None (and a warning) when it could not be
        written."""
        manifest = {"version": self.version, "key": key_fields(key), "video": str(video), **fields}
        manifest["crc32"] = checksum(tensors)
        final = self.path(key)
        try:
            atomic_save(tensors, manifest, final)
        except OSError as exc:
            warn_not_saved(self.root, exc, self.content, self.then)
            return None
        return final

    def read(self, key, *, owner: bool = True) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """(manifest, tensors on CPU) of the file for `key` when every check passes, else None."""
        path = self.path(key)
        if not os.path.lexists(path):
            return None
        return load_or_discard(
            path,
            lambda: self._checked(path, key),
            f"{self.noun} {path}",
            self.instead,
            self.content,
            owner,
        )

    def _checked(self, path: Path, key) -> tuple[dict, dict[str, torch.Tensor]]:
        manifest, tensors = read_entry(path, key_fields(key), self.version, self.required)
        try:
            self.check(manifest, tensors)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptEntry(f"the manifest lacks {exc}") from None
        touch(path)  # "last used", for `lvx cache ls`
        return manifest, tensors

    def check(self, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Raise CorruptEntry when the tensors do not match the manifest's shapes."""
        if {name: list(t.shape) for name, t in tensors.items()} != manifest.get("shapes"):
            raise CorruptEntry("tensor shapes do not match the manifest")

    def describe(self, entry: Entry, manifest: dict) -> None:
        """Fill `entry` from one of its files' manifests (raises KeyError for a missing field)."""
        key = manifest["key"]
        entry.video, entry.file_id = manifest["video"], key["file_id"]
        entry.world_size, entry.version = key["world_size"], manifest.get("version")

    # ----------------------------------------------------------------------------------------------
    # listing
    def entries(self) -> list[Entry]:
        out: list[Entry] = []
        for folder in entry_folders(self.folder):
            files = [p for p in sorted(folder.iterdir()) if self.names.fullmatch(p.name)]
            groups = [[f] for f in files] if self.one_row_per_file else [files]
            for group in groups if files else [[]]:
                out.append(self._entry(folder, group, len(groups) > 1))
        return out

    def _entry(self, folder: Path, files: list[Path], shared: bool = False) -> Entry:
        row_id = self._row_id(folder, files) if shared else folder.name
        entry = Entry(self.kind, row_id, folder, {f.name for f in files})
        present = lvx_files(folder, self.names, entry.names if self.one_row_per_file else None)
        entry.bytes = sum(_size(f) for f in present)
        entry.modified = max([_mtime(f) for f in files] or [_mtime(folder)])
        for f in files:
            try:
                if not f.is_file():
                    raise CorruptEntry("a folder, not a file")
                self.describe(entry, read_manifest(f, self.required))
            except (CorruptEntry, KeyError, TypeError) as exc:
                entry.problems.append(f"{f.name}: {exc}")
                continue
            entry.shards += 1
        return entry

    @staticmethod
    def _row_id(folder: Path, files: list[Path]) -> str:
        """The id of a row that shares its folder with others (a prompt saved for 1 rank and for
        2, each file a row): that file's, so no two rows show one id and `rm` of one row removes
        that row alone. A row alone in its folder has the folder's id."""
        return hashlib.sha256(f"{folder.name}/{files[0].name}".encode()).hexdigest()[:20]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
