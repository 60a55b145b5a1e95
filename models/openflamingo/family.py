"""OpenFlamingo as the app sees it: the family record `lvx_models.api` lists."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..fingerprint import checkpoint_identity, encoder_fingerprint, prefix_digest
from ..parameter_counts import count_by_part
from ..surface import Deferred, Family, Generation, Loaded
from .checkpoint import (
    FLAMINGO_FILE,
    HUB_FILES,
    RELEASES,
    clip_weights,
    lvx_weights,
    resolve_parts,
    weight_files,
)
from .config import GENERATION, OpenFlamingoConfig
from .published import RELEASES as PUBLISHED

NAME = "openflamingo"
GENERATION_NOTE = "OpenFlamingo v2: " + "; ".join(r.note for r in RELEASES)
# the weights that decide the visual features: the CLIP tower and the perceiver
VISION_PREFIXES = ("vision_encoder.", "perceiver.")
# how a frame runs through them, beyond their weights: part of the features' cache key
TOWER_INPUT = "clip-shortest-side-center-crop:one-frame-media"


def load(
    path_or_id: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    fuse: bool = True,
) -> Loaded:
    """(the engine's model, config, processor) in eval mode on `device` in `dtype` (`fuse` has
    nothing to fuse: MPT's q, k and v are one projection already)."""
    from .loader import load_openflamingo
    from .training import FinetunableFlamingo

    model, processor, config = load_openflamingo(resolve_parts(path_or_id, revision), dtype, device)
    return Loaded(FinetunableFlamingo(model).eval(), config, processor)


def inspect(path_or_id: str | Path, revision: str | None = None):
    from .loader import inspect_checkpoint

    return inspect_checkpoint(path_or_id, revision)


def read_config(folder: Path) -> OpenFlamingoConfig:
    from .folder_config import read_config as from_parts

    return from_parts(resolve_parts(folder))


def describe(info) -> dict[str, str]:
    """The rows `lvx info --model` shows: family, generation, where the parts are, the prompt."""
    cfg, parts = info.config, info.parts
    t = cfg.text
    return {
        "model": str(info.path),
        "family": f"OpenFlamingo ({NAME})",
        "generation": f"{GENERATION}: {GENERATION_NOTE}",
        "parts": f"vision {parts.vision}, text {parts.text}",
        "video prompt": "<image> per frame, then Question:{question} Short answer: (one prompt "
        "position a frame)",
        "images beside a video": "not supported yet (videos only)",
        "cross-attention layers (0-based)": ", ".join(map(str, cfg.cross_layer_indices)),
        "sizes": f"hidden {t.d_model}, {t.n_layers} layers, {t.n_heads} heads (no GQA), "
        f"{cfg.visual_tokens_per_frame} visual tokens per frame, cross layers "
        f"{cfg.cross_heads} heads of {cfg.cross_dim_head}",
    }


def frame_encoder_identity(
    model: str, revision: str | None, memo: dict[str, str] | None = None
) -> tuple[str, str]:
    """(checkpoint path, fingerprint of the CLIP tower + perceiver weights and of how a frame runs
    through them), so features made another way are never read back."""
    memo = {} if memo is None else memo
    parts = resolve_parts(model, revision)
    if lvx_weights(parts.flamingo) is not None:
        weights = encoder_fingerprint(parts.flamingo, prefixes=VISION_PREFIXES, memo=memo)
    else:
        weights = prefix_digest(clip_weights(parts.vision), "visual.", memo)
        weights += prefix_digest(parts.flamingo / FLAMINGO_FILE, "perceiver.", memo)
    key = f"{weights}:{TOWER_INPUT}".encode()
    return str(parts.flamingo.resolve()), hashlib.sha256(key).hexdigest()[:32]


def parts_identity(path_or_id: str | Path, revision: str | None = None) -> str:
    """A 32-hex-digit identity of every file of the checkpoint's parts (stats only)."""
    parts = resolve_parts(path_or_id, revision)
    h = hashlib.sha256()
    for folder in parts.folders:
        h.update(checkpoint_identity(folder).encode())
    return h.hexdigest()[:32]


def parameter_counts(config: OpenFlamingoConfig) -> dict[str, int]:
    """Parameters by part of `OpenFlamingoModel(config)`: the CLIP tower, the perceiver (the
    projector), the MPT model with its cross layers, its embedding table."""
    from .modeling import OpenFlamingoModel

    return count_by_part(
        lambda: OpenFlamingoModel(config),
        {
            "vision": "vision_encoder",
            "projector": "perceiver",
            "language": "lang_encoder",
            "embedding": "lang_encoder.transformer.wte",
        },
    )


FAMILY = Family(
    name=NAME,
    title="OpenFlamingo",
    # the text model's config.json, where a folder holds it beside checkpoint.pt
    model_types=("mosaic_gpt", "mpt"),
    generations=(Generation(NAME, GENERATION, GENERATION_NOTE, default=True),),
    load=load,
    inspect=inspect,
    describe=describe,
    read_config=read_config,
    write_tiny=Deferred(f"{__package__}.tiny", "write_tiny_checkpoint"),
    checkpoint_identity=parts_identity,
    encoder_identity=frame_encoder_identity,
    parameter_counts=parameter_counts,
    config_type=OpenFlamingoConfig,
    hub_files=HUB_FILES,
    save_weights=Deferred(f"{__package__}.saving", "save_weights"),
    marker_files=(FLAMINGO_FILE,),
    published=PUBLISHED,
    weight_files=weight_files,
    # a finetuned folder keeps `checkpoint.pt` (its mark) and the configs; its own weights file
    # holds the tower and the text model
    finetuned_replaces=(
        "*.safetensors",
        "model.safetensors.index.json",
        "pytorch_model*.bin",
        "pytorch_model.bin.index.json",
        "open_clip_pytorch_model.bin",
    ),
)
