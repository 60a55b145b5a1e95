"""One finetuning run per output folder: an exclusive lock held for the whole run, and no writing
into --model.

Two runs writing the same folder (a `--resume` started while the first still trains) interleave
checkpoints and resume states. `lock_output` takes `fcntl.flock` on `OUT/.lvx-finetune.lock` and
writes its pid there; the kernel drops the lock when every process holding the file is gone (the
launcher passes it to torchrun's agent, which dies with it), so a killed run never leaves a stale
lock behind. A run that ends removes the file while it still holds the lock (`release_output`); a
killed run leaves the file, unlocked. A run that locked a file another run removed meanwhile opens
the new one and locks that instead.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

LOCK_NAME = ".lvx-finetune.lock"
HOLDER_GONE_WAIT_S = (
    10.0  # how long a lock whose recording launcher has exited may take to be let go
)


class OutputBusy(Exception):
    """Another run holds the output folder, or the folder is the checkpoint the run starts from."""


class OutputUnwritable(OutputBusy):
    """The output folder cannot be made or written: a file of that name, or no permission."""


def _open_lock(out: Path) -> int:
    """Make `out` and open its lock file; one line when it cannot be (a file, read-only)."""
    if out.exists() and not out.is_dir():
        raise OutputUnwritable(f"--out {out} is a file, not a folder; choose a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:  # the lock file of an earlier run may be writable in a folder that is not
            tempfile.TemporaryFile(dir=out).close()
        except OSError:
            os.close(fd)
            raise
        return fd
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise OutputUnwritable(
            f"--out {out} cannot be written ({why}); choose a folder you can write"
        ) from None


def check_out_is_not_model(out: Path, model: str) -> None:
    """Refuse an --out that is the --model checkpoint folder or inside it: saving would overwrite
    the base weights."""
    base = Path(model).expanduser()
    if not base.is_dir():
        return  # a hub id: its files live in the hub cache, not under --out
    base, target = base.resolve(), out.expanduser().resolve()
    if target == base or base in target.parents:
        raise OutputBusy(
            f"--out {out} is inside the --model checkpoint {model}; saving would overwrite the "
            "weights the run starts from: choose another --out"
        )


def _pid_exited(text: str) -> bool:
    """True when `text` names a process that no longer exists (not for text that is no pid)."""
    try:
        pid = int(text)
        if pid > 0:
            os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (ValueError, OverflowError, PermissionError):
        pass
    return False


def _take(fd: int, holder_gone_wait_s: float) -> str | None:
    """Lock `fd` (None), else the holder's pid as recorded; while that pid has exited, wait up to
    `holder_gone_wait_s` for its workers to let go."""
    deadline = time.monotonic() + holder_gone_wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if not _pid_exited(holder) or time.monotonic() >= deadline:
                return holder or "unknown"
            time.sleep(0.05)


def lock_output(out: Path, holder_gone_wait_s: float = HOLDER_GONE_WAIT_S) -> int:
    """Create `out` and lock it for this run; returns the lock's file descriptor (inheritable, to
    pass to children).

    A run whose launcher was just killed still holds the lock for a moment through torchrun's agent,
    which dies a step behind it; while the pid in the file names an exited process, this waits up to
    `holder_gone_wait_s`.
    """
    while True:
        fd = _open_lock(out)
        holder = _take(fd, holder_gone_wait_s)
        if holder is not None or _still_the_lock_file(fd, out):
            break
        os.close(fd)  # locked a file the run before removed as it ended: lock the current one
    if holder is not None:
        os.close(fd)
        raise OutputBusy(
            f"{out} is in use by another lvx finetune run (pid {holder}); wait for it to end, stop "
            "it, or choose another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    os.set_inheritable(fd, True)
    return fd


def _still_the_lock_file(fd: int, out: Path) -> bool:
    """Whether `fd` is the file at `OUT/LOCK_NAME` now (not one removed since it was opened)."""
    try:
        now = os.stat(out / LOCK_NAME)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def release_output(out: Path, fd: int) -> None:
    """End the run's hold on `out`: its lock file goes (removed while still locked, so no other run
    holds it), then the lock."""
    try:
        if _still_the_lock_file(fd, out):
            (out / LOCK_NAME).unlink()
    except OSError:
        pass  # a folder that became read-only keeps the file; it is unlocked all the same
    finally:
        os.close(fd)
