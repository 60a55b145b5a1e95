"""Loader: generation/projector detection, parts, dtype, hub ids, and one-line errors for broken
checkpoints."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from timing import scaled

from lvx_models.mplug_owl3 import loader
from lvx_models.mplug_owl3.checkpoint import CheckpointError, detect_architecture, detect_gate_form
from lvx_models.mplug_owl3.loader import PartNotLoadedError, inspect_checkpoint, load_model
from lvx_models.mplug_owl3.prompt_rules import published_rules
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

# a hyper layer of the tiny G2 checkpoint (hyper_layers [2, 4])
L1 = "language_model.model.layers.1.self_attn."


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_loader")
    return {g: write_tiny_checkpoint(root / g, g) for g in ("g1-gateproj", "g1", "g2")}


@pytest.fixture
def g2(base, tmp_path):
    d = tmp_path / "g2"
    shutil.copytree(base["g2"], d)
    return d


def edit_weights(d, fn):
    w = load_file(str(d / "model.safetensors"))
    fn(w)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})


def one_line_error(path, *match):
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for m in match:
        assert m in msg, msg
    return msg


# ---- detection
# --------------------------------------------------------------------------------------------------
def test_detect_architecture_rules():
    vkv = "language_model.model.layers.0.self_attn.v_kv_proj.weight"
    gate = "language_model.model.layers.0.self_attn.gate"
    assert detect_architecture([vkv, gate, "vision2text_model.weight"]) == ("g1", "linear")
    assert detect_architecture(
        [vkv, "vision2text_model.0.weight", "vision2text_model.2.weight"]
    ) == ("g2", "mlp")
    assert detect_architecture(
        [vkv, gate, "vision2text_model.0.weight", "vision2text_model.2.weight"]
    ) == ("g1", "mlp")
    proj = [
        "language_model.model.layers.0.self_attn.gate_proj.0.weight",
        "language_model.model.layers.0.self_attn.gate_proj.0.bias",
    ]
    assert detect_architecture([vkv, *proj, "vision2text_model.weight"]) == ("g1", "linear")
    assert detect_gate_form([vkv, *proj]) == "proj" and detect_gate_form([vkv, gate]) == "channel"
    with pytest.raises(CheckpointError, match="both self_attn.gate and self_attn.gate_proj"):
        detect_gate_form([vkv, gate, *proj])


def test_gate_proj_checkpoint_loads_as_240728(base, tmp_path):
    """The official 7B-240728 key layout: gate_proj.0.weight [hd, hd] and .bias [hd] per hyper
    layer."""
    model, cfg, _ = load_model(base["g1-gateproj"])
    assert (cfg.generation, cfg.gate_form, cfg.form) == ("g1", "proj", "g1-gateproj")
    layer = model.language_model.model.layers[0].self_attn
    assert layer.gate_proj[0].weight.shape == (16, 16) and not hasattr(layer, "gate")
    assert layer.gate_proj[0].weight.abs().min() > 0  # random, non-zero
    gp = "language_model.model.layers.0.self_attn.gate_proj."
    d = tmp_path / "bad"
    shutil.copytree(base["g1-gateproj"], d)
    edit_weights(d, lambda w: w.update({gp + "1.weight": torch.zeros(4)}))
    one_line_error(d, "unknown gate key", gp + "1.weight")

    def narrow(w):
        del w[gp + "1.weight"]
        w[gp + "0.weight"] = torch.zeros(8, 16)

    edit_weights(d, narrow)
    one_line_error(d, "wrong shape", gp + "0.weight", "[16, 16]")


def test_config_value_of_the_wrong_type_is_named(g2):
    raw = json.loads((g2 / "config.json").read_text())
    raw["hidden_size"] = "sixty"
    (g2 / "config.json").write_text(json.dumps(raw))
    one_line_error(g2, "hidden_size", "'sixty'", "expected an int")
    raw["hidden_size"], raw["vision_config"]["layer_norm_eps"] = 64, "small"
    (g2 / "config.json").write_text(json.dumps(raw))
    one_line_error(g2, "vision_config.layer_norm_eps", "'small'", "expected a float")
    raw["vision_config"]["layer_norm_eps"], raw["hyper_layers"] = 1e-6, [2, "4"]
    (g2 / "config.json").write_text(json.dumps(raw))
    one_line_error(g2, "hyper_layers", "list of ints")


def test_parts_and_dtype(base, monkeypatch):
    read = []
    real = loader.load_tensors
    monkeypatch.setattr(
        loader, "load_tensors", lambda info, keys, **kw: read.extend(keys) or real(info, keys, **kw)
    )
    model, cfg, _ = load_model(base["g2"], parts=("lm",), dtype=torch.bfloat16)
    assert read and all(k.startswith("language_model.") for k in read)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with pytest.raises(PartNotLoadedError, match="'vision' part"):
        model.encode_images(torch.zeros(1, 3, 28, 28))
    with pytest.raises(ValueError):
        load_model(base["g2"], parts=("text",))


@pytest.mark.slow
def test_loading_skips_initialisation_and_never_imports_dynamo(base):
    """The skeleton is not initialised (that alone imported torch._dynamo: over a second of every
    rank's start), the weights are the checkpoint's, and nn.init works as before afterwards."""
    code = (
        "import sys, torch\n"
        "from safetensors.torch import load_file\n"
        "from lvx_models.mplug_owl3.loader import load_model\n"
        f"model = load_model({str(base['g2'])!r}).model\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
        f"stored = load_file({str(base['g2'] / 'model.safetensors')!r})\n"
        "w = model.vision_model.embeddings.position_embedding.weight\n"
        "assert torch.equal(w, stored['vision_model.embeddings.position_embedding.weight'])\n"
        "assert torch.nn.Embedding(4, 3).weight.std() > 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=scaled(120))


def test_unused_vision_keys_are_optional_and_tied_head_ignored(base, tmp_path):
    d = tmp_path / "g1"
    shutil.copytree(base["g1"], d)
    emb = "language_model.model.embed_tokens.weight"

    def strip(w):
        for k in [
            k
            for k in w
            if k.startswith(
                (
                    "vision_model.head.",
                    "vision_model.post_layernorm.",
                    "vision_model.encoder.layers.2.",
                )
            )
        ]:
            del w[k]
        # stored although tied: ignored
        w["language_model.lm_head.weight"] = torch.zeros_like(w[emb])

    edit_weights(d, strip)
    info = inspect_checkpoint(d)
    assert "language_model.lm_head.weight" in info.ignored_keys
    model, cfg, _ = load_model(d)
    assert cfg.tie_word_embeddings and cfg.generation == "g1"


def test_cut_template_read_from_the_checkpoint(base, tmp_path):
    d = tmp_path / "g1-gateproj"
    shutil.copytree(base["g1-gateproj"], d)  # a 240728-form checkpoint: v2_global by default
    (d / "image_processing_mplugowl3.py").write_text(
        'class CutMixin:\n    def __init__(self, cut_cfg={"anchors": "grid_squ_6", '
        '"anchor_strategy": "docowl", '
        '"cut_prompt": "v3", "add_global": True, "cut_prob": 1.0}):\n        pass\n'
    )
    info = inspect_checkpoint(d)
    assert info.prompt_rules.cut_template == "v3_global"
    assert info.notes == [
        "cut prompt: v3_global (image_processing_mplugowl3.py), not the 7B-240728 default"
    ]
    _, _, proc = load_model(d)
    assert proc.cut_template == "v3_global" and proc.rules == info.prompt_rules


def test_prompt_rules_follow_the_weights_form(base):
    for form in ("g1-gateproj", "g1", "g2"):
        info = inspect_checkpoint(base[form])
        assert info.prompt_rules == published_rules(form) and info.notes == []
        _, _, proc = load_model(base[form], parts=("lm",))
        assert proc.rules == info.prompt_rules and proc.form == form


# ---- hub ids
# --------------------------------------------------------------------------------------------------
def test_hub_id_offline_says_pass_a_local_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    msg = one_line_error(
        "mPLUG/not-a-cached-model-xyz", "HF_HUB_OFFLINE", "local checkpoint directory"
    )
    assert "mPLUG/not-a-cached-model-xyz" in msg


def test_hub_id_resolves_through_snapshot_download(monkeypatch, base):
    import huggingface_hub

    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(base["g2"])

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    _, cfg, proc = load_model("mPLUG/mPLUG-Owl3-7B-241101", revision="abc")
    assert cfg.generation == "g2" and proc.path == base["g2"]
    assert calls[0][0] == "mPLUG/mPLUG-Owl3-7B-241101" and calls[0][1]["revision"] == "abc"
    assert "*.safetensors" in calls[0][1]["allow_patterns"] and not calls[0][1]["local_files_only"]


def test_hub_failure_is_one_line(monkeypatch):
    import huggingface_hub

    def boom(repo_id, **kw):
        raise OSError("connection refused\nsecond line")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)
    one_line_error("someone/some-model", "downloading it", "connection refused", "local directory")


# ---- broken checkpoints: one line each, naming the problem
# --------------------------------------------------------------------------------------------------
def test_not_a_checkpoint(tmp_path, g2):
    one_line_error(tmp_path / "missing-dir.d/x/y", "no such directory")
    (tmp_path / "empty").mkdir()
    one_line_error(tmp_path / "empty", "not an mPLUG-Owl3 checkpoint", "config.json")
    (g2 / "model.safetensors").unlink()
    one_line_error(g2, "no model.safetensors")
    one_line_error(g2 / "config.json", "is a file")


def test_wrong_model_type(g2):
    raw = json.loads((g2 / "config.json").read_text())
    raw["model_type"] = "qwen2"
    (g2 / "config.json").write_text(json.dumps(raw))
    one_line_error(g2, "model_type", "qwen2")


def test_missing_key(g2):
    edit_weights(g2, lambda w: w.pop(f"{L1}q_proj.bias"))
    one_line_error(g2, "missing key", f"{L1}q_proj.bias")


def test_unknown_gate_key_refused(g2):
    edit_weights(g2, lambda w: w.update({f"{L1}gate_proj.weight": torch.zeros(4, 16)}))
    one_line_error(g2, "unknown gate key", f"{L1}gate_proj.weight")


def test_unknown_hyper_key_refused(g2):
    edit_weights(g2, lambda w: w.update({f"{L1}v_kv_proj.scale": torch.zeros(4)}))
    one_line_error(g2, "unknown hyper-attention key", f"{L1}v_kv_proj.scale")


def test_hyper_key_on_a_layer_config_does_not_list(g2):
    k = "language_model.model.layers.0.self_attn.v_kv_proj.weight"
    edit_weights(g2, lambda w: w.update({k: torch.zeros(64, 64)}))
    one_line_error(g2, "hyper key", k, "hyper_layers")


def test_unexpected_key(g2):
    edit_weights(
        g2, lambda w: w.update({"language_model.model.extra_norm.weight": torch.zeros(64)})
    )
    one_line_error(g2, "unexpected key", "language_model.model.extra_norm.weight")


def test_wrong_shape(g2):
    k = f"{L1}v_kv_proj.weight"
    edit_weights(g2, lambda w: w.update({k: torch.zeros(32, 64)}))
    one_line_error(g2, "wrong shape", k, "[32, 64]", "[64, 64]")


def test_tokenizer_disagreeing_with_config(g2):
    raw = json.loads((g2 / "config.json").read_text())
    raw["eos_token_id"] = 5
    (g2 / "config.json").write_text(json.dumps(raw))
    one_line_error(g2, "eos_token_id", "<|im_end|>")
    raw["eos_token_id"] = raw["bos_token_id"] + 2
    raw["vocab_size"] = 100
    (g2 / "config.json").write_text(json.dumps(raw))
    one_line_error(g2, "vocab_size")


def test_missing_hyper_layers_in_config(g2):
    raw = json.loads((g2 / "config.json").read_text())
    del raw["hyper_layers"]
    (g2 / "config.json").write_text(json.dumps(raw))
    one_line_error(g2, "hyper_layers")


def test_missing_shard(base, tmp_path):
    d = write_tiny_checkpoint(tmp_path / "sh", "g1", shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    one_line_error(d, "model-00002-of-00002.safetensors", "missing")
