"""A worker group's run folder (`lvx-run-*` in the temporary folder): where ranks write their pid
and error, and torchrun its own logs. A run that ends well removes it; one that fails keeps it,
since its one-line error points at the traces inside.

So that failed runs do not gather forever, a run folder is locked (`fcntl.flock` on its `.lock`) by
the process that made it for as long as that process lives (the kernel drops the lock when it
dies), and every new run removes the folders of ended runs beyond the `KEEP_ENDED` newest. A folder
changed in the last `SETTLE_S` seconds is never removed: it may be a run that is just starting.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

PREFIX = "lvx-run-"
KEEP_ENDED = 8
SETTLE_S = 600.0
LOCK_NAME = ".lock"
SOCKETS = "pymp-*"  # multiprocessing's folders, which the ranks make here (video/decode.py)


class RunDir:
    """A run folder, locked while this object is open."""

    def __init__(self, root: str | Path | None = None) -> None:
        root = Path(root or tempfile.gettempdir())
        remove_ended(root)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
        self._lock = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def close(self, keep: bool) -> None:
        """Let the folder go: kept (a failed run's traces), or removed."""
        if self._lock < 0:
            return
        if not keep:
            shutil.rmtree(self.path, ignore_errors=True)
        for sockets in self.path.glob(SOCKETS):  # the ranks' forkserver sockets: of no use now
            shutil.rmtree(sockets, ignore_errors=True)
        os.close(self._lock)
        self._lock = -1


def _ended(folder: Path) -> bool:
    """True when no process holds `folder`'s lock (a folder without one is from an ended run)."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # someone else's, or unreadable: not ours to remove
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_ended(root: Path, keep: int = KEEP_ENDED, settle_s: float = SETTLE_S) -> list[Path]:
    """Remove this user's run folders under `root` of runs that ended, beyond the `keep` newest
    and unchanged for `settle_s` seconds; the folders removed."""
    uid, now = os.getuid(), time.time()
    folders = []
    for folder in root.glob(PREFIX + "*"):
        try:
            stat = folder.lstat()
        except OSError:
            continue
        if folder.is_dir() and not folder.is_symlink() and stat.st_uid == uid:
            folders.append((stat.st_mtime, folder))
    folders.sort(reverse=True)
    removed = []
    for mtime, folder in folders[keep:]:
        if now - mtime > settle_s and _ended(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
