"""A Hugging Face checkpoint folder's safetensors, read from their headers only: which file holds
each key, and each tensor's shape. Every family's loader and layout check reads a folder this way,
and so does the app's memory check before a group starts (no weights are read)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open


class CheckpointError(RuntimeError):
    """A checkpoint problem a user can fix; the message is one line naming the problem (and the
    key)."""


def safetensors_files(d: Path) -> dict[str, Path]:
    """key -> file, from model.safetensors.index.json or model.safetensors (headers only)."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index} is not a safetensors index (no weight_map): {e}"
            ) from None
        files = {k: d / f for k, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.exists():
                raise CheckpointError(f"{index} lists shard {f.name}, which is missing from {d}")
        return files
    single = d / "model.safetensors"
    if single.exists():
        return {k: single for k in keys_of(single)}
    if any(d.glob("*.bin")) or any(d.glob("*.pt")):
        raise CheckpointError(
            f"{d} holds PyTorch .bin/.pt weights; only safetensors checkpoints are supported "
            f"(the official repos ship model.safetensors)"
        )
    raise CheckpointError(
        f"{d} is not a checkpoint: no model.safetensors or model.safetensors.index.json"
    )


def keys_of(f: Path) -> list[str]:
    """The tensor names of one safetensors file, read from its header."""
    try:
        with safe_open(str(f), framework="pt") as h:
            return list(h.keys())
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{f} is not a readable safetensors file ({type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0][:200]})"
        ) from None


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """key -> shape, each file's header opened once."""
    by_file: dict[Path, list[str]] = {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    out: dict[str, tuple[int, ...]] = {}
    for f, keys in by_file.items():
        try:
            with safe_open(str(f), framework="pt") as h:
                present = set(h.keys())
                for k in keys:
                    if k not in present:
                        raise CheckpointError(
                            f"model.safetensors.index.json maps {k} to {f.name}, which does not "
                            "hold it"
                        )
                    out[k] = tuple(h.get_slice(k).get_shape())
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"{f} is not a readable safetensors file ({type(e).__name__})"
            ) from None
    return out
