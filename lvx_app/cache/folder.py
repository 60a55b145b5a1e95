"""The whole cache folder, as `lvx cache ls | rm | clear` see it: every entry of every kind, which
video each was made from, which saved prompts and visual K/V were made from which features, what can
never be used again, and deleting only the files lvx wrote.

`rm` by a feature entry's id takes the saved prompts and visual K/V made from it along (without
those features they are never read back: the next open prefills and computes them again). Stale
entries are those whose video is missing or changed, those of an older format (never read again),
and saved prompts or visual K/V whose features are gone.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from lvx_app.cache.faults import CacheRemovalError, CacheWarning
from lvx_app.cache.features import FeatureCache, file_identity
from lvx_app.cache.files import delete_files, entry_folders, leftovers, lvx_files
from lvx_app.cache.prompts import PrefixCache
from lvx_app.cache.store import Entry, Store, cache_root
from lvx_app.cache.transcripts import TranscriptCache
from lvx_app.cache.visual_kv import VisualKVCache

MIN_ID = 4  # the shortest id prefix `rm` takes
SHOWN = 10  # the ids an ambiguous prefix lists


class AmbiguousId(ValueError):
    """An id prefix given to `rm` that starts more than one entry's id."""

    def __init__(self, target: str, ids: list[str], why: str = "") -> None:
        shown = ", ".join(list(short_ids(ids).values())[:SHOWN])
        more = f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else ""
        why = f" ({why})" if why else ""
        super().__init__(
            f"{target} starts {len(ids)} entry id{'s' if len(ids) > 1 else ''} ({shown}{more})"
            f"{why}; nothing removed: give more of the id, as `lvx cache ls` shows it"
        )
        self.ids = ids


@dataclass
class Removed:
    """What one removal deleted: the entries gone, and the first failure (CacheRemovalError)."""

    entries: list[Entry]
    failure: CacheRemovalError | None = None


def short_ids(ids: list[str], least: int = 8) -> dict[str, str]:
    """Each id's shortest prefix, `least` characters or more, that no other id starts with: what
    `lvx cache ls` shows and `lvx cache rm` takes."""
    distinct = sorted(set(ids))
    out = {}
    for i, entry_id in enumerate(distinct):
        n = least
        for other in distinct[max(0, i - 1) : i] + distinct[i + 1 : i + 2]:
            while n < len(entry_id) and other.startswith(entry_id[:n]):
                n += 1
        out[entry_id] = entry_id[:n]
    return out


class CacheFolder:
    """Every kind of entry in one cache folder."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = cache_root(root)
        self.features = FeatureCache(self.root)
        self.stores: tuple[Store, ...] = (
            self.features,
            PrefixCache(self.root),
            VisualKVCache(self.root),
            TranscriptCache(self.root),  # made from the video alone, no features
        )

    def entries(self) -> list[Entry]:
        return [entry for store in self.stores for entry in store.entries()]

    def stale(self, entries: list[Entry]) -> dict[int, str]:
        """Why each entry (by its index in `entries`) can never be used again: damaged, old format,
        video missing, video changed, no features."""
        features = {e.entry_id for e in entries if e.kind == "features"}
        versions = {store.kind: store.version for store in self.stores}
        videos: dict[tuple[str, str], str | None] = {}
        out = {}
        for i, e in enumerate(entries):
            if e.video == "?":
                why = "damaged"
            elif e.version != versions[e.kind]:
                why = "old format"
            else:
                made_from = (e.video, e.file_id)
                if made_from not in videos:
                    videos[made_from] = _video_state(*made_from)
                why = videos[made_from]
                made_from_features = e.kind not in ("features", TranscriptCache.kind)
                if why is None and made_from_features and e.made_from not in features:
                    why = "no features"
            if why:
                out[i] = why
        return out

    def refuse_ambiguous(self, targets: list[str]) -> None:
        """AmbiguousId for the first of `targets` that starts more than one entry's id: `rm`
        then removes nothing."""
        ids = [e.entry_id for e in self.entries()]
        for target in targets:
            if _is_path(target):
                continue
            matched = sorted({i for i in ids if i.startswith(target)})
            if len(target) < MIN_ID and matched:  # too short to be taken as an id at all
                raise AmbiguousId(target, matched, f"an id needs {MIN_ID} characters or more")
            if len(matched) > 1:
                raise AmbiguousId(target, matched)

    def remove(self, target: str) -> Removed:
        """Delete the entries named by `target`: an id (its first 4+ characters) with, for
        features, the saved prompts and visual K/V made from them; or a video path, everything made
        from it. An id prefix that starts several ids removes nothing (AmbiguousId)."""
        entries = self.entries()
        chosen = [e for e in entries if _names(target, e)]
        if not _is_path(target) and len({e.entry_id for e in chosen}) > 1:
            raise AmbiguousId(target, sorted({e.entry_id for e in chosen}))
        if not _is_path(target):
            ids = {e.entry_id for e in chosen if e.kind == "features"}
            chosen += [e for e in entries if e.kind != "features" and e.made_from in ids]
        unique = {id(e): e for e in chosen}
        return self._delete(list(unique.values()))

    def remove_stale(self) -> Removed:
        entries = self.entries()
        return self._delete([entries[i] for i in sorted(self.stale(entries))])

    def clear(self) -> Removed:
        """Delete every entry (and stray temporary files of lvx's); files lvx did not write stay."""
        return self._delete(self.entries(), whole=True)

    def trim(self, limit_bytes: int, used_since: float) -> Removed:
        """Remove the entries used least recently until the folder holds at most `limit_bytes`;
        never one used since `used_since` (what the load that just ended read or wrote)."""
        entries = sorted(self.entries(), key=lambda e: e.modified)
        over = sum(e.bytes for e in entries) - limit_bytes
        chosen = []
        for e in entries:
            if over <= 0 or e.modified >= used_since:
                break
            chosen.append(e)
            over -= e.bytes
        return self._delete(chosen)

    def leftovers(self) -> list[Path]:
        """Files in the kinds' folders that are no entry of lvx's (what `clear` leaves)."""
        return [f for store in self.stores for f in leftovers(store.folder)]

    def size_bytes(self) -> int:
        return sum(e.bytes for e in self.entries())

    def _delete(self, entries: list[Entry], whole: bool = False) -> Removed:
        gone, failed, first = [], 0, None
        stores = {store.kind: store for store in self.stores}
        for e in entries:
            names = e.names if stores[e.kind].one_row_per_file else None
            files = lvx_files(e.path, stores[e.kind].names, names)
            deleted, error = delete_files(e.path, files)
            if error is not None:
                failed, first = failed + 1, first or error
            elif deleted:
                gone.append(e)
        if whole:  # what no entry lists: temporary files of lvx's
            for store in self.stores:
                for folder in entry_folders(store.folder):
                    delete_files(folder, lvx_files(folder, store.names))
        if not failed:
            return Removed(gone)
        why = first.strerror or str(first)
        return Removed(gone, CacheRemovalError(failed, why, self.root, gone))


def keep_within_limit(
    root: str | os.PathLike | None, limit_gb: float | None, used_since: float
) -> None:
    """Hold the cache folder to `limit_gb` (--cache-limit-gb; None: no limit), the entries used
    least recently removed first, none used since `used_since`; one warning says what went."""
    if limit_gb is None:
        return
    folder = CacheFolder(root)
    removed = folder.trim(int(limit_gb * 2**30), used_since)
    if removed.entries:
        warnings.warn(
            f"the cache folder {folder.root} was over its {limit_gb:g} GB limit "
            f"(--cache-limit-gb): removed the {len(removed.entries)} entries used least "
            "recently",
            CacheWarning,
            stacklevel=2,
        )


def _video_state(video: str, file_id: str) -> str | None:
    """ "video missing", "video changed", or None while the video is the one the entry was made
    from."""
    path = Path(video)
    if not path.is_file():
        return "video missing"
    try:
        return None if file_identity(path) == file_id else "video changed"
    except OSError:
        return "video missing"


def _is_path(target: str) -> bool:
    return os.path.exists(os.path.expanduser(target))


def _names(target: str, entry: Entry) -> bool:
    """Whether `lvx cache rm TARGET` names `entry`: by its id (4+ characters) or by the video it was
    made from."""
    if len(target) >= MIN_ID and entry.entry_id.startswith(target):
        return True
    path = Path(target).expanduser()
    if path.is_file() and entry.file_id and entry.file_id == _identity(path):
        return True
    return (path.exists() or path.is_absolute()) and entry.video == str(path.resolve())


_identities: dict[tuple[str, int, int], str] = {}


def _identity(path: Path) -> str:
    """file_identity, computed once per file state in this process (`rm` asks for every entry)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _identities:
        _identities[key] = file_identity(path)
    return _identities[key]
