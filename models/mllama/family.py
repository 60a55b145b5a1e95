"""Llama-3.2-Vision (Mllama) as the app sees it: the family record `lvx_models.api` lists."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..fingerprint import checkpoint_identity, encoder_identity
from ..mplug_owl3.checkpoint import resolve_checkpoint
from ..safetensors_folder import CheckpointError, safetensors_files
from ..surface import Family, Generation, Loaded
from .checkpoint import check_layout
from .config import GENERATION, MllamaConfig
from .loader import load_mllama
from .modeling import MllamaModel
from .saving import save_weights
from .video_model import MllamaVideoModel

NAME = "mllama"
GENERATION_NOTE = "Llama-3.2-Vision 11B and 90B (base and Instruct)"
VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")


@dataclass(frozen=True)
class MllamaCheckpoint:
    """A checkpoint folder read without its weights: its config, checked against the layout."""

    path: Path
    config: MllamaConfig


def inspect(path_or_id: str | Path, revision: str | None = None) -> MllamaCheckpoint:
    folder = resolve_checkpoint(path_or_id, revision)
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
    model, processor, config = load_mllama(resolve_checkpoint(path_or_id, revision), dtype, device)
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


def parameter_counts(config: MllamaConfig) -> dict[str, int]:
    """Parameters by part of `MllamaModel(config)` built on the meta device."""
    with torch.device("meta"):
        model = MllamaModel(config)

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    return {
        "vision": count(model.vision_model),
        "projector": count(model.multi_modal_projector),
        "language": count(model.language_model),
        "embedding": model.language_model.model.embed_tokens.weight.numel(),
    }


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
    checkpoint_identity=checkpoint_identity,
    encoder_identity=partial(encoder_identity, VISION_PREFIXES),
    parameter_counts=parameter_counts,
    config_type=MllamaConfig,
    save_weights=save_weights,
)
