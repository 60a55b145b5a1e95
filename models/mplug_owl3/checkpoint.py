"""Reading an mPLUG-Owl3 checkpoint directory without loading it: where it is, what its keys are,
what they imply.

- Resolves a directory or a hub id (`huggingface_hub.snapshot_download`, only the files we read;
  with HF_HUB_OFFLINE set only the local cache is tried and the error says to pass a local
  directory).
- Reads the safetensors headers (`model.safetensors` or the shards of
  `model.safetensors.index.json`): keys, shapes.
- Detects the architecture from the keys, never from the repo name (reference mplug_owl3.md §0):
  `self_attn.gate_proj.0.*` -> G1 with the input-dependent gate (7B-240728), `self_attn.gate` -> G1
  with the constant per-channel gate (241014), `self_attn.v_kv_proj` without a gate -> G2;
  `vision2text_model.weight` -> linear projector, `vision2text_model.{0,2}.weight` -> MLP projector.
- Holds the official layout (§3) for a config and checks a checkpoint's keys against it.
The processor and the loader both build on this module; it imports neither.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable

from ..safetensors_folder import CheckpointError
from .config import Owl3Config

# --------------------------------------------------------------------------------------------------
# the official layout (reference §3)
# --------------------------------------------------------------------------------------------------
VISION = "vision_model."
PROJECTOR = "vision2text_model."
LM = "language_model."


def unused_vision_prefixes(cfg: Owl3Config) -> tuple[str, ...]:
    """Keys the model never uses: the last SigLIP encoder layer, post_layernorm and the pooling
    head."""
    last = cfg.vision.num_hidden_layers - 1
    return (f"{VISION}encoder.layers.{last}.", f"{VISION}post_layernorm.", f"{VISION}head.")


def is_unused(key: str, cfg: Owl3Config) -> bool:
    return key.startswith(unused_vision_prefixes(cfg))


def _siglip_layer(p: str, d: int, i: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for ln in ("layer_norm1", "layer_norm2"):
        out[f"{p}{ln}.weight"] = (d,)
        out[f"{p}{ln}.bias"] = (d,)
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        out[f"{p}self_attn.{proj}.weight"] = (d, d)
        out[f"{p}self_attn.{proj}.bias"] = (d,)
    out[f"{p}mlp.fc1.weight"] = (i, d)
    out[f"{p}mlp.fc1.bias"] = (i,)
    out[f"{p}mlp.fc2.weight"] = (d, i)
    out[f"{p}mlp.fc2.bias"] = (d,)
    return out


def _vision_shapes(cfg: Owl3Config) -> dict[str, tuple[int, ...]]:
    """SigLIP tower keys, the unused last layer, post_layernorm and pooling head included."""
    v = cfg.vision
    d, i = v.hidden_size, v.intermediate_size
    s: dict[str, tuple[int, ...]] = {
        f"{VISION}embeddings.patch_embedding.weight": (
            d,
            v.num_channels,
            v.patch_size,
            v.patch_size,
        ),
        f"{VISION}embeddings.patch_embedding.bias": (d,),
        f"{VISION}embeddings.position_embedding.weight": (v.num_patches, d),
    }
    for k in range(v.num_hidden_layers):
        s.update(_siglip_layer(f"{VISION}encoder.layers.{k}.", d, i))
    s[f"{VISION}post_layernorm.weight"] = (d,)
    s[f"{VISION}post_layernorm.bias"] = (d,)
    s.update(
        {
            f"{VISION}head.probe": (1, 1, d),
            f"{VISION}head.attention.in_proj_weight": (3 * d, d),
            f"{VISION}head.attention.in_proj_bias": (3 * d,),
            f"{VISION}head.attention.out_proj.weight": (d, d),
            f"{VISION}head.attention.out_proj.bias": (d,),
            f"{VISION}head.layernorm.weight": (d,),
            f"{VISION}head.layernorm.bias": (d,),
            f"{VISION}head.mlp.fc1.weight": (i, d),
            f"{VISION}head.mlp.fc1.bias": (i,),
            f"{VISION}head.mlp.fc2.weight": (d, i),
            f"{VISION}head.mlp.fc2.bias": (d,),
        }
    )
    return s


def _projector_shapes(cfg: Owl3Config) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.vision.hidden_size
    if cfg.projector == "linear":
        return {f"{PROJECTOR}weight": (h, d), f"{PROJECTOR}bias": (h,)}
    return {
        f"{PROJECTOR}0.weight": (h, d),
        f"{PROJECTOR}0.bias": (h,),
        f"{PROJECTOR}2.weight": (h, h),
        f"{PROJECTOR}2.bias": (h,),
    }


def _language_shapes(cfg: Owl3Config) -> dict[str, tuple[int, ...]]:
    """HyperQwen2 keys: every decoder layer, the hyper layers' v_kv_proj (and G1 gate), lm_head
    unless tied."""
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    s: dict[str, tuple[int, ...]] = {}
    m = f"{LM}model."
    s[f"{m}embed_tokens.weight"] = (cfg.vocab_size, h)
    for l in range(cfg.num_hidden_layers):
        p = f"{m}layers.{l}."
        s[f"{p}input_layernorm.weight"] = (h,)
        s[f"{p}post_attention_layernorm.weight"] = (h,)
        s[f"{p}self_attn.q_proj.weight"] = (nh * hd, h)
        s[f"{p}self_attn.q_proj.bias"] = (nh * hd,)
        for kv in ("k_proj", "v_proj"):
            s[f"{p}self_attn.{kv}.weight"] = (nkv * hd, h)
            s[f"{p}self_attn.{kv}.bias"] = (nkv * hd,)
        s[f"{p}self_attn.o_proj.weight"] = (h, nh * hd)
        s[f"{p}mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        s[f"{p}mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        s[f"{p}mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        if cfg.is_hyper(l):
            s[f"{p}self_attn.v_kv_proj.weight"] = (2 * nkv * hd, h)
            s[f"{p}self_attn.v_kv_proj.bias"] = (2 * nkv * hd,)
            if cfg.generation == "g1" and cfg.gate_form == "proj":
                s[f"{p}self_attn.gate_proj.0.weight"] = (hd, hd)
                s[f"{p}self_attn.gate_proj.0.bias"] = (hd,)
            elif cfg.generation == "g1":
                s[f"{p}self_attn.gate"] = (h,)
    s[f"{m}norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        s[f"{LM}lm_head.weight"] = (cfg.vocab_size, h)
    return s


def official_shapes(cfg: Owl3Config, *, include_unused: bool = True) -> dict[str, tuple[int, ...]]:
    """Every key of the official checkpoint for `cfg` (its generation, projector and tying) with its
    shape."""
    s = {**_vision_shapes(cfg), **_projector_shapes(cfg), **_language_shapes(cfg)}
    if not include_unused:
        s = {k: v for k, v in s.items() if not is_unused(k, cfg)}
    return s


# the files any family reads from a hub repo (one list: a hub id is fetched before its family is
# known); the official mPLUG-Owl3 processor *.py are fetched as text, for the prompt rules only,
# never run
HUB_FILES = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "preprocessor_config.json",  # Llama-3.2-Vision's tile size, mean and std
    "processor_config.json",  # the same, where transformers 5 saved the folder
    "processing_mplugowl3.py",
    "image_processing_mplugowl3.py",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_LAYER_KEY = re.compile(r"language_model\.model\.layers\.(\d+)\.(.+)")
_ATTN_KNOWN = {
    f"self_attn.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")
}
_ATTN_KNOWN.add("self_attn.o_proj.weight")
_GATE_PROJ = {"self_attn.gate_proj.0.weight", "self_attn.gate_proj.0.bias"}
_HYPER_KNOWN = {
    "self_attn.v_kv_proj.weight",
    "self_attn.v_kv_proj.bias",
    "self_attn.gate",
    *_GATE_PROJ,
}


# --------------------------------------------------------------------------------------------------
# resolving a directory or a hub id
# --------------------------------------------------------------------------------------------------
def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a hub id downloaded (or found in the HF cache) with
    snapshot_download."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(
                f"{p} is a file: pass the checkpoint directory (the one holding config.json and "
                f"model.safetensors)"
            )
        return p
    s = str(path_or_id)
    if not _HUB_ID.fullmatch(s):
        raise CheckpointError(
            f"{s}: no such directory (and not a Hugging Face hub id of the form owner/name)"
        )
    from huggingface_hub import snapshot_download  # only hub ids need it (and tests patch it there)

    offline = _offline()
    try:
        return Path(
            snapshot_download(
                s, revision=revision, allow_patterns=HUB_FILES, local_files_only=offline
            )
        )
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one actionable line
        if offline:
            raise CheckpointError(
                f"{s} is not a local directory and HF_HUB_OFFLINE is set, so it cannot be "
                f"downloaded (and it is not in the Hugging Face cache): pass the local checkpoint "
                f"directory instead, e.g. --model /path/to/mPLUG-Owl3-7B-241101"
            ) from None
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{s}: no such local directory, and downloading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {why}); check the id and the network, or pass a local directory"
        ) from None


# --------------------------------------------------------------------------------------------------
# reading headers and checking them against the layout
# --------------------------------------------------------------------------------------------------
def _scan_hyper_keys(keys: list[str]) -> tuple[bool, bool, bool]:
    """(has constant gate, has gate_proj, has v_kv_proj); refuses any other attention key of a
    layer."""
    has_gate = has_proj = has_vkv = False
    for k in keys:
        m = _LAYER_KEY.fullmatch(k)
        if not m or not m.group(2).startswith("self_attn."):
            continue
        rest = m.group(2)
        if rest in _ATTN_KNOWN:
            continue
        if rest == "self_attn.gate":
            has_gate = True
        elif rest in _GATE_PROJ:
            has_proj = True
        elif rest.startswith("self_attn.v_kv_proj."):
            has_vkv = True
            if rest not in _HYPER_KNOWN:
                raise CheckpointError(
                    f"unknown hyper-attention key {k} (expected v_kv_proj.weight / .bias)"
                )
        elif "gate" in rest:
            raise CheckpointError(
                f"unknown gate key {k}: this loader knows the G1 gates `self_attn.gate` [hidden] "
                f"and `self_attn.gate_proj.0.weight/.bias` [head_dim]; refusing to guess"
            )
        else:
            raise CheckpointError(
                f"unknown attention key {k} (not in the official mPLUG-Owl3 layout)"
            )
    if has_gate and has_proj:
        raise CheckpointError(
            "the checkpoint has both self_attn.gate and self_attn.gate_proj keys: one G1 gate form "
            "per checkpoint (gate_proj is 7B-240728, gate 241014); check where its weights came "
            "from"
        )
    return has_gate, has_proj, has_vkv


def detect_gate_form(keys: Iterable[str]) -> str:
    """G1 gate form from the keys: "proj" (`self_attn.gate_proj`, 240728) or "channel"
    (`self_attn.gate`, or G2)."""
    return "proj" if _scan_hyper_keys(list(keys))[1] else "channel"


def detect_architecture(keys: Iterable[str]) -> tuple[str, str]:
    """(generation, projector) from the checkpoint keys (reference §0 loader rule); refuses unknown
    hyper keys. The G1 gate form is `detect_gate_form`."""
    keys = list(keys)
    has_gate, has_proj, has_vkv = _scan_hyper_keys(keys)
    if not has_vkv:
        raise CheckpointError(
            "no language_model.model.layers.*.self_attn.v_kv_proj keys: not an mPLUG-Owl3 "
            "checkpoint (it has no hyper-attention layers)"
        )
    generation = "g1" if has_gate or has_proj else "g2"
    ks = set(keys)
    if f"{PROJECTOR}weight" in ks:
        projector = "linear"
    elif f"{PROJECTOR}0.weight" in ks and f"{PROJECTOR}2.weight" in ks:
        projector = "mlp"
    else:
        found = sorted(k for k in ks if k.startswith(PROJECTOR))
        raise CheckpointError(
            f"unknown projector layout: expected vision2text_model.weight (linear) or "
            f"vision2text_model.0/.2.weight (MLP), found {found[:4] or 'no vision2text_model keys'}"
        )
    return generation, projector


def check_layout(
    d: Path, cfg: Owl3Config, shapes: dict[str, tuple[int, ...]]
) -> tuple[list[str], list[str]]:
    """(used keys, ignored keys) of checkpoint `d`, whose keys and shapes must be the official
    layout of `cfg`."""
    expected = official_shapes(cfg)
    hyper = set(cfg.hyper_layer_indices)
    used, ignored = [], []
    for k in shapes:
        if is_unused(k, cfg) or (cfg.tie_word_embeddings and k == f"{LM}lm_head.weight"):
            ignored.append(k)
            continue
        if k in expected:
            used.append(k)
            continue
        m = _LAYER_KEY.fullmatch(k)
        if m and m.group(2) in _HYPER_KNOWN and int(m.group(1)) not in hyper:
            raise CheckpointError(
                f"hyper key {k} on layer {int(m.group(1))} (0-based), but config.json "
                f"hyper_layers (1-based) is {cfg.hyper_layers}"
            )
        raise CheckpointError(
            f"unexpected key {k} (not in the official layout of a {cfg.form} "
            f"checkpoint with this config.json)"
        )
    missing = [k for k in expected if k not in shapes and not is_unused(k, cfg)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"missing key {missing[0]}{more} in {d} (an incomplete download, or not an "
            f"official mPLUG-Owl3 checkpoint)"
        )
    for k in used:
        if shapes[k] != expected[k]:
            raise CheckpointError(
                f"wrong shape for {k}: checkpoint has {list(shapes[k])}, config.json implies "
                f"{list(expected[k])}"
            )
    return used, ignored
