"""A fingerprint of the weights that decide the visual features (SigLIP tower + projector), for the
feature cache.

A checkpoint's path or hub id says nothing about its weights: a finetune written over the same
folder, or another checkpoint at the same relative path, must not reuse the old features. The
fingerprint is a hash of the raw bytes (with names, dtypes and shapes) of every `vision_model.*` and
`vision2text_model.*` tensor, read straight from the safetensors files. Hashing a 7B checkpoint's
tower reads ~0.8 GB, so each file's digest is remembered in a small JSON memo keyed by the file's
identity (path, device, inode, size, mtime and ctime: a rewrite changes ctime even when mtime is set
back), and a later start only stats the files. The memo lives in the cache folder
(`encoder-fingerprints.json`) and is written as every cache file is (`lvx_app.cache`): atomically.
A folder that cannot be written or is full only costs a re-hash next time, said by the cache
entries that cannot be saved there either (a start-up of a group has no user to tell yet); a folder
of someone's in the memo's place is said once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

from lvx_app.cache.faults import warn_not_saved
from lvx_app.cache.files import atomic_write_text
from lvx_app.cache.store import cache_root

from .checkpoint import PROJECTOR, VISION, CheckpointError, resolve_checkpoint, safetensors_files

MEMO_NAME = "encoder-fingerprints.json"

_READ = 16 << 20


def _identity(f: Path) -> str:
    st = os.stat(f)
    return f"{f.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _tensor_digest(f: Path, keys: list[str]) -> str:
    """sha256 over (name, dtype, shape, bytes) of `keys` in the safetensors file `f`, in key
    order."""
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        base = 8 + n
        for k in sorted(keys):
            meta = header[k]
            h.update(json.dumps([k, meta["dtype"], meta["shape"]]).encode())
            begin, end = meta["data_offsets"]
            fh.seek(base + begin)
            while begin < end:
                block = fh.read(min(_READ, end - begin))
                if not block:
                    raise ValueError(f"{f} is truncated inside {k}")
                h.update(block)
                begin += len(block)
    return h.hexdigest()


def _read_memo(memo: Path | None) -> dict[str, str]:
    try:
        table = json.loads(memo.read_text()) if memo is not None else {}
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


def encoder_fingerprint(
    path_or_id: str | os.PathLike, revision: str | None = None, *, memo: Path | None = None
) -> str:
    """A 32-hex-digit hash of the vision tower and projector weights; equal weights give equal
    fingerprints."""
    files = safetensors_files(resolve_checkpoint(path_or_id, revision))
    by_file: dict[Path, list[str]] = {}
    for k, f in files.items():
        if k.startswith((VISION, PROJECTOR)):
            by_file.setdefault(f, []).append(k)
    table = _read_memo(memo)
    changed = False
    h = hashlib.sha256()
    for f in sorted(by_file):
        names = hashlib.sha256(" ".join(sorted(by_file[f])).encode()).hexdigest()[:16]
        ident = f"{_identity(f)}:{names}"
        if ident not in table:
            try:
                table[ident] = _tensor_digest(f, by_file[f])
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"{f} is not a readable safetensors file ({type(exc).__name__}: {exc})"
                ) from None
            changed = True
        h.update(table[ident].encode())
    if changed and memo is not None:
        _write_memo(memo, table)
    return h.hexdigest()[:32]


def encoder_identity(
    model: str, revision: str | None, cache_dir: str | os.PathLike | None
) -> tuple[str, str]:
    """(resolved checkpoint path, fingerprint of its vision tower + projector weights) for the
    feature cache's key; compute it before loading the weights, so features are never filed under
    weights newer than the model's. The fingerprints are remembered in the cache folder (raises
    CheckpointError for an unreadable checkpoint)."""
    path = str(resolve_checkpoint(model, revision).resolve())
    return path, encoder_fingerprint(path, memo=cache_root(cache_dir) / MEMO_NAME)


def checkpoint_identity(path_or_id: str | os.PathLike, revision: str | None = None) -> str:
    """A 32-hex-digit identity of every file of a checkpoint (weights, config, tokenizer) from their
    stats alone:
    path, device, inode, size, mtime and ctime, so a rewrite of any file changes it without reading
    16 GB."""
    root = resolve_checkpoint(path_or_id, revision)
    h = hashlib.sha256()
    for f in sorted(p for p in root.iterdir() if p.is_file()):
        h.update(_identity(f).encode())
    return h.hexdigest()[:32]
