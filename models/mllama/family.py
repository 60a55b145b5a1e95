"""Llama-3.2-Vision (Mllama) as the app sees it: the family record `lvx_models.api` lists."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..fingerprint import checkpoint_identity, encoder_identity
from ..parameter_counts import count_by_part
from ..safetensors_folder import CheckpointError, safetensors_files
from ..surface import Deferred, Family, Generation, Loaded
from .checkpoint import HUB_FILES, check_layout, resolve_folder
from .config import GENERATION, MllamaConfig
from .published import RELEASES

NAME = "mllama"
GENERATION_NOTE = "Llama-3.2-Vision 11B and 90B (base and Instruct)"
VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")
# how a frame runs through the tower, beyond its weights: part of the features' cache key
TOWER_INPUT = "tile-and-empty-tiles"


@dataclass(frozen=True)
class MllamaCheckpoint:
    """A checkpoint folder read without its weights: its config, checked against the layout."""

    path: Path
    config: MllamaConfig


def inspect(path_or_id: str | Path, revision: str | None = None) -> MllamaCheckpoint:
    folder = resolve_folder(path_or_id, revision)
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder} holds no config.json: not a checkpoint folder")
    config = MllamaConfig.from_json(folder / "config.json")
    check_layout(safetensors_files(folder), config)
    return MllamaCheckpoint(folder, config)


def load(
    path_or_id: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    fuse: bool = True,
) -> Loaded:
    """(the engine's model, config, processor) in eval mode on `device` in `dtype` (`fuse` has
    nothing to fuse here: the projections stay separate)."""
    from .loader import load_mllama
    from .video_model import MllamaVideoModel

    model, processor, config = load_mllama(resolve_folder(path_or_id, revision), dtype, device)
    return Loaded(MllamaVideoModel(model).eval(), config, processor)


def describe(info: MllamaCheckpoint) -> dict[str, str]:
    """The rows `lvx info --model` shows: family, generation, where the frames go, sizes."""
    t, v = info.config.text, info.config.vision
    return {
        "model": str(info.path),
        "family": f"Llama-3.2-Vision ({NAME})",
        "generation": f"{GENERATION}: {GENERATION_NOTE}",
        "video prompt": "<|image|> per frame, one tile each (one prompt position a frame)",
        "images beside a video": "not supported yet (videos only)",
        "cross-attention layers (0-based)": ", ".join(map(str, t.cross_attention_layers)),
        "sizes": f"hidden {t.hidden_size}, {t.num_hidden_layers} layers, "
        f"{t.num_attention_heads} heads / {t.num_key_value_heads} kv heads, "
        f"{v.patches_per_tile} visual tokens per tile, up to {v.max_num_tiles} tiles an image",
    }


def frame_encoder_identity(
    model: str, revision: str | None, memo: dict[str, str] | None = None
) -> tuple[str, str]:
    """(checkpoint path, fingerprint of the tower + projector weights and of how a frame runs
    through them), so features made another way are never read back."""
    path, weights = encoder_identity(VISION_PREFIXES, model, revision, memo, hub_files=HUB_FILES)
    return path, hashlib.sha256(f"{weights}:{TOWER_INPUT}".encode()).hexdigest()[:32]


def parameter_counts(config: MllamaConfig) -> dict[str, int]:
    """Parameters by part of `MllamaModel(config)`."""
    from .modeling import MllamaModel

    return count_by_part(
        lambda: MllamaModel(config),
        {
            "vision": "vision_model",
            "projector": "multi_modal_projector",
            "language": "language_model",
            "embedding": "language_model.model.embed_tokens",
        },
    )


def write_tiny(directory: str | Path, generation: str = "3.2") -> Path:
    from .tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(directory)


FAMILY = Family(
    name=NAME,
    title="Llama-3.2-Vision",
    model_types=("mllama",),
    generations=(Generation(NAME, GENERATION, GENERATION_NOTE),),
    load=load,
    inspect=inspect,
    describe=describe,
    read_config=lambda folder: MllamaConfig.from_json(Path(folder) / "config.json"),
    write_tiny=write_tiny,
    checkpoint_identity=partial(checkpoint_identity, hub_files=HUB_FILES),
    encoder_identity=frame_encoder_identity,
    parameter_counts=parameter_counts,
    config_type=MllamaConfig,
    hub_files=HUB_FILES,
    save_weights=Deferred(f"{__package__}.saving", "save_weights"),
    published=RELEASES,
)
