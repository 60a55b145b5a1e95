"""Tiny random-weight OpenFlamingo checkpoints in the published layout (`checkpoint`'s module
docstring), the three parts' files side by side in one folder, built in about a second:

- `checkpoint.pt`: what open_flamingo saves and the release repos hold, a plain state dict
  (float32) of the perceiver, the gated cross-attention layers under their `FlamingoLayer` names
  (`lang_encoder.transformer.blocks.{i}.gated_cross_attn_layer.*`) and the input embeddings,
  resized to the tokenizer with open_flamingo's three added tokens;
- `open_clip_config.json` and `open_clip_model.safetensors` (`visual.*`), as open_clip's hub
  repos hold a CLIP model;
- the MPT text model as its repo holds it: `config.json` (`mosaic_gpt`'s flat form for the 3B
  release's MPT-1B, `mpt`'s `attn_config` form for the 9B's MPT-7B), `pytorch_model.bin` (its
  own embeddings padded past the tokenizer, as MPT's 50,432 rows are), the GPT-NeoX-style
  tokenizer files without open_flamingo's tokens (`tiny_tokenizer`) and `generation_config.json`.

Tiny sizes: CLIP width 32, 2 layers of 2 heads, 28-pixel frames of 14-pixel patches (4 patches);
the perceiver and cross layers at open_flamingo's defaults (64 latents a frame, 8 heads of 64);
MPT width 64, 4 heads; the 3B form 4 blocks with QK LayerNorm and a cross layer before each, the
9B form 8 blocks without QK LayerNorm and a cross layer before every 4th.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import CLIP_CONFIG, CLIP_WEIGHTS, FLAMINGO_FILE
from .config import GENERATION, MptConfig, OpenFlamingoConfig, VisionConfig
from .modeling import MOSAIC_GPT_NAMES, OpenFlamingoModel
from .tiny_tokenizer import SPECIALS, write_tiny_tokenizer
from .tokenizer import FlamingoTokenizer

FORMS = ("3B", "9B")  # which release's text model and cross-layer spacing the tiny one copies
CROSS = ".gated_cross_attn_layer."


def tiny_config(tokenizer: FlamingoTokenizer, form: str = "3B") -> OpenFlamingoConfig:
    vision = VisionConfig(image_size=28, patch_size=14, width=32, layers=2, heads=2, output_dim=16)
    nine = form == "9B"
    text = MptConfig(
        d_model=64, n_heads=4, n_layers=8 if nine else 4, vocab_size=len(tokenizer), qk_ln=not nine
    )
    return OpenFlamingoConfig(
        vision=vision,
        text=text,
        cross_attn_every_n_layers=4 if nine else 1,
        media_token_id=tokenizer.image_id,
        eoc_token_id=tokenizer.eoc_id,
    )


def random_weights(cfg: OpenFlamingoConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the model: matrices N(0, 0.05), norms 1 + N(0, 0.1), the cross layers'
    gates N(0, 1) (so the frames matter), embeddings and latents N(0, 0.5)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = OpenFlamingoModel(cfg)
    norms = {n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    out = {}
    for key, t in model.state_dict().items():
        shape, (owner, _, name) = t.shape, key.rpartition(".")
        if owner in norms and name == "weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("_gate"):
            t = torch.randn(shape, generator=g)
        elif "embedding" in key or name in ("latents", "class_embedding") or "wte" in key:
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = 0.05 * torch.randn(shape, generator=g)
        out[key] = t.contiguous()
    return out


def _mpt_name(key: str, form: str) -> str:
    """A text tensor's name in the MPT repo's own weights (`mosaic_gpt`'s part names for 3B)."""
    rest = key.removeprefix("lang_encoder.").replace(".decoder_layer.", ".")
    if form == "3B":
        for mosaic, mpt in MOSAIC_GPT_NAMES.items():
            rest = rest.replace(mpt, mosaic, 1)
    return rest


def _mpt_config(cfg: MptConfig, form: str, padded: int) -> dict:
    common = {
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "n_layers": cfg.n_layers,
        "max_seq_len": cfg.max_seq_len,
        "vocab_size": padded,
        "no_bias": cfg.no_bias,
        "tokenizer_name": "EleutherAI/gpt-neox-20b",
        "torch_dtype": "float32",
    }
    if form == "3B":
        return {
            **common,
            "architectures": ["MosaicGPT"],
            "model_type": "mosaic_gpt",
            "mlp_ratio": cfg.expansion_ratio,
            "alibi": cfg.alibi,
            "alibi_bias_max": cfg.alibi_bias_max,
            "attn_qk_ln": cfg.qk_ln,
            "attn_clip_qkv": None,
            "softmax_scale": None,
            "low_precision_layernorm": True,
        }
    attn = {"alibi": cfg.alibi, "alibi_bias_max": cfg.alibi_bias_max, "qk_ln": cfg.qk_ln}
    return {
        **common,
        "architectures": ["MPTForCausalLM"],
        "model_type": "mpt",
        "expansion_ratio": cfg.expansion_ratio,
        "attn_config": {**attn, "clip_qkv": None, "softmax_scale": None},
        "norm_type": "low_precision_layernorm",
    }


def _clip_config(v: VisionConfig) -> dict:
    vision = {
        "image_size": v.image_size,
        "layers": v.layers,
        "width": v.width,
        "head_width": v.width // v.heads,
        "patch_size": v.patch_size,
    }
    text = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}
    model = {"embed_dim": v.output_dim, "quick_gelu": True, "vision_cfg": vision, "text_cfg": text}
    preprocess = {
        "mean": [0.48145466, 0.4578275, 0.40821073],
        "std": [0.26862954, 0.26130258, 0.27577711],
        "interpolation": "bicubic",
        "resize_mode": "shortest",
    }
    return {"model_cfg": model, "preprocess_cfg": preprocess}


def write_tiny_checkpoint(
    directory: str | Path, generation: str = GENERATION, *, form: str = "3B", seed: int = 0
) -> Path:
    """Write the checkpoint into `directory` (deterministic for a seed) and return it."""
    if generation != GENERATION:
        raise ValueError(f"OpenFlamingo's generation is {GENERATION}, not {generation!r}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}, not {form!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(d, seed)
    tokenizer = FlamingoTokenizer.from_pretrained(d)
    cfg = tiny_config(tokenizer, form)
    weights = random_weights(cfg, seed)
    trained = ("perceiver.", "lang_encoder.transformer.wte.")
    flamingo = OrderedDict(
        (k, v) for k, v in weights.items() if k.startswith(trained) or CROSS in k
    )
    torch.save(flamingo, d / FLAMINGO_FILE)
    visual = {"visual." + k.removeprefix("vision_encoder."): v for k, v in weights.items()
              if k.startswith("vision_encoder.")}  # fmt: skip
    save_file(visual, str(d / CLIP_WEIGHTS), {"format": "pt"})
    (d / CLIP_CONFIG).write_text(json.dumps(_clip_config(cfg.vision), indent=2) + "\n")
    padded = (len(tokenizer) + 63) // 64 * 64  # MPT pads its embeddings past the tokenizer
    text = OrderedDict(
        (_mpt_name(k, form), v)
        for k, v in weights.items()
        if k.startswith("lang_encoder.") and k not in flamingo
    )
    g = torch.Generator().manual_seed(seed + 1)
    text["transformer.wte.weight"] = 0.5 * torch.randn(padded, cfg.text.d_model, generator=g)
    torch.save(text, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(_mpt_config(cfg.text, form, padded), indent=2) + "\n")
    eos = {"eos_token_id": 0, "bos_token_id": 0, "_from_model_config": True}
    gen = {**eos, "max_new_tokens": 32}  # random weights: a short answer shows the pipeline runs
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    assert SPECIALS[0] == "<|endoftext|>"
    return d
