"""Device rules shared by chat, ingestion and finetuning: which dtype "auto" means, how memory is
reported, and how many CPU cores this process may use.

A leaf module (torch only), so the engine, the video pipeline and the trainer read one rule instead
of three copies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def default_dtype(device: torch.device | str) -> torch.dtype:
    """ "auto": bfloat16 on GPU, float32 on CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_dtype(name: str, device: torch.device | str, choices: tuple[str, ...]) -> torch.dtype:
    """The dtype a `--dtype` value names: "auto" (see `default_dtype`) or one of `choices` (keys of
    DTYPES).

    Each command offers its own `choices` (chat has float16, finetuning float64); an unknown name
    raises a ValueError whose message lists them.
    """
    if name == "auto":
        return default_dtype(device)
    if name not in choices:
        raise ValueError(
            f"unknown --dtype {name!r}; use auto, {', '.join(choices[:-1])} or {choices[-1]}"
        )
    return DTYPES[name]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated on `device`, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_report(device: torch.device) -> dict[str, str]:
    """Human-readable memory of this process on `device`: allocated / peak / free on GPU, peak RSS
    on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "allocated": f"{torch.cuda.memory_allocated(device) / 2**30:.2f} GiB",
            "peak": f"{peak_memory_bytes(device) / 2**30:.2f} GiB",
            "free": f"{free / 2**30:.1f} of {total / 2**30:.0f} GiB",
        }
    return {"peak RSS": f"{peak_memory_bytes(device) / 2**30:.2f} GiB"}


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# Resident memory a process may gain after it gave freed memory back before it gives it back again:
# below it, freed pages serve the next command's temporaries (a question's attention tiles, an
# answer's evidence shares) without being page-faulted in again, a cost that grows with the frames.
KEPT_BYTES = 256 * 2**20


@functools.cache
def _glibc():
    """glibc, loaded once (None elsewhere). Its threshold for mapping a block apart is left to
    glibc, which raises it to the size of each mapped block freed: fixed low, every tensor above it
    would be mapped afresh and page-faulted in at each use instead of reusing the heap."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class _GivenBack:
    """Resident bytes right after this process last gave freed memory back (None: not yet)."""

    resident: int | None = None


def release_free_memory(kept: int = KEPT_BYTES) -> None:
    """Give the memory freed since the last give-back to the system (glibc's `malloc_trim`; nothing
    elsewhere) the first time, then once the process holds more than `kept` bytes over what it
    held right after the last time.
    Without it glibc keeps freed pages of its many arenas in the process, and a server's resident
    memory creeps up request after request instead of settling."""
    libc = _glibc()
    if libc is None:
        return
    now, last = resident_bytes(), _GivenBack.resident
    if now is not None and last is not None and now <= last + kept:
        return
    libc.malloc_trim(0)
    _GivenBack.resident = resident_bytes()
