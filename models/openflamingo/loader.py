"""Load an OpenFlamingo checkpoint (its three parts, `checkpoint`) into `OpenFlamingoModel` and its
processor: the config read from the parts' files, every tensor checked against the module tree's
names and shapes, then assigned in the asked dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..generation_config import answer_length
from ..safetensors_folder import CheckpointError
from .checkpoint import Parts, published_state, resolve_parts
from .config import OpenFlamingoConfig
from .folder_config import read_config
from .modeling import OpenFlamingoModel
from .mpt import alibi_slopes
from .processor import FlamingoProcessor
from .tokenizer import FlamingoTokenizer


@dataclass(frozen=True)
class FlamingoCheckpoint:
    """A checkpoint read without its weights: where its parts are, and its config."""

    path: Path
    parts: Parts
    config: OpenFlamingoConfig


class LoadedFlamingo(NamedTuple):
    model: OpenFlamingoModel
    processor: FlamingoProcessor
    config: OpenFlamingoConfig


def inspect_checkpoint(path_or_id: str | Path, revision: str | None = None) -> FlamingoCheckpoint:
    parts = resolve_parts(path_or_id, revision)
    return FlamingoCheckpoint(parts.flamingo, parts, read_config(parts))


def layout_shapes(cfg: OpenFlamingoConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model with its shape (the module tree's names, built on meta)."""
    with torch.device("meta"):
        model = OpenFlamingoModel(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_layout(state: dict[str, torch.Tensor], cfg: OpenFlamingoConfig, where: Path) -> None:
    """Raise a CheckpointError for a missing, unknown or misshapen tensor."""
    want = layout_shapes(cfg)
    for what, keys in (("lack", set(want) - set(state)), ("have unknown", set(state) - set(want))):
        if keys:
            raise CheckpointError(
                f"{where}: the checkpoint's parts {what} {len(keys)} tensors of the model, e.g. "
                f"{sorted(keys)[0]}"
            )
    for key, t in state.items():
        if tuple(t.shape) != want[key]:
            raise CheckpointError(
                f"{where}: {key} is {tuple(t.shape)}, the config implies {want[key]}"
            )


def load_openflamingo(
    parts: Parts, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedFlamingo:
    """The model in eval mode on `device` in `dtype`, with its processor."""
    tokenizer = FlamingoTokenizer.from_pretrained(parts.text)
    cfg = read_config(parts, tokenizer)
    state = published_state(parts)
    if cfg.text.tie_word_embeddings:  # a tied head listed under its own name (transformers' MPT)
        state.pop("lang_encoder.lm_head.weight", None)
    check_layout(state, cfg, parts.flamingo)
    with torch.device("meta"):
        model = OpenFlamingoModel(cfg)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.text.alibi:  # the ALiBi slopes are no checkpoint tensor: made again on the device
        slopes = alibi_slopes(cfg.text.n_heads, cfg.text.alibi_bias_max)
        model.lang_encoder.transformer.alibi_slopes = slopes.to(device)
    processor = FlamingoProcessor(tokenizer, cfg.vision.image_size, answer_length(parts.text))
    return LoadedFlamingo(model.eval(), processor, cfg)
