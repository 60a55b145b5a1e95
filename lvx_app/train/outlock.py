"""One finetuning run per output folder: an exclusive lock held for the whole run, and no writing into --model.

Two runs writing the same folder (a `--resume` started while the first still trains) interleave checkpoints and
resume states. `lock_output` takes `fcntl.flock` on `OUT/.lvx-finetune.lock` and writes its pid there; the kernel
drops the lock when every process holding the file is gone (the launcher passes it to torchrun's agent, which dies
with it), so a killed run never leaves a stale lock behind. The file itself stays.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".lvx-finetune.lock"


class OutputBusy(Exception):
    """Another run holds the output folder, or the folder is the checkpoint the run starts from."""


def check_out_is_not_model(out: Path, model: str) -> None:
    """Refuse an --out that is the --model checkpoint folder or inside it: saving would overwrite the base weights."""
    base = Path(model).expanduser()
    if not base.is_dir():
        return  # a hub id: its files live in the hub cache, not under --out
    base, target = base.resolve(), out.expanduser().resolve()
    if target == base or base in target.parents:
        raise OutputBusy(f"--out {out} is inside the --model checkpoint {model}; saving would overwrite the weights "
                         "the run starts from: choose another --out")


def lock_output(out: Path) -> int:
    """Create `out` and lock it for this run; returns the lock's file descriptor (inheritable, to pass to children)."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise OutputBusy(f"{out} is in use by another lvx finetune run (pid {holder}); wait for it to end, stop it, "
                         "or choose another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    os.set_inheritable(fd, True)
    return fd
