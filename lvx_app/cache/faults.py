"""What goes wrong with a cache folder, each said in one line: a damaged file, entries that could
not be deleted, and a write that failed.

A write that fails never fails the load that tried it: what was computed is used without being
saved. A folder that cannot be written and a full disk are said once per folder and process (every
later write there would fail alike), a folder standing where a cache file belongs once per path,
any other failure each time.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

# what a write into a folder the user may not change fails with
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_said: set[tuple[str, str]] = set()


class CacheWarning(UserWarning):
    """A cache file was damaged, could not be read, or what was computed could not be saved; the
    load goes on without it."""


class CorruptEntry(Exception):
    """A cache file that fails a check (header, key, shapes, byte count, checksum)."""


class CacheRemovalError(OSError):
    """Entries whose files could not be deleted (`failed` of them, `why`); `removed` holds those
    that were."""

    def __init__(self, failed: int, why: str, where: Path, removed: list) -> None:
        super().__init__(removal_failed(failed, why, where))
        self.failed, self.why, self.removed = failed, why, removed


def removal_failed(failed: int, why: str, where: Path) -> str:
    """The one line for entries that could not be deleted."""
    entries = f"{failed} entr{'y' if failed == 1 else 'ies'}"
    return f"could not delete {entries} in {where} ({why}); make it writable, then run it again"


def say_once(about: tuple[str, str], message: str) -> None:
    """Warn `message` the first time this process meets `about` (a kind of fault and where)."""
    if about in _said:
        return
    _said.add(about)
    warnings.warn(message, CacheWarning, stacklevel=3)


def warn_folder_in_place(path: Path, content: str) -> None:
    """A folder holding someone's files stands where lvx keeps `content`: it is left alone."""
    say_once(
        ("folder", str(path)),
        f"{path} is a folder holding files lvx did not write, where lvx keeps {content}: it is "
        f"left alone and nothing is cached there; move it away to keep {content}",
    )


def warn_not_saved(root: Path, exc: OSError, what: str, then: str) -> None:
    """One warning line for a cache write that failed with `exc` (`what` was not saved; `then` says
    what follows)."""
    where = str(root)
    if exc.errno in NOT_WRITABLE:
        say_once(
            ("not writable", where),
            f"the cache folder {root} cannot be written ({exc.strerror}): what it holds is used, "
            "what is computed is not saved; point --cache-dir (or LVX_CACHE_DIR) at a folder you "
            "may write to keep it",
        )
    elif exc.errno in FULL:
        say_once(
            ("full", where),
            f"the cache folder {root} is full ({exc.strerror}): what it holds is used, what is "
            "computed is not saved; free some space or point --cache-dir (or LVX_CACHE_DIR) at "
            "another folder to keep it",
        )
    elif exc.errno == errno.EISDIR and exc.filename:
        warn_folder_in_place(Path(exc.filename), what)
    else:
        warnings.warn(f"could not save {what} in {root} ({exc}); {then}", CacheWarning, 2)
