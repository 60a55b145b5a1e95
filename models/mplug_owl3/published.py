"""The released mPLUG-Owl3 checkpoints: their config values and weight form (reference mplug_owl3.md
§4, §10.2), so a checkpoint can be named by what it is, never by its folder name.

`recognize(config)` says which release a loaded config matches: same form (gate and projector), same
language-model and SigLIP sizes, same hyper layers. A finetune of a release keeps its shapes and is
recognised as that release; a tiny or custom model matches none. `scripts/plan_gpu.py` plans memory
and time from these configs.
"""

from __future__ import annotations

from .config import Owl3Config, SiglipVisionConfig, split_form

# the release each checkpoint form was published as (`config.FORMS` labels)
RELEASE_OF_FORM = {"g1-gateproj": "7B-240728", "g1": "1B/2B-241014", "g2": "7B-241101"}


def _release(
    form: str,
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    tied: bool,
    hyper: list[int],
    image_size: int,
) -> Owl3Config:
    generation, gate_form = split_form(form)
    return Owl3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        hyper_layers=hyper,
        vision=SiglipVisionConfig(image_size=image_size),
        generation=generation,
        projector="mlp" if generation == "g2" else "linear",
        gate_form=gate_form,
    )


RELEASES: dict[str, Owl3Config] = {
    "mPLUG-Owl3-1B-241014": _release(
        "g1", vocab=151851, hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2,
        tied=True, hyper=[6, 13, 20, 22], image_size=384,
    ),
    "mPLUG-Owl3-2B-241014": _release(
        "g1", vocab=151851, hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2,
        tied=True, hyper=[7, 15, 23, 26], image_size=384,
    ),
    "mPLUG-Owl3-7B-240728": _release(
        "g1-gateproj", vocab=151851, hidden=3584, intermediate=18944, layers=28, heads=28,
        kv_heads=4, tied=False, hyper=[1, 9, 17, 25], image_size=384,
    ),
    "mPLUG-Owl3-7B-241101": _release(
        "g2", vocab=151651, hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
        tied=False, hyper=[7, 15, 23, 26], image_size=378,
    ),
}  # fmt: skip


def _signature(cfg: Owl3Config) -> tuple:
    """What decides the weights' shapes and the model's behaviour (dtype and token ids do not)."""
    v = cfg.vision
    return (
        cfg.form,
        cfg.projector,
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.tie_word_embeddings,
        tuple(sorted(cfg.hyper_layers)),
        cfg.rope_theta,
        (v.hidden_size, v.image_size, v.intermediate_size, v.num_attention_heads),
        (v.num_hidden_layers, v.patch_size),
    )


def recognize(config: Owl3Config) -> str | None:
    """The name of the release whose config and weight form `config` matches, or None."""
    want = _signature(config)
    return next((name for name, cfg in RELEASES.items() if _signature(cfg) == want), None)
