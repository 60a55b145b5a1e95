"""Opening a file a user named without letting it block the process: only a regular file is opened.

A FIFO opened for reading waits until someone writes into it, a device may never end, a folder is
no video: each is refused in one line instead. The file is opened non-blocking and checked on the
open descriptor (`fstat`), so a file swapped for a FIFO after an earlier check is caught too;
libraries that open by name (decord, FFmpeg) are handed `/proc/self/fd/N`, the very file checked.

A leaf module (the standard library only): the video pipeline, the subtitle readers, the caches and
the API read one rule.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotARegularFile(OSError):
    """A path that names something other than a regular file; its message is the one line."""


def what_it_is(mode: int) -> str:
    """'a FIFO (named pipe)', 'a folder', ... for a `st_mode` that is no regular file."""
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def refusal(path: str | os.PathLike, mode: int) -> NotARegularFile:
    return NotARegularFile(
        f"{os.fspath(path)} is {what_it_is(mode)}, not a file: name a regular file"
    )


def open_regular(path: str | os.PathLike) -> int:
    """A descriptor of the regular file `path` (blocking reads, closed on exec); NotARegularFile
    for anything else, OSError as `open` raises it (missing, no permission). Never blocks: a FIFO
    is opened non-blocking, then refused."""
    mode = os.stat(path).st_mode  # a device or a FIFO is refused before it is opened at all
    if not stat.S_ISREG(mode):
        raise refusal(path, mode)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode  # what was opened, also when it was swapped meanwhile
        if not stat.S_ISREG(mode):
            raise refusal(path, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def regular_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """`open(path, "rb")` for a regular file only (see `open_regular`)."""
    with os.fdopen(open_regular(path), "rb") as f:
        yield f


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file `path`, refused (ValueError) past `limit` bytes: a read never
    takes more memory than asked for."""
    with regular_file(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(
            f"{os.fspath(path)} is larger than {limit / 2**20:g} MiB, more than such a file holds"
        )
    return data


def check_regular(path: str | os.PathLike) -> None:
    """Raise NotARegularFile unless `path` names a regular file (OSError when it cannot be
    opened)."""
    os.close(open_regular(path))


def by_descriptor(fd: int, path: str | os.PathLike) -> str:
    """A name that opens the file behind `fd` itself, not whatever `path` names by then:
    `/proc/self/fd/N` where the system has it, else `path`."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else os.fspath(path)
