"""Our Qwen2 decoder and SigLIP tower equal the `transformers` implementations on tiny random
configs with the same weights, and `Owl3Model.state_dict()` has exactly the official checkpoint key
names (reference §3)."""

from __future__ import annotations

import pytest
import torch

from lvx_models.mplug_owl3.config import Owl3Config, SiglipVisionConfig
from lvx_models.mplug_owl3.modeling import Owl3Model
from lvx_models.mplug_owl3.qwen2 import Qwen2LM
from lvx_models.mplug_owl3.vision import SiglipVisionTower
from lvx_models.steps import AttentionHooks

transformers = pytest.importorskip("transformers")


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights with norm scales near 1 (so no layer is an identity or a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.copy_(
                1 + 0.3 * r
                if "norm" in name and name.endswith("weight")
                else r * (0.15 if p.dim() > 1 else 0.3)
            )


# transformers computes RoPE angles and the softmax in float32 whatever the model dtype, so parity
# is checked in float32 (the model's own float64 exactness is tested against the naive reference in
# test_hyper_attention.py).
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_matches_transformers(tied):
    dtype = torch.float32
    hf_cfg = transformers.Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    hf = transformers.Qwen2ForCausalLM(hf_cfg).to(dtype).eval()
    _randomize(hf, 0)
    cfg = Owl3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        hyper_layers=[],
        tie_word_embeddings=tied,
    )
    ours = Qwen2LM(cfg).to(dtype).eval()
    sd = hf.state_dict()
    if tied:
        assert "lm_head.weight" not in ours.state_dict()
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    ours.load_state_dict(sd, strict=True)

    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        hooks = AttentionHooks()
        got = ours(ids, ours.resolve_positions(ids, None, None), hooks=hooks)
        torch.testing.assert_close(got, want, **TOL)
        # the same through a text KV cache: prefill 7, then 4 single tokens
        from lvx_models.steps import TextKVCache

        cache = TextKVCache(cfg.num_hidden_layers)
        parts = [ids[:, :7]] + [ids[:, i : i + 1] for i in range(7, 11)]
        steps = [
            ours(p, ours.resolve_positions(p, None, cache), hooks=hooks, cache=cache) for p in parts
        ]
        torch.testing.assert_close(torch.cat(steps, 1), want, **TOL)


def test_siglip_tower_matches_transformers_hidden_states_minus_2():
    # 44 px / patch 14 -> 3x3 grid, 2 px dropped at right/bottom (like 384 with patch 14)
    hf_cfg = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=44,
        patch_size=14,
        attn_implementation="eager",
    )
    hf = transformers.SiglipVisionModel(hf_cfg).eval()
    _randomize(hf, 2)
    ours = SiglipVisionTower(
        SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=2,
            image_size=44,
            patch_size=14,
        )
    )
    sd = {k.removeprefix("vision_model."): v for k, v in hf.state_dict().items()}
    unused = ("encoder.layers.2.", "post_layernorm.", "head.")
    ours.load_state_dict({k: v for k, v in sd.items() if not k.startswith(unused)}, strict=True)
    px = torch.rand(3, 3, 44, 44) * 2 - 1
    with torch.no_grad():
        want = hf(pixel_values=px, output_hidden_states=True).hidden_states[-2]
        got = ours(px)
    assert got.shape == (3, 9, 32)
    torch.testing.assert_close(got, want, **TOL)


def _official_keys(cfg: Owl3Config) -> set[str]:
    """Reference §3, written out independently of the model code (unused vision keys excluded)."""
    keys = {
        "vision_model.embeddings.patch_embedding.weight",
        "vision_model.embeddings.patch_embedding.bias",
        "vision_model.embeddings.position_embedding.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
    }
    for k in range(cfg.vision.num_hidden_layers - 1):
        p = f"vision_model.encoder.layers.{k}."
        for m in (
            "layer_norm1",
            "layer_norm2",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
            "mlp.fc1",
            "mlp.fc2",
        ):
            keys |= {p + m + ".weight", p + m + ".bias"}
    if cfg.projector == "linear":
        keys |= {"vision2text_model.weight", "vision2text_model.bias"}
    else:
        keys |= {f"vision2text_model.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}
    for l in range(cfg.num_hidden_layers):
        p = f"language_model.model.layers.{l}."
        keys |= {
            p + "input_layernorm.weight",
            p + "post_attention_layernorm.weight",
            p + "self_attn.o_proj.weight",
        }
        keys |= {p + f"self_attn.{m}_proj.{w}" for m in "qkv" for w in ("weight", "bias")}
        keys |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        if l + 1 in cfg.hyper_layers:
            keys |= {p + "self_attn.v_kv_proj.weight", p + "self_attn.v_kv_proj.bias"}
            if (
                cfg.generation == "g1" and cfg.gate_form == "proj"
            ):  # 7B-240728: Sequential(Linear, Sigmoid)
                keys |= {p + "self_attn.gate_proj.0.weight", p + "self_attn.gate_proj.0.bias"}
            elif cfg.generation == "g1":
                keys.add(p + "self_attn.gate")
    if not cfg.tie_word_embeddings:
        keys.add("language_model.lm_head.weight")
    return keys


@pytest.mark.parametrize(
    "generation,projector,tied,gate_form",
    [
        ("g1", "linear", True, "channel"),
        ("g2", "mlp", False, "channel"),
        ("g1", "linear", False, "channel"),
        ("g1", "linear", True, "proj"),
    ],
)
def test_state_dict_has_the_official_keys(generation, projector, tied, gate_form):
    cfg = Owl3Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        hyper_layers=[1, 4],
        tie_word_embeddings=tied,
        vision=SiglipVisionConfig(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=2,
            image_size=28,
        ),
        generation=generation,
        projector=projector,
        gate_form=gate_form,
    )
    sd = Owl3Model(cfg).state_dict()
    assert set(sd) == _official_keys(cfg)
    h, nkv, hd = 32, 2, 8
    assert sd["language_model.model.layers.3.self_attn.v_kv_proj.weight"].shape == (2 * nkv * hd, h)
    assert sd["vision_model.embeddings.position_embedding.weight"].shape == (4, 16)
    if generation == "g1" and gate_form == "proj":
        assert sd["language_model.model.layers.0.self_attn.gate_proj.0.weight"].shape == (hd, hd)
        assert sd["language_model.model.layers.0.self_attn.gate_proj.0.bias"].shape == (hd,)
    elif generation == "g1":
        assert sd["language_model.model.layers.0.self_attn.gate"].shape == (h,)


@pytest.mark.parametrize("form", ["g1-gateproj", "g2"])
def test_loaded_tower_and_projector_match_transformers(tiny_checkpoints, form):
    """The tiny official checkpoint through lvx's loader against `transformers.SiglipVisionModel`
    holding every `vision_model.*` tensor of the same file (the unused last layer, post_layernorm
    and head included), built as `scripts/bench_vision.py` builds it: the tower equals
    `hidden_states[-2]`, and `encode_images` (any batch size) the same projector after it."""
    from safetensors.torch import load_file

    from lvx_models.mplug_owl3.loader import load_model
    from scripts.bench_vision import siglip_model

    model, cfg, _ = load_model(tiny_checkpoints[form], parts=("vision", "projector"))
    tensors = {
        k: v.float() for k, v in load_file(f"{tiny_checkpoints[form]}/model.safetensors").items()
    }
    hf = siglip_model(cfg, tensors)
    s = cfg.vision.image_size
    px = torch.rand(5, 3, s, s, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        want = hf(pixel_values=px, output_hidden_states=True).hidden_states[-2]
        torch.testing.assert_close(model.vision_model(px), want, **TOL)
        features = model.vision2text_model(want)
    assert features.shape == (5, cfg.tokens_per_image, cfg.hidden_size)
    for batch_size in (None, 2):
        torch.testing.assert_close(model.encode_images(px, batch_size), features, **TOL)


def test_bench_vision_compares_equal_outputs(tmp_path):
    """The benchmark's contenders compute the same features (it checks before timing) and it writes
    one row per contender with the ratio against transformers on the used layers."""
    import json

    from scripts.bench_vision import REFERENCE, main

    out = tmp_path / "vision.json"
    assert (
        main(["--tiny-frames", "40", "--real-frames", "0", "--repeats", "1", "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    names = ["lvx", "lvx, ingest chunks", "transformers", REFERENCE]
    assert [r["impl"] for r in rows] == names and all(r["frames"] == 40 for r in rows)
    assert all(r["max_abs_diff_vs_reference"] < 1e-4 for r in rows)
    assert next(r for r in rows if r["impl"] == REFERENCE)["reference_over_this"] == 1.0


def test_tower_at_onednn_sizes_matches_transformers(monkeypatch):
    """Where the tower's linears are oneDNN calls with the GELU and residual adds fused (hidden 256,
    256 patches, 2 frames), the features still equal transformers' within float tolerance: every
    row of the benchmark's comparison, through the same key mapping."""
    import dataclasses

    from test_vision import CountingOneDNN

    from lvx_models.mplug_owl3 import vision
    from lvx_models.mplug_owl3.tiny import tiny_config
    from scripts.bench_vision import REFERENCE, contenders, random_visual_weights

    if vision._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN")
    counting = CountingOneDNN(vision._ONEDNN_LINEAR)
    monkeypatch.setattr(vision, "_ONEDNN_LINEAR", counting)
    v = SiglipVisionConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        image_size=224, patch_size=14,
    )  # fmt: skip
    cfg = dataclasses.replace(tiny_config("g2"), vision=v)
    # weights large enough that every layer changes the residual stream
    weights = {
        k: t * 5 if t.dim() == 2 and "position" not in k else t
        for k, t in random_visual_weights(cfg).items()
    }
    fns = contenders(cfg, weights, chunked=False)
    px = torch.rand(2, 3, 224, 224, generator=torch.Generator().manual_seed(4)) * 2 - 1
    want = fns[REFERENCE](px)
    got = fns["lvx"](px)
    assert counting.calls.count("add") == 2 * v.num_used_layers
    assert counting.calls.count("gelu") == v.num_used_layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fns["transformers"](px), want, **TOL)
