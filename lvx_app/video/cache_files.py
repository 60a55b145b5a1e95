"""The files of lvx's caches on disk: which ones lvx wrote, deleting only those, and a cache folder
that cannot be written.

Each cache (`features/`, `prefixes/`, `visual-kv/` in the cache folder) keeps one folder per entry,
named by its 20-hex-digit id, holding safetensors files of the cache's own names whose header
carries lvx's manifest (and, while one is written, its temporary file). `lvx cache rm|clear` delete
only those files, and an entry's folder once it is empty: files anyone else put there stay. What
could not be deleted is a `CacheRemovalError` that says so, never a report of success.

A cache folder that cannot be written (a read-only file system, a shared cache of another user)
still serves what it holds: reading writes nothing (the "last used" time is set only where it can
be), and what is computed is used without being saved, said in one warning per folder and process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import warnings
from pathlib import Path

from lvx_app.video.errors import VideoWarning

ENTRY_NAME = re.compile(r"[0-9a-f]{20}")
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-\d+-[0-9a-f]{8}")  # atomic_save's temporary name
_MAX_HEADER = 100 << 20  # the safetensors format's own limit
# what a write into a folder the user may not change fails with
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_said_not_writable: set[str] = set()


class CacheRemovalError(OSError):
    """Entries whose files could not be deleted (`failed` of them, `why`); `removed` holds the ids
    of those that were."""

    def __init__(self, failed: int, why: str, where: Path, removed: list[str]) -> None:
        super().__init__(removal_failed(failed, why, where))
        self.failed, self.why, self.removed = failed, why, removed


def removal_failed(failed: int, why: str, where: Path) -> str:
    """The one line for entries that could not be deleted."""
    entries = f"{failed} entr{'y' if failed == 1 else 'ies'}"
    return f"could not delete {entries} in {where} ({why}); make it writable, then run it again"


def has_lvx_header(path: Path) -> bool:
    """Whether `path` is a safetensors file whose header carries lvx's manifest (read from the
    header alone: a file whose data was cut short is still recognised)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size)) if size <= _MAX_HEADER else None
    except (OSError, ValueError, struct.error):
        return False
    return isinstance(header, dict) and "lvx_manifest" in (header.get("__metadata__") or {})


def entry_folders(cache: Path) -> list[Path]:
    """The entry folders of one cache (`<cache dir>/features`, ...): other folders are not lvx's."""
    if not cache.is_dir():
        return []
    return [
        p
        for p in sorted(cache.iterdir())
        if ENTRY_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    ]


def lvx_files(folder: Path, names: re.Pattern) -> list[Path]:
    """The files lvx wrote in an entry folder: the cache's own `names` with lvx's header, and their
    temporary files."""
    out = []
    for p in sorted(folder.iterdir()):
        if p.is_symlink() or not p.is_file():
            continue
        temporary = _TEMPORARY.fullmatch(p.name)
        if temporary and names.fullmatch(temporary["name"]):
            out.append(p)
        elif names.fullmatch(p.name) and has_lvx_header(p):
            out.append(p)
    return out


def remove_entries(folders: list[Path], names: re.Pattern) -> list[str]:
    """Delete lvx's files in each entry folder, and the folder once it is empty; returns the ids of
    the entries whose files are gone. Raises CacheRemovalError when some could not be deleted."""
    removed: list[str] = []
    failed: list[OSError] = []
    for folder in folders:
        deleted, errors = 0, []
        for f in lvx_files(folder, names):
            try:
                f.unlink()
                deleted += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                errors.append(exc)
        if errors:
            failed.append(errors[0])
            continue
        with contextlib.suppress(OSError):  # kept while files lvx did not write are in it
            folder.rmdir()
        if deleted:
            removed.append(folder.name)
    if failed:
        why = failed[0].strerror or str(failed[0])
        raise CacheRemovalError(len(failed), why, folders[0].parent, removed)
    return removed


def leftovers(cache: Path) -> list[Path]:
    """Files still in one cache's folder (after `remove_entries`: those lvx did not write)."""
    if not cache.is_dir():
        return []
    return sorted(p for p in cache.rglob("*") if not p.is_dir())


def touch(path: Path) -> None:
    """Mark a cache file "last used" (for `lvx cache ls`) where its folder can be written; reading a
    cache never needs it."""
    with contextlib.suppress(OSError):
        os.utime(path)


def discard(path: Path) -> str:
    """Delete a damaged cache file (or a folder in its place); what happened, for a warning line."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        return f"could not delete it ({exc.strerror or exc})"
    return "deleted it"


def warn_not_saved(root: Path, exc: OSError, what: str, then: str) -> None:
    """One warning line for a cache write that failed. A folder that cannot be written is said once
    per process, for everything it will not keep; another failure (a full disk) each time."""
    if exc.errno in NOT_WRITABLE:
        if str(root) in _said_not_writable:
            return
        _said_not_writable.add(str(root))
        message = (
            f"the cache folder {root} cannot be written ({exc.strerror}): what it holds is used, "
            "what is computed is not saved; point --cache-dir (or LVX_CACHE_DIR) at a folder you "
            "may write to keep it"
        )
    else:
        message = f"could not save {what} in {root} ({exc}); {then}. Free some space or set "
        message += "LVX_CACHE_DIR."
    warnings.warn(message, VideoWarning, stacklevel=3)
