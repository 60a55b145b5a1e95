"""Every registered family against the surface written down (`lvx_models.surface`): a tiny
checkpoint of each generation, as `lvx demo` writes it, loads into a model, config and processor
that conform to `VideoModel`, `ModelConfig` and `Processor` (methods present with compatible
signatures), its processor makes `Prompt` records, and a family that saves weights has a
`Finetunable` model."""

from __future__ import annotations

import pytest
import torch

from lvx_models.api import FAMILIES, VIDEO, ModelConfig, Processor, Prompt, VideoModel
from lvx_models.surface import Finetunable, protocol_gaps

CASES = [(f, g.name) for f in FAMILIES.values() for g in f.generations]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f.name}-{g}" for f, g in CASES])
def loaded(request, tmp_path_factory):
    family, generation = request.param
    folder = family.write_tiny(tmp_path_factory.mktemp(family.name), generation)
    return family, family.load(folder, dtype=torch.float32), folder


def test_the_model_config_and_processor_conform(loaded):
    family, (model, config, processor), folder = loaded
    gaps = protocol_gaps(model, VideoModel) + protocol_gaps(config, ModelConfig)
    gaps += protocol_gaps(processor, Processor)
    if family.save_weights is not None:
        gaps += protocol_gaps(model, Finetunable)
    assert not gaps, "\n".join(gaps)
    assert isinstance(config, family.config_type)
    assert isinstance(family.read_config(family.inspect(folder).path), family.config_type)
    assert set(family.parameter_counts(config)) == {"vision", "projector", "language", "embedding"}


def test_the_processor_makes_prompt_records(loaded):
    _, (model, config, processor), _ = loaded
    chat = processor.build_chat_prompt([{"role": "user", "content": f"{VIDEO}\nWhat?"}], videos=[3])
    follow = processor.build_followup("And then?", offset=chat.input_ids.numel() + 1)
    more = processor.build_continuation(
        [{"role": "user", "content": "Why?"}], offset=follow.offset + follow.input_ids.numel()
    )
    training, spans = processor.training_prompt(
        [{"role": "user", "content": f"{VIDEO}\nWhat?"}, {"role": "assistant", "content": "A."}],
        videos=[3],
    )
    for prompt in (chat, follow, more, training):
        assert type(prompt) is Prompt and prompt.input_ids.dtype == torch.int64
    assert chat.num_placeholders == 3 and follow.num_placeholders == 0 and spans
    assert processor.stop_ids and isinstance(processor.stream().push(processor.stop_ids[0]), str)


def test_the_model_runs_as_the_surface_says(loaded):
    _, (model, config, processor), _ = loaded
    chat = processor.build_chat_prompt([{"role": "user", "content": f"{VIDEO}\nWhat?"}], videos=[2])
    frames = torch.randint(0, 256, (2, 40, 30, 3), dtype=torch.uint8)
    e = model.encode_images(processor.frame_prep.pixel_values(frames))
    assert e.shape[:2] == (2, config.visual_tokens_per_frame)
    visual = model.prepare_visual(e, torch.tensor(chat.media_starts))
    assert sorted(visual.kv) == config.cross_layer_indices
    logits = model(chat.input_ids[None], cache=model.new_cache(), visual=visual, last_only=True)
    assert logits.shape == (1, 1, config.vocab_size)


class _Model:
    """A model with every method but one signature wrong and one method missing."""

    config = hooks = None

    def encode_images(self, pixels, batch_size=None): ...

    def encode_frames(self, pixel_values, batch_size=None): ...

    def visual_kv(self, layer_idx, e_local, frame_positions=None): ...

    def visible_frames(self, positions, media_starts): ...

    def prepare_visual(self, e_local, media_starts, frame_ids=None, *, precompute=True): ...

    def fuse_projections(self): ...

    def forward(self, input_ids, positions=None, cache=None, visual=None, last_only=False,
                feed=None, hooks=None, extra=None): ...  # fmt: skip

    def decode_step(self, input_ids, positions, hooks, cache, visual_step, feed=None): ...


def test_the_check_sees_a_missing_method_and_a_wrong_signature():
    assert protocol_gaps(_Model(), VideoModel) == [
        *(
            f"_Model.decode_step: {n!r} is positional or keyword, not keyword-only"
            for n in ("hooks", "cache", "visual_step", "feed")
        ),
        "_Model.encode_images lacks parameter 'pixel_values'",
        "_Model.encode_images: extra parameter 'pixels' has no default",
        "_Model lacks new_cache",
    ]
