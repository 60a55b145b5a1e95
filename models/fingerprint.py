"""A fingerprint of the weights that decide the visual features (a family's vision tower and
projector, named by their key prefixes), for the feature cache.

A checkpoint's path or hub id says nothing about its weights: a finetune written over the same
folder, or another checkpoint at the same relative path, must not reuse the old features. The
fingerprint is a hash of the raw bytes (with names, dtypes and shapes) of every tensor under the
family's vision prefixes, read straight from the safetensors files (or the PyTorch weight files a
family's `weight_files` names, `torch_files`). Hashing a 7B checkpoint's
tower reads ~0.8 GB, so each file's digest can be remembered in a memo (a dict the caller keeps,
e.g. in its cache folder) keyed by the file's identity (path, device, inode, size, mtime and ctime:
a rewrite changes ctime even when mtime is set back), and a later start only stats the files.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from .checkpoint_folder import CONFIG_ONLY, resolve_checkpoint
from .safetensors_folder import CheckpointError, keys_of, safetensors_files
from .torch_files import is_torch_file, torch_digest, torch_tensors

_READ = 16 << 20
WeightFiles = Callable[[Path], dict[str, Path]]  # a checkpoint folder -> {key: file holding it}


def _identity(f: Path) -> str:
    st = os.stat(f)
    return f"{f.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _tensor_digest(f: Path, keys: list[str]) -> str:
    """sha256 over (name, dtype, shape, bytes) of `keys` in the safetensors (or PyTorch weight)
    file `f`, in key order."""
    h = hashlib.sha256()
    if is_torch_file(f):
        torch_digest(torch_tensors(f), keys, h.update)
        return h.hexdigest()
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


def prefix_digest(f: Path, prefix: str, memo: dict[str, str]) -> str:
    """The digest of one weight file's tensors under `prefix` (a PyTorch file's `module.` put
    aside), remembered in `memo` by the file's identity and the prefix, so a later start only stats
    the file."""
    ident = f"{_identity(f)}:{prefix}"
    if ident in memo:
        return memo[ident]
    chosen = lambda k: k.removeprefix("module.").startswith(prefix)  # noqa: E731
    if is_torch_file(f):  # one load lists the keys and reads their tensors
        tensors, h = torch_tensors(f), hashlib.sha256()
        torch_digest(tensors, list(filter(chosen, tensors)), h.update)
        memo[ident] = h.hexdigest()
    else:
        memo[ident] = file_digest(f, list(filter(chosen, keys_of(f))), memo)
    return memo[ident]


def encoder_fingerprint(
    path_or_id: str | os.PathLike,
    revision: str | None = None,
    *,
    prefixes: tuple[str, ...],
    memo: dict[str, str] | None = None,
    hub_files: tuple[str, ...] = CONFIG_ONLY,
    weight_files: WeightFiles = safetensors_files,
) -> str:
    """A 32-hex-digit hash of the vision tower and projector weights; equal weights give equal
    fingerprints. `memo`: the files' digests already known, by file identity; the ones computed
    here are added to it. `weight_files`: the family's (`Family.weight_files`)."""
    files = weight_files(resolve_checkpoint(path_or_id, revision, hub_files))
    by_file: dict[Path, list[str]] = {}
    for k, f in files.items():
        if k.startswith(prefixes):
            by_file.setdefault(f, []).append(k)
    table = {} if memo is None else memo
    h = hashlib.sha256()
    for f in sorted(by_file):
        h.update(file_digest(f, by_file[f], table).encode())
    return h.hexdigest()[:32]


def file_digest(f: Path, keys: list[str], memo: dict[str, str]) -> str:
    """The sha256 of `keys` of one weight file (safetensors or PyTorch), remembered in `memo` by
    the file's identity and the keys."""
    names = hashlib.sha256(" ".join(sorted(keys)).encode()).hexdigest()[:16]
    ident = f"{_identity(f)}:{names}"
    if ident not in memo:
        try:
            memo[ident] = _tensor_digest(f, keys)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{f} is not a readable weight file ({type(exc).__name__}: {exc})"
            ) from None
    return memo[ident]


def encoder_identity(
    prefixes: tuple[str, ...],
    model: str,
    revision: str | None,
    memo: dict[str, str] | None = None,
    *,
    hub_files: tuple[str, ...] = CONFIG_ONLY,
    weight_files: WeightFiles = safetensors_files,
) -> tuple[str, str]:
    """(resolved checkpoint path, fingerprint of its vision tower + projector weights) for the
    feature cache's key; compute it before loading the weights, so features are never filed under
    weights newer than the model's. `memo` as for `encoder_fingerprint` (raises CheckpointError for
    an unreadable checkpoint). `hub_files`: what a hub id's family reads; `weight_files`: which
    file holds each of its keys (`Family.weight_files`)."""
    path = str(resolve_checkpoint(model, revision, hub_files).resolve())
    fingerprint = encoder_fingerprint(path, prefixes=prefixes, memo=memo, weight_files=weight_files)
    return path, fingerprint


def checkpoint_identity(
    path_or_id: str | os.PathLike,
    revision: str | None = None,
    *,
    hub_files: tuple[str, ...] = CONFIG_ONLY,
) -> str:
    """A 32-hex-digit identity of every file of a checkpoint (weights, config, tokenizer) from their
    stats alone:
    path, device, inode, size, mtime and ctime, so a rewrite of any file changes it without reading
    16 GB."""
    root = resolve_checkpoint(path_or_id, revision, hub_files)
    h = hashlib.sha256()
    for f in sorted(p for p in root.iterdir() if p.is_file()):
        h.update(_identity(f).encode())
    return h.hexdigest()[:32]
