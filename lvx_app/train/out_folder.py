"""Finetuning checkpoints: official-layout weights (loadable by `lvx chat --model OUT`) plus a
resume state.

OUT holds
- the family's weights file (`Family.finetuned_file`: `model.safetensors` for the Hugging Face
  families): every key of its published layout (reference mplug_owl3.md §3), LoRA adapters merged
  into their base weights; the vision keys the model never uses are copied from the source
  checkpoint, so OUT is a complete published checkpoint, not a partial one (the family writes them:
  `Family.save_weights`);
- every other file of the source checkpoint (config.json, tokenizer files, generation config,
  processor code, weight files the family's file does not replace: `Family.finetuned_replaces`),
  copied as they are;
- `train_state.pt`: step, the trainable tensors exactly as trained (LoRA adapters unmerged),
  optimizer, scheduler, RNG states, the base model path and the loss history. Resuming loads the
  *base* model again and puts these tensors back, so merged weights are never trained twice. Every
  file is written to a temporary name and `os.replace`d (atomic on one file system); train_state.pt
  goes last, so an interrupted save leaves a resumable directory whose state matches its step.
"""

from __future__ import annotations

import fnmatch
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lvx_models.api import CheckpointError, Family, checkpoint_folder, family_of

STATE_FILE = "train_state.pt"
PARTIAL = ".partial-"  # in the name of a file being written, until it is moved onto its own


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic(path: Path, write) -> None:
    """Call write(tmp_path) then move it onto `path`, with the mode a plain new file gets (the
    temporary file is private, 0600, and the model is shared like any other file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{PARTIAL}", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def discard_partial(out: Path) -> None:
    """Remove what a save killed half-way left in `out` (a weights file may be gigabytes); only the
    run holding `out`'s lock may call this."""
    for f in out.glob(f".*{PARTIAL}*"):
        f.unlink(missing_ok=True)


def family_to_finetune(base: str | Path, revision: str | None = None) -> Family:
    """The family of the checkpoint `base`, if lvx can write its finetuned weights back."""
    family = family_of(base, revision)
    if family.save_weights is None:
        raise CheckpointError(f"finetuning {family.title} is not supported yet")
    return family


def save_checkpoint(
    out: str | Path,
    model: torch.nn.Module,
    base: str | Path,
    state: dict[str, Any],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write OUT (see the module docstring). `base` is the checkpoint training started from; `dtype`
    of the saved weights defaults to the base checkpoint's. Call on one rank only."""
    out = Path(out)
    family = family_to_finetune(base)
    weights = family.save_weights(model, base, dtype)
    source = checkpoint_folder(base)
    mine = family.finetuned_file

    def replaced(name: str) -> bool:
        return name == mine or any(fnmatch.fnmatch(name, p) for p in family.finetuned_replaces)

    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != source.resolve():
        for f in source.iterdir():
            if f.is_file() and not replaced(f.name) and f.name != STATE_FILE:
                _atomic(out / f.name, lambda tmp, f=f: shutil.copyfile(f, tmp))
    for old in out.iterdir():
        if old.is_file() and replaced(old.name) and old.name != mine and PARTIAL not in old.name:
            old.unlink()
    if mine.endswith(".safetensors"):
        _atomic(out / mine, lambda tmp: save_file(weights, tmp, metadata={"format": "pt"}))
    else:
        _atomic(out / mine, lambda tmp: torch.save(weights, tmp))
    _atomic(out / STATE_FILE, lambda tmp: torch.save(state, tmp))
    return out


def rng_state() -> dict[str, Any]:
    s: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available() and len(s["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(s["cuda"])


def load_state(out: str | Path) -> dict[str, Any]:
    """The resume state saved in OUT; a one-line error if there is none."""
    f = Path(out) / STATE_FILE
    if not f.exists():
        raise FileNotFoundError(
            f"no {STATE_FILE} in {out} to resume from; run without --resume to start fresh"
        )
    return torch.load(f, map_location="cpu", weights_only=False)
