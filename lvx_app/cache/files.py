"""The files of lvx's caches on disk: written atomically, recognised by lvx's header, and deleted
only when lvx wrote them.

Each kind of entry (`features/`, `prefixes/`, `visual-kv/` in the cache folder) keeps one folder per
entry, named by its 20-hex-digit id, holding safetensors files of the kind's own names whose header
carries lvx's manifest (and, while one is written, its temporary file). Deleting takes only those
files, and an entry's folder once it is empty: files anyone else put there stay. A folder standing
where a cache file belongs is removed only when it holds no file.

A write goes to a temporary name in the same folder, is fsynced and renamed, so a reader sees a
complete file or none; the temporary file is gone whatever happens, and every failure (a full disk
too, which safetensors reports in its own exception) is an `OSError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import uuid
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

ENTRY_NAME = re.compile(r"[0-9a-f]{20}")
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-\d+-[0-9a-f]{8}")  # temporary_name's pattern
_MAX_HEADER = 100 << 20  # the safetensors format's own limit
_OS_CODE = re.compile(r"(?:code: |os error )(\d+)")  # how safetensors names the OS error


def temporary_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def holds_files(folder: Path) -> bool:
    """Whether anything but folders is inside `folder` (at any depth)."""
    return any(not p.is_dir() or p.is_symlink() for p in folder.rglob("*"))


def _clear_the_way(final: Path) -> None:
    """Remove a folder standing at `final` when it holds no file; raise IsADirectoryError when it
    does (it is someone's)."""
    if final.is_dir() and not final.is_symlink():
        if holds_files(final):
            raise IsADirectoryError(errno.EISDIR, "a folder stands where the file belongs", final)
        shutil.rmtree(final)


def atomic_write(final: Path, write: Callable[[Path], None]) -> None:
    """`write(temporary path)`, fsync, rename to `final`; on any failure no temporary file stays,
    nor a folder this call made.

    Several ranks write their files into one entry folder at once: a rank whose write fails removes
    the folder it made while it is still empty, which another rank may have found there a moment
    before. That rank's write then finds no folder, and makes it again and retries: each failed
    write removes a folder once, so the retries end, however the ranks' timing falls."""
    while True:
        made = _make_parents(final)
        try:
            _write_and_rename(final, write)
            return
        except FileNotFoundError:
            if final.parent.exists():  # not a folder removed under us: a failure of its own
                _remove_empty(made)
                raise
        except BaseException:
            _remove_empty(made)
            raise


def _make_parents(final: Path) -> list[Path]:
    """Make `final`'s folders (clearing an empty folder standing at `final`); those made, deepest
    first."""
    _clear_the_way(final)
    made = [p for p in final.parents if not p.exists()]
    final.parent.mkdir(parents=True, exist_ok=True)
    return made


def _write_and_rename(final: Path, write: Callable[[Path], None]) -> None:
    tmp = temporary_name(final)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_empty(folders: list[Path]) -> None:
    """Remove these folders (deepest first) while they are empty: another writer's files keep
    them."""
    with contextlib.suppress(OSError):
        for folder in folders:
            folder.rmdir()


def as_os_error(exc: SafetensorError) -> OSError:
    """safetensors' write error as the OSError it wraps (its errno read from the message)."""
    code = _OS_CODE.search(str(exc))
    number = int(code[1]) if code else errno.EIO
    return OSError(number, os.strerror(number) if code else str(exc)[:200])


def _save_tensors(tensors: dict[str, torch.Tensor], manifest: dict, path: Path) -> None:
    try:
        save_file(tensors, str(path), metadata={"lvx_manifest": json.dumps(manifest)})
    except SafetensorError as exc:
        raise as_os_error(exc) from None


def atomic_save(tensors: dict[str, torch.Tensor], manifest: dict, final: Path) -> None:
    """Write a safetensors file with `manifest` in its header, atomically (raises OSError)."""
    atomic_write(final, lambda tmp: _save_tensors(tensors, manifest, tmp))


def atomic_write_text(final: Path, text: str) -> None:
    """Write a small text file atomically (raises OSError)."""
    atomic_write(final, lambda tmp: tmp.write_text(text))


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


def entry_folders(kind: Path) -> list[Path]:
    """The entry folders of one kind (`<cache dir>/features`, ...): other folders are not lvx's."""
    if not kind.is_dir():
        return []
    return [
        p
        for p in sorted(kind.iterdir())
        if ENTRY_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    ]


def lvx_files(folder: Path, names: re.Pattern, only: set[str] | None = None) -> list[Path]:
    """The files lvx wrote in an entry folder: the kind's own `names` with lvx's header, and their
    temporary files; `only`: of these file names alone."""
    out = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if p.is_symlink() or not p.is_file():
            continue
        temporary = _TEMPORARY.fullmatch(p.name)
        name = temporary["name"] if temporary else p.name
        if not names.fullmatch(name) or (only is not None and name not in only):
            continue
        if temporary or has_lvx_header(p):
            out.append(p)
    return out


def delete_files(folder: Path, files: list[Path]) -> tuple[int, OSError | None]:
    """Delete `files` of one entry folder, then the folder once it is empty: (files deleted, the
    first error)."""
    deleted, error = 0, None
    for f in files:
        try:
            f.unlink()
            deleted += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            error = error or exc
    with contextlib.suppress(OSError):  # kept while files lvx did not write are in it
        folder.rmdir()
    return deleted, error


def leftovers(kind: Path) -> list[Path]:
    """Files still in one kind's folder (after deleting: those lvx did not write)."""
    if not kind.is_dir():
        return []
    return sorted(p for p in kind.rglob("*") if not p.is_dir())


def touch(path: Path) -> None:
    """Mark a cache file "last used" (for `lvx cache ls`) where its folder can be written; reading a
    cache never needs it."""
    with contextlib.suppress(OSError):
        os.utime(path)


def discard(path: Path) -> str:
    """Delete a damaged cache file, or a folder in its place that holds no file; what happened, for
    a warning line."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        return f"could not delete it ({exc.strerror or exc})"
    return "deleted it"
