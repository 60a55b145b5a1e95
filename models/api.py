"""The surface of lvx_models: the one module the app imports.

A model family is one folder (`mplug_owl3/`, `mllama/`) that exports one `Family` record, listed
once in `FAMILIES`; a record names its loader and modeling code without importing them, so listing
the families imports none of their models. The app finds a checkpoint's family from its config.json,
or from the files that mark a family's checkpoints without one (`family_of`), and reaches the model
only through the record and the objects it returns, written down as Protocols in `surface`: the
model (`VideoModel`), its config (`ModelConfig`, the sizes the memory plan reads), its processor
(`Processor`) and the prompts it makes (`Prompt`). What a forward hands the attention
(`AttentionHooks`, `VisualInputs`, `VisualStep`) and the text cache every family keeps are shared
(`steps`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .checkpoint_folder import CONFIG_ONLY, resolve_checkpoint, top_files
from .pixels import resize_uint8, square_prep
from .safetensors_folder import CheckpointError, safetensors_files, tensor_shapes
from .steps import (
    AttentionHooks,
    ForwardStep,
    FrameFeatures,
    LazyVisualKV,
    TextKVCache,
    VisualInputs,
    VisualStep,
    kv_capacity,
)
from .surface import (
    VIDEO,
    Family,
    Finetunable,
    FramePrep,
    Generation,
    ModelConfig,
    Processor,
    Prompt,
    VideoModel,
)
from .torch_files import weight_shapes
from .valid_text import valid_text

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "VIDEO",
    "family_for_config",
    "AttentionHooks",
    "CheckpointError",
    "checkpoint_folder",
    "ForwardStep",
    "FrameFeatures",
    "Family",
    "Finetunable",
    "FramePrep",
    "Generation",
    "LazyVisualKV",
    "ModelConfig",
    "Processor",
    "Prompt",
    "TextKVCache",
    "VisualInputs",
    "VideoModel",
    "VisualStep",
    "family_named",
    "family_names",
    "family_of",
    "kv_capacity",
    "resize_uint8",
    "safetensors_files",
    "square_prep",
    "tensor_shapes",
    "valid_text",
    "weight_shapes",
]


def _families() -> dict[str, Family]:
    from .mllama.family import FAMILY as MLLAMA
    from .mplug_owl3.family import FAMILY as MPLUG_OWL3
    from .openflamingo.family import FAMILY as OPENFLAMINGO

    return {f.name: f for f in (MPLUG_OWL3, MLLAMA, OPENFLAMINGO)}  # the registry


FAMILIES: dict[str, Family] = _families()
DEFAULT_FAMILY = "mplug_owl3"


def family_names() -> str:
    """Every family as users see it named: its title, then its id ("mPLUG-Owl3 (mplug_owl3)")."""
    return ", ".join(f"{f.title} ({f.name})" for f in FAMILIES.values())


def family_named(name: str) -> Family:
    """The family a user named by its title or its id, in any case ("Llama-3.2-Vision", "mllama",
    "MPLUG-OWL3", "mplug_owl3")."""

    def key(s: str) -> str:
        return s.casefold().replace("-", "_")

    for family in FAMILIES.values():
        if key(name) in (key(family.name), key(family.title)):
            return family
    raise ValueError(f"model family must be one of {family_names()}, not {name!r}")


def family_of(path_or_id: str | Path, revision: str | None = None) -> Family:
    """The family of a checkpoint folder or hub id: the one whose `model_types` hold its
    config.json's `model_type`; without one, the family whose `marker_files` are all at its top
    (`top_files`). A `model_type` no family reads, a folder that matches no family, or one that
    matches several is a CheckpointError naming what each family expects; a config.json that cannot
    be read and no marker goes to the default family, whose loader says what is wrong with it."""
    folder = resolve_checkpoint(path_or_id, revision, CONFIG_ONLY)
    config = folder / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type:
        for family in FAMILIES.values():
            if model_type in family.model_types:
                return family
        raise CheckpointError(f"{config}: model_type {model_type!r} is none lvx runs: {_expects()}")
    present = top_files(path_or_id, revision)
    marked = [f for f in FAMILIES.values() if f.marker_files and present >= set(f.marker_files)]
    if len(marked) == 1:
        return marked[0]
    if marked:
        names = ", ".join(f.title for f in marked)
        raise CheckpointError(
            f"{path_or_id} holds the files of several families ({names}): pass the folder of one "
            "checkpoint"
        )
    if config.is_file():
        return FAMILIES[DEFAULT_FAMILY]
    raise CheckpointError(
        f"{path_or_id}: no config.json and no family's files, so not a checkpoint lvx runs: "
        f"{_expects()}"
    )


def _expects() -> str:
    """What each family's checkpoints hold, as the errors of `family_of` name it."""

    def one(f: Family) -> str:
        marks = [f"config.json of model_type {'/'.join(f.model_types)}"] if f.model_types else []
        marks += [" and ".join(f.marker_files)] if f.marker_files else []
        return f"{f.title} ({' or '.join(marks)})"

    return "; ".join(one(f) for f in FAMILIES.values())


def family_for_config(config: object) -> Family:
    """The family whose models `config` describes (a config `load` returned, or one built by hand
    for a plan)."""
    for family in FAMILIES.values():
        if isinstance(config, family.config_type):
            return family
    raise TypeError(f"{type(config).__name__} is no model family's config")


def checkpoint_folder(path_or_id: str | Path, revision: str | None = None) -> Path:
    """The local folder of a checkpoint: a folder as it is, a hub id with the files its family
    reads downloaded."""
    return resolve_checkpoint(path_or_id, revision, family_of(path_or_id, revision).hub_files)
