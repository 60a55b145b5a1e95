"""Tiny checkpoints: the official file layout for both generations, loaded back through the public
loader, and a forward + short generation on them."""

import json
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_configs import engine_config
from safetensors import safe_open
from test_generation_cache import generate

from lvx_app.runtime.open import open_engine
from lvx_models.mplug_owl3.checkpoint import official_shapes
from lvx_models.mplug_owl3.loader import load_model
from lvx_models.mplug_owl3.prompt_rules import (
    IMAGE_PROCESSING_FILE,
    PROCESSING_FILE,
    published_rules,
    read_prompt_rules,
)
from lvx_models.mplug_owl3.tiny import MARKERS, SPECIALS, write_tiny_checkpoint

# config.json of mPLUG/mPLUG-Owl3-7B-241101 (reference §4): the tiny one must have the same keys and
# nesting
OFFICIAL_TOP_KEYS = {
    "architectures",
    "auto_map",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "max_position_embeddings",
    "max_window_layers",
    "model_type",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_theta",
    "sliding_window",
    "tie_word_embeddings",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "use_sliding_window",
    "vocab_size",
    "hyper_layers",
    "vision_config",
}
OFFICIAL_VISION_KEYS = {
    "hidden_size",
    "image_size",
    "intermediate_size",
    "model_type",
    "num_attention_heads",
    "num_hidden_layers",
    "patch_size",
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_ckpt")
    return {g: write_tiny_checkpoint(root / g, g) for g in ("g1-gateproj", "g1", "g2")}


def file_keys(d: Path) -> dict:
    with safe_open(str(d / "model.safetensors"), framework="pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


@pytest.mark.parametrize("g", ["g1", "g2"])
def test_files_and_config_layout(ckpts, g):
    d = ckpts[g]
    names = {p.name for p in d.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "generation_config.json",
        "processing_mplugowl3.py",
        "image_processing_mplugowl3.py",
    } <= names
    raw = json.loads((d / "config.json").read_text())
    assert set(raw) == OFFICIAL_TOP_KEYS and set(raw["vision_config"]) == OFFICIAL_VISION_KEYS
    assert raw["model_type"] == "mplugowl3" and raw["architectures"] == ["mPLUGOwl3Model"]
    assert all(1 <= x <= raw["num_hidden_layers"] for x in raw["hyper_layers"])  # 1-based


@pytest.mark.parametrize("g", ["g1-gateproj", "g1", "g2"])
def test_processor_files_state_the_release_prompt_rules(ckpts, g):
    """g1's files carry the 241014 rules (video span, cut beside videos, v3_global), read from the
    files themselves, not from the published default."""
    rules = read_prompt_rules(ckpts[g], g)
    assert rules == published_rules(g)
    assert set(rules.sources.values()) == {PROCESSING_FILE, IMAGE_PROCESSING_FILE}
    if g == "g1":
        assert (rules.video_span, rules.cut_beside_video, rules.cut_template) == (
            True,
            True,
            "v3_global",
        )
    assert load_model(ckpts[g], parts=("lm",)).processor.rules == rules


@pytest.mark.parametrize("g", ["g1-gateproj", "g1", "g2"])
def test_every_official_key_is_written(ckpts, g):
    model, cfg, _ = load_model(ckpts[g])
    tensors = file_keys(ckpts[g])
    shapes = official_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    last = cfg.vision.num_hidden_layers - 1
    for k in (
        f"vision_model.encoder.layers.{last}.mlp.fc2.weight",
        "vision_model.post_layernorm.weight",
        "vision_model.head.probe",
        "vision_model.head.attention.in_proj_weight",
    ):
        assert k in tensors  # unused by the model, but the real files hold them
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    gate = [k for k in tensors if k.endswith("self_attn.gate")]
    gate_proj = [k for k in tensors if ".self_attn.gate_proj.0." in k]
    vkv = sorted({int(k.split(".")[3]) for k in tensors if ".v_kv_proj." in k})
    assert vkv == cfg.hyper_layer_indices
    if (
        g == "g1-gateproj"
    ):  # the official 7B-240728 layout: Linear(hd, hd) with bias, no constant gate
        assert not gate and len(gate_proj) == 2 * len(vkv) and "vision2text_model.weight" in tensors
        assert tuple(
            tensors[f"language_model.model.layers.{vkv[0]}.self_attn.gate_proj.0.weight"].shape
        ) == (16, 16)
    elif g == "g1":
        assert not gate_proj
        assert len(gate) == len(vkv) and "vision2text_model.weight" in tensors
        assert "language_model.lm_head.weight" not in tensors and cfg.tie_word_embeddings
    else:
        assert (
            not gate
            and not gate_proj
            and "vision2text_model.2.weight" in tensors
            and "language_model.lm_head.weight" in tensors
        )


@pytest.mark.parametrize("g", ["g1-gateproj", "g1", "g2"])
def test_loads_back_detected_and_equal(ckpts, g):
    model, cfg, proc = load_model(ckpts[g])
    assert cfg.form == g and cfg.generation == g[:2] == proc.generation
    assert cfg.projector == ("linear" if g.startswith("g1") else "mlp")
    assert proc.tokens_per_image == cfg.tokens_per_image == 4
    sd = model.state_dict()
    tensors = file_keys(ckpts[g])
    assert set(sd) == {k for k in official_shapes(cfg, include_unused=False)}
    for k, v in sd.items():
        assert v.dtype == torch.float32 and torch.equal(v, tensors[k].float()), k


@pytest.mark.parametrize("g", ["g1", "g2"])
def test_forward_and_generate(ckpts, g):
    model, cfg, proc = load_model(ckpts[g])
    frames = np.random.default_rng(0).integers(0, 256, (3, 24, 32, 3), dtype=np.uint8)
    pi = proc.build_chat_prompt(
        [{"role": "user", "content": "<|video|>What happens?"}], videos=[frames]
    )
    e = model.encode_images(pi.pixel_values)
    assert e.shape == (3, cfg.tokens_per_image, cfg.hidden_size)
    visual = model.prepare_visual(e, torch.tensor(pi.media_starts))
    logits = model(pi.input_ids[None], visual=visual)
    assert logits.shape == (1, len(pi.input_ids), cfg.vocab_size) and torch.isfinite(logits).all()
    out = generate(
        model, pi.input_ids[None], visual=visual, max_new_tokens=5, stop_ids=proc.stop_ids
    )
    assert 1 <= len(out) <= 5 and all(0 <= t < cfg.vocab_size for t in out)
    assert isinstance(proc.decode(out), str)


def test_tokenizer_is_qwen2_like(ckpts):
    from lvx_models.mplug_owl3.tokenizer import Owl3Tokenizer

    tok = Owl3Tokenizer.from_pretrained(ckpts["g2"])
    n_bpe = tok.tk.get_vocab_size(with_added_tokens=False)
    # after the BPE vocab
    assert [tok.token_to_id(s) for s in SPECIALS] == [n_bpe, n_bpe + 1, n_bpe + 2]
    assert 0 not in tok.special_ids
    for m in MARKERS:  # plain text, as in the real tokenizer
        assert len(tok.encode(m)) > 1 and tok.decode(tok.encode(m)) == m
    text = "Straße → 中文 ☃ 😀 <|im_start|>user\n"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    cfg = json.loads((ckpts["g2"] / "config.json").read_text())
    assert cfg["bos_token_id"] == tok.endoftext_id and cfg["eos_token_id"] == tok.im_end_id
    assert cfg["vocab_size"] > len(tok)


def test_deterministic_and_sharded(tmp_path, ckpts):
    a = write_tiny_checkpoint(tmp_path / "a", "g2", seed=0, shards=3)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert (a / "tokenizer.json").read_text() == (ckpts["g2"] / "tokenizer.json").read_text()
    single = file_keys(ckpts["g2"])
    m, _, _ = load_model(a)
    for k, v in m.state_dict().items():
        assert torch.equal(v, single[k].float())


def test_script(tmp_path):
    from scripts import make_tiny_checkpoint as mod

    paths = mod.main([str(tmp_path / "t")])
    assert [p.name for p in paths] == ["g1", "g2"] and all(
        (p / "model.safetensors").exists() for p in paths
    )
    one = mod.main([str(tmp_path / "p"), "--generation", "g1-gateproj"])
    assert load_model(one[0])[1].form == "g1-gateproj"


def test_transformers_reads_the_tiny_tokenizer_the_same_way(ckpts):
    """The official processor calls the HF Qwen2 tokenizer per chunk; ours must give the same
    ids."""
    transformers = pytest.importorskip("transformers")
    from lvx_models.mplug_owl3.tokenizer import Owl3Tokenizer

    hf = transformers.Qwen2Tokenizer.from_pretrained(str(ckpts["g1"]))
    ours = Owl3Tokenizer.from_pretrained(ckpts["g1"])
    assert (
        hf.eos_token_id == ours.im_end_id
        and hf.pad_token_id == ours.endoftext_id
        and len(hf) == len(ours)
    )
    for text in (
        "<|im_start|>system\n<|im_end|>",
        "\n<|im_start|>user\nWhat happens? é 中文 ☃<|im_end|>",
        "<|image|>",
        "<|start_cut|>2*3\n",
        "  two  spaces\n\n",
        "\n<|im_start|>assistant\n",
    ):
        assert hf(text).input_ids == ours.encode(text), text


@pytest.mark.slow
@pytest.mark.parametrize("g", ["g1-gateproj", "g1", "g2"])
def test_greedy_answers_of_the_random_weights_show_words(tiny_checkpoints, short_video, g):
    """A random-weight demo still shows that text came out: visible words, no control
    character and no half of a UTF-8 character."""
    config = engine_config(tiny_checkpoints[g], gpus=0, max_new_tokens=12)
    with open_engine(config) as engine:
        engine.load_video(short_video)
        answer = "".join(engine.ask("What happens in this video?"))
    assert re.search(r"[A-Za-z]{2,}", answer), repr(answer)
    assert not any(unicodedata.category(c) == "Cc" and c not in "\n\t" for c in answer)
    assert "\ufffd" not in answer
