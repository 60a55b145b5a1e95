"""mPLUG-Owl3 as the app sees it: the family record `lvx_models.api` lists."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from ..fingerprint import checkpoint_identity, encoder_identity
from ..parameter_counts import count_by_part
from ..surface import Deferred, Family, Generation
from .checkpoint import HUB_FILES, PROJECTOR, VISION
from .config import FORM_NOTES, FORMS, NEWEST, Owl3Config
from .published import RELEASES, recognize

NAME = "mplug_owl3"
VISION_PREFIXES = (VISION, PROJECTOR)  # the weights that decide the visual features


def describe(info: Any) -> dict[str, str]:
    """The rows `lvx info --model` shows: the release it matches, generation, projector, sizes and
    the prompt rules with where each came from."""
    cfg = info.config
    release = recognize(cfg)
    return {
        "model": str(info.path),
        "family": f"mPLUG-Owl3 ({NAME})",
        "published as": f"this looks like {release}"
        if release
        else "no published mPLUG-Owl3 checkpoint has these sizes and weight form",
        "generation": f"{cfg.form}: {FORM_NOTES[cfg.form]}",
        "projector": cfg.projector,
        # numbered as the weights' keys number them, for every family (config.json's hyper_layers
        # count from 1)
        "cross-attention layers (0-based)": ", ".join(map(str, cfg.hyper_layer_indices)),
        "sizes": f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads} heads / "
        f"{cfg.num_key_value_heads} kv heads, {cfg.tokens_per_image} visual tokens per frame",
        **info.prompt_rules.describe(),
        **{f"note {i}": n for i, n in enumerate(info.notes, 1)},
    }


def parameter_counts(config: Owl3Config) -> dict[str, int]:
    """Parameters by part of `Owl3Model(config)`: the tower as built (all but the checkpoint's
    last layer), the projector, the language model (decoder layers, norms, embeddings, lm_head)
    and its embedding table."""
    from .modeling import Owl3Model

    return count_by_part(
        lambda: Owl3Model(config),
        {
            "vision": "vision_model",
            "projector": "vision2text_model",
            "language": "language_model",
            "embedding": "language_model.model.embed_tokens",
        },
    )


def read_config(folder: Path) -> Owl3Config:
    return Owl3Config.from_json(Path(folder) / "config.json")


FAMILY = Family(
    name=NAME,
    title="mPLUG-Owl3",
    model_types=("mplugowl3",),
    generations=tuple(Generation(NAME, form, FORM_NOTES[form], form == NEWEST) for form in FORMS),
    load=Deferred(f"{__package__}.loader", "load_model"),
    inspect=Deferred(f"{__package__}.loader", "inspect_checkpoint"),
    describe=describe,
    read_config=read_config,
    write_tiny=Deferred(f"{__package__}.tiny", "write_tiny_checkpoint"),
    checkpoint_identity=partial(checkpoint_identity, hub_files=HUB_FILES),
    encoder_identity=partial(encoder_identity, VISION_PREFIXES, hub_files=HUB_FILES),
    parameter_counts=parameter_counts,
    config_type=Owl3Config,
    hub_files=HUB_FILES,
    save_weights=Deferred(f"{__package__}.saving", "save_weights"),
    published={"mPLUG-Owl3-7B-241101": RELEASES["mPLUG-Owl3-7B-241101"], **RELEASES},
)
