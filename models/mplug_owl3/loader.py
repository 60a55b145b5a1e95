"""Load an official mPLUG-Owl3 checkpoint (local directory or Hugging Face hub id) into `Owl3Model`.

- Resolves a directory or a hub id (`huggingface_hub.snapshot_download`, only the files we read; with
  HF_HUB_OFFLINE set only the local cache is tried and the error says to pass a local directory).
- Reads `model.safetensors` or the shards of `model.safetensors.index.json` with `safe_open`: headers first (keys,
  shapes), then only the tensors a caller asks for (`parts=`), straight onto the target device and dtype.
- Detects the architecture from the keys, never from the repo name (reference mplug_owl3.md §0):
  `self_attn.gate` -> G1, `self_attn.v_kv_proj` without a gate -> G2; `vision2text_model.weight` -> linear
  projector, `vision2text_model.{0,2}.weight` -> MLP projector.
- Checks the checkpoint against the official layout (§3) computed from its own config.json: a missing key, a key of
  the wrong shape, an unknown hyper-attention or gate key (e.g. an input-dependent `self_attn.gate_proj`, which
  the reference cannot rule out for 241014, §10.1), hyper keys on layers config.json does not list, a tokenizer
  whose specials disagree with config.json: each is a `CheckpointError` with one line naming the problem and key.
- Ignores the vision keys the model never uses (last encoder layer, post_layernorm, pooling head; §10.6: they may or
  may not be stored), and `lm_head.weight` when embeddings are tied.
- Facts the reference marks unverified are read, not assumed: hyper_layers and all sizes from config.json (§10.2),
  the `<|image|>` token count from the tokenizer (§10.3), the image size from `vision_config.image_size` and the
  cut template from the checkpoint's own `image_processing_mplugowl3.py` when present (§10.4; read as text, never
  executed).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import torch
from safetensors import safe_open

from .config import Owl3Config
from .processor import CUT_PROMPTS, DEFAULT_CUT_TEMPLATE, Owl3Processor

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint problem a user can fix; the message is one line naming the problem (and the key)."""


# ---------------------------------------------------------------------------------------------------------------
# the official layout (reference §3)
# ---------------------------------------------------------------------------------------------------------------
VISION = "vision_model."
PROJECTOR = "vision2text_model."
LM = "language_model."


def unused_vision_prefixes(cfg: Owl3Config) -> tuple[str, ...]:
    """Keys the model never uses: the last SigLIP encoder layer, post_layernorm and the pooling head."""
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


def official_shapes(cfg: Owl3Config, *, include_unused: bool = True) -> dict[str, tuple[int, ...]]:
    """Every key of the official checkpoint for `cfg` (its generation, projector and tying) with its shape."""
    v = cfg.vision
    d, i = v.hidden_size, v.intermediate_size
    s: dict[str, tuple[int, ...]] = {
        f"{VISION}embeddings.patch_embedding.weight": (d, v.num_channels, v.patch_size, v.patch_size),
        f"{VISION}embeddings.patch_embedding.bias": (d,),
        f"{VISION}embeddings.position_embedding.weight": (v.num_patches, d),
    }
    for k in range(v.num_hidden_layers):
        s.update(_siglip_layer(f"{VISION}encoder.layers.{k}.", d, i))
    s[f"{VISION}post_layernorm.weight"] = (d,)
    s[f"{VISION}post_layernorm.bias"] = (d,)
    s.update({
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
    })

    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    if cfg.projector == "linear":
        s[f"{PROJECTOR}weight"] = (h, d)
        s[f"{PROJECTOR}bias"] = (h,)
    else:
        s[f"{PROJECTOR}0.weight"] = (h, d)
        s[f"{PROJECTOR}0.bias"] = (h,)
        s[f"{PROJECTOR}2.weight"] = (h, h)
        s[f"{PROJECTOR}2.bias"] = (h,)

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
            if cfg.generation == "g1":
                s[f"{p}self_attn.gate"] = (h,)
    s[f"{m}norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        s[f"{LM}lm_head.weight"] = (cfg.vocab_size, h)
    if not include_unused:
        s = {k: v for k, v in s.items() if not is_unused(k, cfg)}
    return s


PARTS = {"vision": VISION, "projector": PROJECTOR, "lm": LM}

# the files we read from a hub repo (the official *.py are fetched as text for the cut-template check only)
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "vocab.json", "merges.txt", "generation_config.json", "image_processing_mplugowl3.py"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_LAYER_KEY = re.compile(r"language_model\.model\.layers\.(\d+)\.(.+)")
_ATTN_KNOWN = {f"self_attn.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")}
_ATTN_KNOWN.add("self_attn.o_proj.weight")
_HYPER_KNOWN = {"self_attn.v_kv_proj.weight", "self_attn.v_kv_proj.bias", "self_attn.gate"}


# ---------------------------------------------------------------------------------------------------------------
# resolving a directory or a hub id
# ---------------------------------------------------------------------------------------------------------------
def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a hub id downloaded (or found in the HF cache) with snapshot_download."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p} is a file: pass the checkpoint directory (the one holding config.json and "
                                  f"model.safetensors)")
        return p
    s = str(path_or_id)
    if not _HUB_ID.fullmatch(s):
        raise CheckpointError(f"{s}: no such directory (and not a Hugging Face hub id of the form owner/name)")
    from huggingface_hub import snapshot_download

    offline = _offline()
    try:
        return Path(snapshot_download(s, revision=revision, allow_patterns=HUB_FILES, local_files_only=offline))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one actionable line
        if offline:
            raise CheckpointError(f"{s} is not a local directory and HF_HUB_OFFLINE is set, so it cannot be "
                                  f"downloaded (and it is not in the Hugging Face cache): pass the local checkpoint "
                                  f"directory instead, e.g. --model /path/to/mPLUG-Owl3-7B-241101") from None
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{s}: no such local directory, and downloading it from the Hugging Face hub failed "
                              f"({type(e).__name__}: {why}); check the id and the network, or pass a local "
                              f"directory") from None


# ---------------------------------------------------------------------------------------------------------------
# reading headers and checking them against the layout
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class CheckpointInfo:
    """What a checkpoint directory holds, read from config.json, the safetensors headers and the tokenizer."""

    path: Path
    config: Owl3Config  # generation / projector filled from the keys
    files: dict[str, Path]  # key -> safetensors file holding it
    shapes: dict[str, tuple[int, ...]]
    used_keys: list[str]  # the keys the model loads (official minus unused vision keys, minus tied lm_head)
    ignored_keys: list[str]
    cut_template: str
    cut_template_source: str
    image_placeholder_len: int = 0  # how many BPE tokens "<|image|>" is (never hard-coded; §10.3)
    notes: list[str] = field(default_factory=list)


def _safetensors_files(d: Path) -> dict[str, Path]:
    """key -> file, from model.safetensors.index.json or model.safetensors (headers only)."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map): {e}") from None
        files = {k: d / f for k, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.exists():
                raise CheckpointError(f"{index} lists shard {f.name}, which is missing from {d}")
        return files
    single = d / "model.safetensors"
    if single.exists():
        return {k: single for k in _keys_of(single)}
    if any(d.glob("*.bin")) or any(d.glob("*.pt")):
        raise CheckpointError(f"{d} holds PyTorch .bin/.pt weights; only safetensors checkpoints are supported "
                              f"(the official repos ship model.safetensors)")
    raise CheckpointError(f"{d} is not an mPLUG-Owl3 checkpoint: no model.safetensors or "
                          f"model.safetensors.index.json")


def _keys_of(f: Path) -> list[str]:
    try:
        with safe_open(str(f), framework="pt") as h:
            return list(h.keys())
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{f} is not a readable safetensors file ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]})") from None


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    by_file: dict[Path, list[str]] = {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    out: dict[str, tuple[int, ...]] = {}
    for f, keys in by_file.items():
        try:
            with safe_open(str(f), framework="pt") as h:
                present = set(h.keys())
                for k in keys:
                    if k not in present:
                        raise CheckpointError(f"model.safetensors.index.json maps {k} to {f.name}, which does not "
                                              f"hold it")
                    out[k] = tuple(h.get_slice(k).get_shape())
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{f} is not a readable safetensors file ({type(e).__name__})") from None
    return out


def detect_architecture(keys: Iterable[str]) -> tuple[str, str]:
    """(generation, projector) from the checkpoint keys (reference §0 loader rule); refuses unknown hyper keys."""
    keys = list(keys)
    has_gate = has_vkv = False
    for k in keys:
        m = _LAYER_KEY.fullmatch(k)
        if not m or not m.group(2).startswith("self_attn."):
            continue
        rest = m.group(2)
        if rest in _ATTN_KNOWN:
            continue
        if rest == "self_attn.gate":
            has_gate = True
        elif rest.startswith("self_attn.v_kv_proj."):
            has_vkv = True
            if rest not in _HYPER_KNOWN:
                raise CheckpointError(f"unknown hyper-attention key {k} (expected v_kv_proj.weight / .bias)")
        elif "gate" in rest:
            raise CheckpointError(f"unknown gate key {k}: this loader knows only the G1 per-channel "
                                  f"`self_attn.gate` [hidden] (an input-dependent gate_proj is an unverified "
                                  f"variant, reference §10.1); refusing to guess")
        else:
            raise CheckpointError(f"unknown attention key {k} (not in the official mPLUG-Owl3 layout)")
    if not has_vkv:
        raise CheckpointError("no language_model.model.layers.*.self_attn.v_kv_proj keys: not an mPLUG-Owl3 "
                              "checkpoint (it has no hyper-attention layers)")
    generation = "g1" if has_gate else "g2"
    ks = set(keys)
    if f"{PROJECTOR}weight" in ks:
        projector = "linear"
    elif f"{PROJECTOR}0.weight" in ks and f"{PROJECTOR}2.weight" in ks:
        projector = "mlp"
    else:
        found = sorted(k for k in ks if k.startswith(PROJECTOR))
        raise CheckpointError(f"unknown projector layout: expected vision2text_model.weight (linear) or "
                              f"vision2text_model.0/.2.weight (MLP), found {found[:4] or 'no vision2text_model keys'}")
    return generation, projector


def detect_cut_template(d: Path, generation: str) -> tuple[str, str]:
    """(template, source). The checkpoint's own image processor says which cut prompt it was trained with."""
    f = d / "image_processing_mplugowl3.py"
    if f.exists():
        text = f.read_text(errors="replace")
        m = re.search(r"""["']cut_prompt["']\s*:\s*["'](\w+)["']""", text)
        g = re.search(r"""["']add_global["']\s*:\s*(True|False)""", text)
        if m:
            name = m.group(1) + ("_global" if g and g.group(1) == "True" else "")
            if name not in CUT_PROMPTS:
                raise CheckpointError(f"{f.name} uses cut prompt {name!r}; only {', '.join(CUT_PROMPTS)} are "
                                      f"implemented")
            return name, f"{f.name}"
    return DEFAULT_CUT_TEMPLATE[generation], f"default for {generation} (no cut_prompt found in the checkpoint)"


def _check_tokenizer(d: Path, cfg: Owl3Config, info_notes: list[str]) -> int:
    from .tokenizer import Owl3Tokenizer

    f = d / "tokenizer.json"
    if not f.exists():
        raise CheckpointError(f"{d} has no tokenizer.json (the Qwen2 tokenizer of the checkpoint)")
    try:
        tok = Owl3Tokenizer.from_file(f)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{f} cannot be read: {(str(e).splitlines() or [''])[0][:200]}") from None
    if len(tok) > cfg.vocab_size:
        raise CheckpointError(f"tokenizer.json has {len(tok)} tokens but config.json vocab_size is "
                              f"{cfg.vocab_size}: the embedding table would be too small")
    if isinstance(cfg.eos_token_id, int) and cfg.eos_token_id != tok.im_end_id:
        raise CheckpointError(f"config.json eos_token_id {cfg.eos_token_id} is not the tokenizer's <|im_end|> "
                              f"({tok.im_end_id})")
    if isinstance(cfg.bos_token_id, int) and cfg.bos_token_id != tok.endoftext_id:
        raise CheckpointError(f"config.json bos_token_id {cfg.bos_token_id} is not the tokenizer's <|endoftext|> "
                              f"({tok.endoftext_id})")
    n = len(tok.encode("<|image|>"))
    if n == 1:
        info_notes.append("<|image|> is a single token in this tokenizer (the reference expects plain text)")
    return n


def inspect_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> CheckpointInfo:
    """Resolve, read config.json + safetensors headers + tokenizer, detect the architecture, check the layout."""
    d = resolve_checkpoint(path_or_id, revision)
    cfg_file = d / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{d} is not an mPLUG-Owl3 checkpoint: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    if raw.get("model_type") != "mplugowl3":
        raise CheckpointError(f"{cfg_file} has model_type {raw.get('model_type')!r}, not 'mplugowl3': not an "
                              f"mPLUG-Owl3 checkpoint")
    for k in ("hyper_layers", "vision_config", "hidden_size", "num_hidden_layers", "vocab_size"):
        if k not in raw:
            raise CheckpointError(f"{cfg_file} has no {k!r} (it is read, never assumed)")

    files = _safetensors_files(d)
    generation, projector = detect_architecture(files)
    try:
        cfg = Owl3Config.from_dict(raw, generation=generation, projector=projector)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None
    shapes = _shapes(files)
    notes: list[str] = []
    n_img = _check_tokenizer(d, cfg, notes)

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
            raise CheckpointError(f"hyper key {k} on layer {int(m.group(1))} (0-based), but config.json "
                                  f"hyper_layers (1-based) is {cfg.hyper_layers}")
        raise CheckpointError(f"unexpected key {k} (not in the official layout of a {generation.upper()} "
                              f"checkpoint with this config.json)")
    missing = [k for k in expected if k not in shapes and not is_unused(k, cfg)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing key {missing[0]}{more} in {d} (an incomplete download, or not an "
                              f"official mPLUG-Owl3 checkpoint)")
    for k in used:
        if shapes[k] != expected[k]:
            raise CheckpointError(f"wrong shape for {k}: checkpoint has {list(shapes[k])}, config.json implies "
                                  f"{list(expected[k])}")

    cut, cut_src = detect_cut_template(d, generation)
    if cut != DEFAULT_CUT_TEMPLATE[generation]:
        notes.append(f"cut template {cut} (from {cut_src}) differs from the {generation} default")
    return CheckpointInfo(path=d, config=cfg, files=files, shapes=shapes, used_keys=used, ignored_keys=ignored,
                          cut_template=cut, cut_template_source=cut_src, image_placeholder_len=n_img,
                          notes=notes)


# ---------------------------------------------------------------------------------------------------------------
# loading tensors and the model
# ---------------------------------------------------------------------------------------------------------------
def _device_str(device: torch.device | str) -> str:
    dev = torch.device(device)
    return str(dev) if dev.type != "cuda" or dev.index is not None else f"cuda:{torch.cuda.current_device()}"


def load_tensors(info: CheckpointInfo, keys: Iterable[str] | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Read only `keys` (default: every used key) with safe_open, straight onto `device`, cast to `dtype`."""
    keys = list(info.used_keys if keys is None else keys)
    by_file: dict[Path, list[str]] = {}
    for k in keys:
        if k not in info.files:
            raise CheckpointError(f"missing key {k} in {info.path}")
        by_file.setdefault(info.files[k], []).append(k)
    out: dict[str, torch.Tensor] = {}
    dev = _device_str(device)
    for f, ks in by_file.items():
        with safe_open(str(f), framework="pt", device=dev) as h:
            for k in ks:
                t = h.get_tensor(k)
                out[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


class PartNotLoadedError(AttributeError):
    pass


class _NotLoaded(torch.nn.Module):
    """Stands in for a part a rank did not load (`load_model(parts=...)`): calling it or reaching into it raises
    one clear error."""

    def __init__(self, part: str):
        super().__init__()
        self.part = part

    def _error(self) -> PartNotLoadedError:
        return PartNotLoadedError(f"the {self.part!r} part of the model was not loaded; add it to "
                                  f"load_model(parts=...)")

    def forward(self, *args, **kwargs):
        raise self._error()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise self._error() from None


class LoadedModel(NamedTuple):
    model: torch.nn.Module
    config: Owl3Config
    processor: Owl3Processor


def load_model(path_or_id: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", revision: str | None = None,
               parts: Sequence[str] = ("vision", "projector", "lm")) -> LoadedModel:
    """(model, config, processor) from a local directory or a hub id; see the module docstring for the checks.

    `parts` picks what this process needs ("vision" = SigLIP tower, "projector", "lm" = HyperQwen2 language
    model); only those tensors are read. Parts left out are replaced by a module that raises if called.
    The model is in eval mode on `device` in `dtype`.
    """
    from .modeling import Owl3Model

    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"parts must be a non-empty subset of {tuple(PARTS)}, got {tuple(parts)}")
    info = inspect_checkpoint(path_or_id, revision)
    cfg = info.config
    for note in info.notes:
        log.info("%s: %s", info.path, note)
    with torch.device("meta"):
        model = Owl3Model(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    layout = official_shapes(cfg, include_unused=False)
    if want != layout:  # the model and the layout must agree; a mismatch is a bug in models/, not the checkpoint
        diff = sorted(set(want) ^ set(layout)) or sorted(k for k in want if want[k] != layout[k])
        raise RuntimeError(f"Owl3Model parameters do not match the official layout at {diff[0]} (a bug in models/)")
    prefixes = tuple(PARTS[p] for p in parts)
    tensors = load_tensors(info, [k for k in info.used_keys if k.startswith(prefixes)], dtype=dtype, device=device)
    model.load_state_dict(tensors, strict=False, assign=True)  # tied: Qwen2LM has no lm_head parameter at all
    for name, mod_prefix in PARTS.items():
        if name not in parts:
            setattr(model, mod_prefix.rstrip("."), _NotLoaded(name))
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise RuntimeError(f"Owl3Model tensor {still_meta[0]} was not loaded (a bug in models/ or the layout)")
    model.eval()
    processor = Owl3Processor.from_checkpoint(info)
    return LoadedModel(model, cfg, processor)
