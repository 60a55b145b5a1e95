"""The visual-feature cache: a second `lvx chat` on the same video skips decoding and encoding.

Layout: `<cache dir>/features/<entry id>/shard-RRRRR-of-NNNNN.safetensors`, one file per rank. An
entry id is a hash of everything that changes the features except the rank: the file's identity
(size, mtime and its first and last MiB), fps, max-frames, the model (its resolved path or hub id)
and revision, a fingerprint of the vision tower and projector weights
(`lvx_models.mplug_owl3.fingerprint`: changed weights at the same path never hit), image size,
dtype, the number of shards and their layout (which frames each rank holds), the plan version and
the cache format version. Each file holds the tensors `features`, `frame_indices`, `timestamps` and,
in the safetensors header, a JSON manifest (key, video path, the whole sampling plan, shapes, the
byte count and CRC-32 of the tensor data).

Writes are atomic: the file is written under a temporary name in the same folder, fsynced and
renamed, so a reader sees a complete file or none. A file that fails any check on load (header, key,
shapes, byte count, checksum; a folder in its place) is reported in one warning line, deleted and
rebuilt, never used. A cache folder that cannot be written is read all the same, and removing
entries deletes only the files lvx wrote (`lvx_app.video.cache_files`).

The cache folder is `$LVX_CACHE_DIR` when set, else `~/.cache/lvx`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import uuid
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lvx_app.defaults import default_cache_dir
from lvx_app.video.cache_files import discard, entry_folders, leftovers, remove_entries, touch
from lvx_app.video.errors import VideoWarning
from lvx_app.video.plan import PLAN_VERSION, SamplingPlan
from lvx_models.mplug_owl3.checkpoint import resolve_checkpoint
from lvx_models.mplug_owl3.fingerprint import encoder_fingerprint

CACHE_VERSION = 2  # 2: the key holds the encoder weights' fingerprint
SHARD_FILES = re.compile(r"shard-\d{5}-of-\d{5}\.safetensors")  # the names of an entry's files
_BLOCK = 1 << 20


def file_identity(path: str | os.PathLike) -> str:
    """A content-ish identity of a file that is cheap for hour-long videos: size, mtime, first and
    last MiB."""
    st = os.stat(path)
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_BLOCK))
        if st.st_size > _BLOCK:
            f.seek(max(_BLOCK, st.st_size - _BLOCK))
            h.update(f.read(_BLOCK))
    return h.hexdigest()[:32]


def encoder_identity(
    model: str, revision: str | None, cache_dir: str | os.PathLike | None
) -> tuple[str, str]:
    """(resolved checkpoint path, fingerprint of its vision tower + projector weights) for
    `CacheKey`'s model_id and encoder; compute it before loading the weights, so features are never
    filed under weights newer than the model's. The fingerprints are remembered in the cache folder
    (raises CheckpointError for an unreadable checkpoint)."""
    path = str(resolve_checkpoint(model, revision).resolve())
    memo = (
        Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    ) / "encoder-fingerprints.json"
    return path, encoder_fingerprint(path, memo=memo)


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class CacheKey:
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
    plan_version: int = PLAN_VERSION
    encoder: str = ""  # fingerprint of the vision tower + projector weights
    format_version: int = CACHE_VERSION
    layout: str = "contiguous"  # which frames each rank holds (lvx_app/parallel/layout.py)

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
        image_size: int | None = None,
        over_max: str = "thin",
        encoder: str = "",
        layout: str = "contiguous",
    ) -> "CacheKey":
        return cls(
            file_identity(video),
            float(fps),
            None if max_frames is None else int(max_frames),
            str(model_id),
            str(model_revision or ""),
            _dtype_name(dtype),
            int(world_size),
            int(rank),
            image_size,
            over_max,
            encoder=str(encoder),
            layout=str(layout),
        )

    def entry_id(self) -> str:
        d = asdict(self)
        d.pop("rank")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:20]

    def shard_name(self) -> str:
        return f"shard-{self.rank:05d}-of-{self.world_size:05d}"


@dataclass
class CachedShard:
    features: torch.Tensor
    frame_indices: torch.Tensor
    timestamps: torch.Tensor
    plan: SamplingPlan
    frame_offset: int
    path: Path


@dataclass
class EntryInfo:
    """One cache entry (a video at some settings), as `lvx cache ls` shows it."""

    entry_id: str
    path: Path
    video: str
    fps: float
    max_frames: int | None
    model: str
    dtype: str
    world_size: int
    shards: int  # complete shard files present
    frames: int
    bytes: int
    modified: float
    file_id: str = ""
    problems: list[str] = field(default_factory=list)


class CorruptEntry(Exception):
    pass


def tensor_crc(t: torch.Tensor, crc: int = 0) -> int:
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return crc
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)


def atomic_save(tensors: dict[str, torch.Tensor], manifest: dict, final: Path) -> None:
    """Write a safetensors file with `manifest` in its header under a temporary name, fsync it,
    rename it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, str(tmp), metadata={"lvx_manifest": json.dumps(manifest)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def read_manifest(path: Path, tensors: set[str]) -> dict:
    """The manifest stored in a safetensors file's header, which must hold `tensors` (raises
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
    if not tensors <= names:
        raise CorruptEntry(f"missing tensors (has {sorted(names)})")
    return manifest


def read_entry(path: Path, key: dict, version: int, tensors: set[str]) -> tuple[dict, dict]:
    """(manifest, tensors on CPU) of a saved file whose manifest holds `version` and `key`; raises
    CorruptEntry otherwise. Each kind of file then checks its tensors against its manifest."""
    manifest = read_manifest(path, tensors)
    if manifest.get("version") != version:
        raise CorruptEntry(f"cache version {manifest.get('version')} != {version}")
    if manifest.get("key") != key:
        raise CorruptEntry("key in the manifest does not match")
    try:
        return manifest, load_file(str(path), device="cpu")
    except Exception as exc:  # noqa: BLE001 - any unreadable tensor data is corruption
        raise CorruptEntry(f"unreadable tensors ({str(exc)[:120]})") from None


_SHARD_TENSORS = {"features", "frame_indices", "timestamps"}


def _read_header(path: Path) -> dict:
    """The manifest stored in a shard file's safetensors header (raises CorruptEntry)."""
    return read_manifest(path, _SHARD_TENSORS)


def target_matcher(target: str) -> Callable[[str, str, str], bool]:
    """For `lvx cache rm TARGET`: whether an entry (id, file id, video path) is named by an id (its
    first 4+ characters) or by the video it was made from."""
    tpath = Path(target).expanduser()
    fid = file_identity(tpath) if tpath.is_file() else None
    resolved = str(tpath.resolve()) if tpath.exists() or tpath.is_absolute() else None

    def matches(entry_id: str, file_id: str, video: str) -> bool:
        return bool(
            (len(target) >= 4 and entry_id.startswith(target))
            or (fid and file_id == fid)
            or (resolved and video == resolved)
        )

    return matches


def load_or_discard(
    path: Path, load: Callable[[], Any], what: str, instead: str, *, owner: bool = True
) -> Any:
    """`load()`, or None after one warning line and deleting `path` when it raises CorruptEntry (or
    is not a file: a folder in its place). A file several ranks read has one `owner` that reports
    and deletes it; the others return None quietly (also when the owner deleted it under them)."""
    try:
        if not path.is_file():
            raise CorruptEntry("a folder, not a file")
        return load()
    except CorruptEntry as exc:
        if owner:
            gone = discard(path)
            warnings.warn(f"{what} was corrupt ({exc}); {gone} and {instead}", VideoWarning, 3)
        return None
    except OSError:
        if owner:
            raise
        return None  # the owner deleted it between the look and the read


class FeatureCache:
    """Visual features on disk, one safetensors file per (video, settings, rank)."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root).expanduser() if root else default_cache_dir()
        self.features_dir = self.root / "features"

    def shard_path(self, key: CacheKey) -> Path:
        return self.features_dir / key.entry_id() / f"{key.shard_name()}.safetensors"

    # ----------------------------------------------------------------------------------------------
    # read
    def load(self, key: CacheKey, device: torch.device | str = "cpu") -> CachedShard | None:
        """The cached shard for `key`, or None on a miss. A corrupt file is deleted and reported
        (returns None)."""
        path = self.shard_path(key)
        if not os.path.lexists(path):
            return None
        return load_or_discard(
            path,
            lambda: self._load(path, key, device),
            f"the visual-feature cache file {path}",
            "re-encoding the frames",
        )

    def _load(self, path: Path, key: CacheKey, device: torch.device | str) -> CachedShard:
        manifest, tensors = read_entry(path, asdict(key), CACHE_VERSION, _SHARD_TENSORS)
        feats, idx, ts = tensors["features"], tensors["frame_indices"], tensors["timestamps"]
        info = manifest["features"]
        if list(feats.shape) != info["shape"] or _dtype_name(feats.dtype) != info["dtype"]:
            raise CorruptEntry(
                f"features {tuple(feats.shape)} {feats.dtype} do not match the manifest"
            )
        if len(idx) != feats.shape[0] or len(ts) != feats.shape[0]:
            raise CorruptEntry("frame count mismatch")
        nbytes = sum(t.numel() * t.element_size() for t in (feats, idx, ts))
        if nbytes != manifest["bytes"]:
            raise CorruptEntry(f"{nbytes} bytes of tensors, manifest says {manifest['bytes']}")
        crc = tensor_crc(ts, tensor_crc(idx, tensor_crc(feats)))
        if crc != manifest["crc32"]:
            raise CorruptEntry("checksum mismatch")
        touch(path)  # "last used", for `lvx cache ls`
        return CachedShard(
            feats.to(device),
            idx,
            ts,
            SamplingPlan.from_dict(manifest["plan"]),
            int(manifest["frame_offset"]),
            path,
        )

    # ----------------------------------------------------------------------------------------------
    # write
    def save(
        self,
        key: CacheKey,
        features: torch.Tensor,
        frame_indices: Any,
        timestamps: Any,
        *,
        plan: SamplingPlan,
        frame_offset: int,
        video: str | os.PathLike,
    ) -> Path:
        """Write one shard atomically (temp file + fsync + rename). Returns the final path."""
        feats = features.detach().contiguous().cpu()
        idx = torch.as_tensor(frame_indices, dtype=torch.int64).contiguous()
        ts = torch.as_tensor(timestamps, dtype=torch.float64).contiguous()
        manifest = {
            "version": CACHE_VERSION,
            "key": asdict(key),
            "video": str(video),
            "frame_offset": int(frame_offset),
            "features": {"shape": list(feats.shape), "dtype": _dtype_name(feats.dtype)},
            "bytes": sum(t.numel() * t.element_size() for t in (feats, idx, ts)),
            "crc32": tensor_crc(ts, tensor_crc(idx, tensor_crc(feats))),
            "plan": plan.to_dict(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        final = self.shard_path(key)
        atomic_save({"features": feats, "frame_indices": idx, "timestamps": ts}, manifest, final)
        return final

    # ----------------------------------------------------------------------------------------------
    # manage
    def entries(self) -> list[EntryInfo]:
        out: list[EntryInfo] = []
        for d in entry_folders(self.features_dir):
            files = sorted(d.glob("shard-*.safetensors"))
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            info = EntryInfo(
                d.name,
                d,
                "?",
                0.0,
                None,
                "?",
                "?",
                0,
                0,
                0,
                size,
                max([f.stat().st_mtime for f in d.iterdir() if f.is_file()] or [d.stat().st_mtime]),
            )
            for f in files:
                try:
                    m = _read_header(f)
                except CorruptEntry as exc:
                    info.problems.append(f"{f.name}: {exc}")
                    continue
                k = m["key"]
                info.video, info.fps, info.max_frames = m["video"], k["fps"], k["max_frames"]
                info.model = k["model_id"] + (
                    f"@{k['model_revision']}" if k["model_revision"] else ""
                )
                info.dtype, info.world_size, info.file_id = (
                    k["dtype"],
                    k["world_size"],
                    k["file_id"],
                )
                info.frames = len(m["plan"]["indices"])
                info.shards += 1
            out.append(info)
        return out

    def is_stale(self, entry: EntryInfo) -> str | None:
        """Why an entry can never be hit again ("video missing" / "video changed"), or None."""
        video = Path(entry.video)
        if entry.video == "?":
            return "damaged"
        if not video.is_file():
            return "video missing"
        return None if file_identity(video) == entry.file_id else "video changed"

    def remove_stale(self) -> list[str]:
        """Delete entries whose video is gone or changed since they were made (they can never be
        hit); the ids removed (CacheRemovalError when some could not be)."""
        return remove_entries([e.path for e in self.entries() if self.is_stale(e)], SHARD_FILES)

    def remove(self, target: str) -> list[str]:
        """Delete entries whose id starts with `target`, or that were made from the video at path
        `target`; the ids removed (CacheRemovalError when some could not be)."""
        matches = target_matcher(target)
        chosen = [e.path for e in self.entries() if matches(e.entry_id, e.file_id, e.video)]
        return remove_entries(chosen, SHARD_FILES)

    def clear(self) -> int:
        """Delete every entry (and stray temporary files of lvx's); how many entries were removed
        (CacheRemovalError when some could not be). Files lvx did not write stay."""
        return len(remove_entries(entry_folders(self.features_dir), SHARD_FILES))

    def leftovers(self) -> list[Path]:
        """Files in the features folder that are no entry of lvx's (what `clear` leaves)."""
        return leftovers(self.features_dir)

    def size_bytes(self) -> int:
        if not self.features_dir.is_dir():
            return 0
        return sum(f.stat().st_size for f in self.features_dir.rglob("*") if f.is_file())
