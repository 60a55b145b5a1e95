"""Where a checkpoint is: a local folder as it is, or a Hugging Face hub id downloaded (or found in
the HF cache) with `snapshot_download`, fetching only the files its family reads (each family lists
them in its record, `Family.hub_files`). With HF_HUB_OFFLINE set only the cache is tried, and the
error says to pass a local folder."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from .safetensors_folder import CheckpointError

# what every family reads; a hub id whose family is not known yet is fetched with CONFIG_ONLY
# first (its config.json names the family)
COMMON_HUB_FILES = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
CONFIG_ONLY = ("config.json",)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_checkpoint(
    path_or_id: str | os.PathLike,
    revision: str | None = None,
    hub_files: Sequence[str] = CONFIG_ONLY,
) -> Path:
    """A local checkpoint folder, or the folder of a hub id's `hub_files` (glob patterns)."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(
                f"{p} is a file: pass the checkpoint directory (the one holding config.json and "
                f"model.safetensors)"
            )
        return p
    s = str(path_or_id)
    if not _HUB_ID.fullmatch(s):
        raise CheckpointError(
            f"{s}: no such directory (and not a Hugging Face hub id of the form owner/name)"
        )
    from huggingface_hub import snapshot_download  # only hub ids need it (and tests patch it there)

    offline = _offline()
    try:
        return Path(
            snapshot_download(
                s, revision=revision, allow_patterns=list(hub_files), local_files_only=offline
            )
        )
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one actionable line
        if offline:
            raise CheckpointError(
                f"{s} is not a local directory and HF_HUB_OFFLINE is set, so it cannot be "
                f"downloaded (and it is not in the Hugging Face cache): pass the local checkpoint "
                f"directory instead, e.g. --model /path/to/checkpoint"
            ) from None
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{s}: no such local directory, and downloading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {why}); check the id and the network, or pass a local directory"
        ) from None


def top_files(path_or_id: str | os.PathLike, revision: str | None = None) -> frozenset[str]:
    """The names of the files at the top of a checkpoint: a local folder's, a hub repo's as the hub
    lists them (`list_repo_files`), or with HF_HUB_OFFLINE set those of its snapshot in the local
    Hugging Face cache (what was downloaded of it)."""
    p = Path(path_or_id).expanduser()
    if p.exists() or _offline():
        folder = resolve_checkpoint(path_or_id, revision, CONFIG_ONLY)
        if not folder.is_dir():  # a cached snapshot of none of the files asked for
            return frozenset()
        return frozenset(f.name for f in folder.iterdir() if f.is_file())
    from huggingface_hub import list_repo_files

    try:
        names = list_repo_files(str(path_or_id), revision=revision)
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one actionable line
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{path_or_id}: listing its files on the Hugging Face hub failed "
            f"({type(e).__name__}: {why}); check the id and the network, or pass a local directory"
        ) from None
    return frozenset(n for n in names if "/" not in n)
