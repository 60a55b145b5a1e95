"""The encoder weights' fingerprints remembered in the cache folder (`encoder-fingerprints.json`).

The model computes a fingerprint of its vision tower and projector weights from each weight
file's digest (`lvx_models.fingerprint`); hashing a 7B checkpoint's tower reads ~0.8 GB,
so the digests are kept here, keyed by each file's identity, and a later start only stats the
files. The memo is written as every cache file is: atomically. A folder that cannot be written or
is full only costs a re-hash next time, said by the cache entries that cannot be saved there either
(a start-up of a group has no user to tell yet); a folder of someone's in the memo's place is said
once.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lvx_app.cache.faults import warn_not_saved
from lvx_app.cache.files import atomic_write_text
from lvx_app.cache.store import cache_root

MEMO_NAME = "encoder-fingerprints.json"


def _read_memo(memo: Path) -> dict[str, str]:
    try:
        table = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged: digests are recomputed
    return table if isinstance(table, dict) else {}


def _write_memo(memo: Path, table: dict[str, str]) -> None:
    try:
        atomic_write_text(memo, json.dumps(table, indent=0))
    except OSError as exc:  # only costs a re-hash next time
        if exc.errno == errno.EISDIR:
            then = "the next start hashes them again"
            warn_not_saved(memo.parent, exc, "the encoder weights' fingerprints", then)


@contextmanager
def fingerprint_memo(cache_dir: str | os.PathLike | None) -> Iterator[dict[str, str]]:
    """The file digests remembered in the cache folder, for the model's fingerprint to read and add
    to; saved back when the block added any (and ended without an error)."""
    memo = cache_root(cache_dir) / MEMO_NAME
    table = _read_memo(memo)
    known = dict(table)
    yield table
    if table != known:
        _write_memo(memo, table)
