"""Mllama's checkpoint layout, loader and tiny checkpoint: the 11B and 90B key names and shapes
from their configs, a folder that is not the layout refused in one line, the tiny checkpoint in
the published layout (transformers reads it with no key missing: test_mllama_parity.py), and the
processor's chat prompt against the template the checkpoint ships."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lvx_models.mllama.checkpoint import CheckpointError, published_shapes
from lvx_models.mllama.config import MllamaConfig
from lvx_models.mllama.loader import load_mllama
from lvx_models.mllama.processor import chat_prompt
from lvx_models.mllama.tiny import write_tiny_checkpoint

L = "language_model.model.layers"


def test_11b_layout():
    shapes = published_shapes(MllamaConfig())
    assert shapes["language_model.model.embed_tokens.weight"] == (128264, 4096)
    assert shapes["language_model.lm_head.weight"] == (128256, 4096)
    assert shapes["multi_modal_projector.weight"] == (4096, 7680)
    assert shapes[f"{L}.3.cross_attn.k_proj.weight"] == (1024, 4096)
    assert shapes[f"{L}.3.cross_attn.q_norm.weight"] == (128,)
    assert shapes[f"{L}.3.cross_attn_attn_gate"] == (1,)
    assert f"{L}.3.self_attn.q_proj.weight" not in shapes  # a cross layer has no self-attention
    assert shapes["vision_model.gated_positional_embedding.tile_embedding.weight"] == (
        9,
        4 * 1601 * 1280,
    )
    assert shapes["vision_model.global_transformer.layers.7.gate_ffn"] == (1,)
    assert shapes["vision_model.patch_embedding.weight"] == (1280, 3, 14, 14)
    assert sum(k.endswith("cross_attn.o_proj.weight") for k in shapes) == 8


def test_90b_layout():
    cfg = MllamaConfig()
    cfg.text.hidden_size, cfg.text.num_hidden_layers = 8192, 100
    cfg.text.num_attention_heads, cfg.text.intermediate_size = 64, 28672
    cfg.text.cross_attention_layers = list(range(3, 100, 5))
    shapes = published_shapes(cfg)
    assert sum(k.endswith("cross_attn.o_proj.weight") for k in shapes) == 20
    assert shapes[f"{L}.98.cross_attn.k_proj.weight"] == (1024, 8192)
    assert shapes["multi_modal_projector.weight"] == (8192, 7680)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mllama"))


def _broken(tmp_path, tiny, change) -> None:
    for f in tiny.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tiny / "model.safetensors"))
    change(weights)
    save_file(weights, str(tmp_path / "model.safetensors"))


def test_tiny_checkpoint_holds_every_published_key(tiny):
    cfg = MllamaConfig.from_json(tiny / "config.json")
    weights = load_file(str(tiny / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == published_shapes(cfg)
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert (
        json.loads((tiny / "config.json").read_text())["text_config"]["rope_scaling"]["rope_type"]
        == "llama3"
    )


@pytest.mark.parametrize(
    "change,says",
    [
        (lambda w: w.pop("multi_modal_projector.bias"), "lacks 1 keys"),
        (lambda w: w.update(extra=torch.zeros(1)), "keys the layout lacks"),
        (
            lambda w: w.update({"multi_modal_projector.bias": torch.zeros(3)}),
            r"multi_modal_projector.bias is \(3,\)",
        ),
    ],
    ids=["missing", "unknown", "misshapen"],
)
def test_a_folder_off_the_layout_is_refused_in_one_line(tmp_path, tiny, change, says):
    _broken(tmp_path, tiny, change)
    with pytest.raises(CheckpointError, match=says) as err:
        load_mllama(tmp_path)
    assert "\n" not in str(err.value)


def test_no_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_mllama(tmp_path)


def test_chat_prompt_is_the_shipped_template(tiny):
    jinja2 = pytest.importorskip("jinja2")
    template = json.loads((tiny / "chat_template.json").read_text())["chat_template"]
    content = [{"type": "image"}] * 3 + [{"type": "text", "text": "what happens?"}]
    rendered = jinja2.Template(template).render(
        messages=[{"role": "user", "content": content}],
        bos_token="<|begin_of_text|>",
        add_generation_prompt=True,
    )
    assert chat_prompt("what happens?", 3) == rendered


def test_video_frames_are_one_tile_each_padded_with_empty_tiles(tiny):
    """A frame is one real tile, padded to the checkpoint's 4 tiles as the published processor
    pads a one-tile image; the text sees the real tile only."""
    import numpy as np

    model, processor, cfg = load_mllama(tiny, torch.float32)
    frames = [np.full((30, 90, 3), i * 40, np.uint8) for i in range(5)]
    inputs = processor.video(frames, "what happens?")
    assert inputs.pixel_values.shape == (1, 5, 4, 3, 28, 28)
    assert inputs.pixel_values[:, :, 1:].eq(0).all()
    assert inputs.aspect_ratio_mask.tolist() == [[[1, 0, 0, 0]] * 5]
    assert inputs.cross_attention_mask[..., 1:].eq(0).all()
    assert inputs.input_ids[0].tolist().count(cfg.image_token_index) == 5
    assert inputs.aspect_ratio_ids.tolist() == [[1] * 5]
    # every token after the frames sees all of them; the header before them sees none
    seen = inputs.cross_attention_mask[0, :, :, 0].sum(dim=1)
    first = inputs.input_ids[0].tolist().index(cfg.image_token_index)
    assert seen[:first].eq(0).all() and seen[first + 4 :].eq(5).all()
    with torch.no_grad():
        assert model.greedy(inputs.input_ids, 3, **inputs.model_inputs())


def test_wrong_image_count_is_one_line(tiny):
    _, processor, _ = load_mllama(tiny, torch.float32)
    with pytest.raises(ValueError, match="give one image per <|image|>"):
        processor(chat_prompt("hi", 2), [])


@pytest.mark.slow
def test_a_folder_saved_by_transformers_loads_and_answers(tiny, tmp_path):
    """transformers 5's `save_pretrained` writes processor_config.json (the image processor
    nested in it) and chat_template.jinja, and no preprocessor_config.json: lvx opens the folder
    and answers as it answers on the published layout."""
    from videos import make_video

    import lvx_app as lvx

    transformers = pytest.importorskip("transformers")
    saved = tmp_path / "saved"
    model = transformers.MllamaForConditionalGeneration.from_pretrained(tiny, dtype=torch.bfloat16)
    model.save_pretrained(saved)
    transformers.MllamaProcessor.from_pretrained(tiny).save_pretrained(saved)
    assert (saved / "processor_config.json").exists() and (saved / "chat_template.jinja").exists()
    assert not (saved / "preprocessor_config.json").exists()
    video = str(make_video(tmp_path / "v.mp4", 3, fps=1, width=40, height=30))
    options = dict(gpus=0, ranks=1, cache=False, decode_workers=1, subtitles="none")
    answers = []
    for folder in (tiny, saved):
        with lvx.open(str(folder), max_new_tokens=4, **options) as engine:
            engine.load_video(video, fps=1)
            answers.append(("".join(engine.ask("what happens?")), engine.last_answer.tokens))
    assert answers[1] == answers[0] and answers[0][1]
