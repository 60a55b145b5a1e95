"""Our Llama-3.2-Vision equals transformers' `MllamaForConditionalGeneration` on tiny random
checkpoints in the published layout (logits in float32, greedy tokens), and our processor's ids,
pixels, aspect ratios and cross-attention mask equal `MllamaProcessor`'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lvx_models.mllama.loader import load_mllama
from lvx_models.mllama.processor import chat_prompt
from lvx_models.mllama.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-5


@pytest.fixture(scope="module", params=[4, 1], ids=["4-tiles", "1-tile"])
def pair(request, tmp_path_factory):
    """(lvx's model and processor, transformers' model and processor) of one tiny checkpoint."""
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("mllama"), max_tiles=request.param)
    ours = load_mllama(d, torch.float32)
    hf, info = transformers.MllamaForConditionalGeneration.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    hf_proc = transformers.MllamaProcessor.from_pretrained(d)
    return ours, hf.eval(), hf_proc


def _images(seed: int, sizes) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


PROMPTS = {
    "one image": lambda: (chat_prompt("what is the dog doing", 1), _images(0, [(40, 70)])),
    "video": lambda: (
        chat_prompt("what happens first in the video", 3),
        _images(1, [(30, 50), (30, 50), (30, 50)]),
    ),
    "images between text": lambda: (
        chat_prompt("the first <|image|>and the second picture", 1),
        _images(2, [(60, 25), (28, 28)]),
    ),
}


def _compare_inputs(ours, theirs) -> None:
    assert torch.equal(ours.input_ids, theirs["input_ids"])
    for name in ("aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"):
        assert torch.equal(getattr(ours, name), theirs[name].to(torch.int64)), name
    torch.testing.assert_close(ours.pixel_values, theirs["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_logits_and_greedy_tokens_match_transformers(pair, prompt):
    (model, processor, _), hf, hf_proc = pair
    text, images = PROMPTS[prompt]()
    ours = processor(text, images)
    theirs = hf_proc(text=text, images=[images], add_special_tokens=False, return_tensors="pt")
    _compare_inputs(ours, theirs)
    with torch.no_grad():
        logits = model(ours.input_ids, **ours.model_inputs())
        ref = hf(**theirs).logits
    diff = (logits - ref).abs().max().item()
    assert diff < LOGIT_TOL, f"max |logit diff| {diff:.2e}"
    out = hf.generate(**theirs, max_new_tokens=6, do_sample=False)
    assert (
        model.greedy(ours.input_ids, 6, **ours.model_inputs())
        == out[0, ours.input_ids.shape[1] :].tolist()
    )


def _first_tile_checkpoint(src, dst) -> None:
    """`src` (up to 4 tiles) as a one-tile checkpoint: the aspect-ratio tables keep the padding row
    and the (1, 1) row's first tile, which is what a one-tile frame reads from them."""
    import json

    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    vision = cfg["vision_config"]
    tiles, vision["max_num_tiles"], vision["supported_aspect_ratios"] = (
        vision["max_num_tiles"],
        1,
        [[1, 1]],
    )
    (dst / "config.json").write_text(json.dumps(cfg))
    pre = json.loads((src / "preprocessor_config.json").read_text())
    (dst / "preprocessor_config.json").write_text(json.dumps({**pre, "max_image_tiles": 1}))
    weights = load_file(str(src / "model.safetensors"))
    for name in (
        "vision_model.pre_tile_positional_embedding.embedding.weight",
        "vision_model.post_tile_positional_embedding.embedding.weight",
        "vision_model.gated_positional_embedding.tile_embedding.weight",
    ):
        w = weights[name]
        weights[name] = w[:2, : w.shape[1] // tiles].contiguous()
    save_file(weights, str(dst / "model.safetensors"), {"format": "pt"})


def test_one_tile_frames_of_a_four_tile_checkpoint(tmp_path):
    """lvx's video frames (one tile each, no empty tiles) on a checkpoint of up to 4 tiles equal
    transformers running the same weights as a one-tile model."""
    src = write_tiny_checkpoint(tmp_path / "four")
    (tmp_path / "one").mkdir()
    _first_tile_checkpoint(src, tmp_path / "one")
    model, processor, _ = load_mllama(src, torch.float32)
    hf = transformers.MllamaForConditionalGeneration.from_pretrained(
        tmp_path / "one", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    text, frames = PROMPTS["video"]()
    ours = processor.video(frames, "what happens first in the video")
    theirs = transformers.MllamaProcessor.from_pretrained(tmp_path / "one")(
        text=text, images=[frames], add_special_tokens=False, return_tensors="pt"
    )
    _compare_inputs(ours, theirs)
    with torch.no_grad():
        diff = (model(ours.input_ids, **ours.model_inputs()) - hf(**theirs).logits).abs().max()
    assert diff.item() < LOGIT_TOL, f"max |logit diff| {diff.item():.2e}"


GRADS = (
    "multi_modal_projector.weight",
    "language_model.model.layers.1.cross_attn.k_proj.weight",
    "language_model.model.layers.1.cross_attn_attn_gate",
    "language_model.model.layers.0.self_attn.q_proj.weight",
    "vision_model.patch_embedding.weight",
    "vision_model.global_transformer.layers.0.gate_attn",
)


def test_gradients_match_transformers(pair):
    """The same loss gives the same weight gradients (vision tower, projector, cross and self
    layers): what finetuning needs of the model."""
    (model, processor, _), hf, hf_proc = pair
    text, images = PROMPTS["images between text"]()
    ours = processor(text, images)
    theirs = hf_proc(text=text, images=[images], add_special_tokens=False, return_tensors="pt")
    model.zero_grad()
    hf.zero_grad()
    model(ours.input_ids, **ours.model_inputs()).logsumexp(-1).sum().backward()
    hf(**theirs).logits.logsumexp(-1).sum().backward()
    theirs_params = dict(hf.named_parameters())
    for name in GRADS:  # transformers' names on load (it writes the published ones back)
        hf_name = "model." + name.replace("language_model.model.", "language_model.")
        got = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(got, theirs_params[hf_name].grad, rtol=1e-4, atol=1e-5)
