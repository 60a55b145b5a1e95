"""An OpenFlamingo checkpoint's config, read from its parts' files (its release repo ships no
config.json): the vision tower from `open_clip_config.json` (`model_cfg.vision_cfg`, open_clip's
defaults where a size is left out: heads of 64, an MLP 4x wide, QuickGELU for the `openai`
weights), the text model from MPT's `config.json` (`mosaic_gpt`'s flat names or `mpt`'s
`attn_config`), the perceiver and cross layers at open_flamingo's defaults, and from the weights:
the embedding rows (the tokenizer with its added tokens) and which blocks have a cross layer
(`cross_attn_every_n_layers`); the `<image>` and `<|endofchunk|>` ids from the tokenizer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config_checks import check_fields, read_json_object
from ..safetensors_folder import CheckpointError, tensor_shapes
from ..torch_files import torch_tensors
from .checkpoint import CLIP_CONFIG, FLAMINGO_FILE, Parts, flamingo_keys, lvx_weights
from .config import MptConfig, OpenFlamingoConfig, VisionConfig
from .tokenizer import FlamingoTokenizer

WTE = "lang_encoder.transformer.wte.weight"
_CROSS_BLOCK = re.compile(r"lang_encoder\.transformer\.blocks\.(\d+)\.gated_cross_attn_layer\.")
TEXT_TYPES = ("mosaic_gpt", "mpt")


def vision_config(folder: Path) -> VisionConfig:
    """From `open_clip_config.json`, or open_clip's `ViT-L-14` with QuickGELU (the `openai`
    weights every release names) where the vision repo has none."""
    path = folder / CLIP_CONFIG
    if not path.exists():
        return VisionConfig()
    model = read_json_object(path, "open_clip's model config").get("model_cfg")
    if not isinstance(model, dict) or not isinstance(model.get("vision_cfg"), dict):
        raise CheckpointError(f"{path} has no model_cfg.vision_cfg: not an open_clip config")
    v = model["vision_cfg"]
    check_fields(v, path, "model_cfg.vision_cfg.")
    width = int(v.get("width", 768))
    return VisionConfig(
        image_size=int(v.get("image_size", 224)),
        patch_size=int(v.get("patch_size", 16)),
        width=width,
        layers=int(v.get("layers", 12)),
        heads=width // int(v.get("head_width", 64)),
        mlp_ratio=float(v.get("mlp_ratio", 4.0)),
        output_dim=int(model.get("embed_dim", width)),
        quick_gelu=bool(model.get("quick_gelu", True)),
    )


def text_config(folder: Path, vocab_size: int) -> MptConfig:
    """MPT's config.json (either form) with the embedding rows `checkpoint.pt` holds."""
    path = folder / "config.json"
    d = read_json_object(path, "the text model's config")
    if d.get("model_type") not in TEXT_TYPES:
        raise CheckpointError(
            f"{path}: model_type {d.get('model_type')!r} is not an MPT text model "
            f"({', '.join(TEXT_TYPES)})"
        )
    check_fields(d, path)
    attn = d.get("attn_config") if isinstance(d.get("attn_config"), dict) else {}

    def pick(name: str, flat: str, default: Any) -> Any:
        return attn.get(name, d.get(flat, default))

    defaults = MptConfig()
    return MptConfig(
        d_model=int(d["d_model"]),
        n_heads=int(d["n_heads"]),
        n_layers=int(d["n_layers"]),
        expansion_ratio=int(d.get("expansion_ratio", d.get("mlp_ratio", 4))),
        vocab_size=vocab_size,
        max_seq_len=int(d.get("max_seq_len", 2048)),
        alibi=bool(pick("alibi", "alibi", defaults.alibi)),
        alibi_bias_max=int(pick("alibi_bias_max", "alibi_bias_max", defaults.alibi_bias_max)),
        qk_ln=bool(pick("qk_ln", "attn_qk_ln", False)),
        clip_qkv=pick("clip_qkv", "attn_clip_qkv", None),
        softmax_scale=pick("softmax_scale", "softmax_scale", None),
        no_bias=bool(d.get("no_bias", defaults.no_bias)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
    )


def flamingo_shapes(parts: Parts) -> dict[str, tuple[int, ...]]:
    """The shapes of the trained part's tensors (lvx's own weights, else `checkpoint.pt`'s), under
    the model's names."""
    own = lvx_weights(parts.flamingo)
    if own is not None:
        return tensor_shapes(own)
    state = flamingo_keys(torch_tensors(parts.flamingo / FLAMINGO_FILE))
    return {k: tuple(v.shape) for k, v in state.items()}


def cross_every(shapes: dict[str, tuple[int, ...]], n_layers: int, where: Path) -> int:
    """`cross_attn_every_n_layers`, from the blocks that have a cross layer."""
    blocks = sorted({int(m.group(1)) for k in shapes if (m := _CROSS_BLOCK.match(k))})
    every = blocks[0] + 1 if blocks else 0
    if not every or blocks != [i for i in range(n_layers) if (i + 1) % every == 0]:
        raise CheckpointError(
            f"{where}: the gated cross-attention layers are at blocks {blocks[:6]}, not every "
            f"n-th of the text model's {n_layers}"
        )
    return every


def read_config(parts: Parts, tokenizer: FlamingoTokenizer | None = None) -> OpenFlamingoConfig:
    tokenizer = tokenizer or FlamingoTokenizer.from_pretrained(parts.text)
    shapes = flamingo_shapes(parts)
    where = parts.flamingo / FLAMINGO_FILE
    if len(shapes.get(WTE, ())) != 2:
        raise CheckpointError(f"{where} holds no {WTE}: not an OpenFlamingo checkpoint")
    rows = shapes[WTE][0]
    if rows != len(tokenizer):
        raise CheckpointError(
            f"{where} has {rows} embedding rows but the tokenizer of {parts.text} with "
            f"open_flamingo's added tokens has {len(tokenizer)}: use the text model it was "
            "trained with"
        )
    text = text_config(parts.text, rows)
    return OpenFlamingoConfig(
        vision=vision_config(parts.vision),
        text=text,
        cross_attn_every_n_layers=cross_every(shapes, text.n_layers, where),
        media_token_id=tokenizer.image_id,
        eoc_token_id=tokenizer.eoc_id,
    )


# safetensors header dtypes -> torch
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def dtype_of(parts: Parts) -> torch.dtype:
    """The dtype the trained part is stored in (its embeddings')."""
    own = lvx_weights(parts.flamingo)
    if own is None:
        return flamingo_keys(torch_tensors(parts.flamingo / FLAMINGO_FILE))[WTE].dtype
    with safe_open(str(own[WTE]), "pt") as f:
        name = f.get_slice(WTE).get_dtype()
    if name not in DTYPES:
        raise CheckpointError(f"{WTE} is stored as {name}, a dtype lvx does not write")
    return DTYPES[name]
