"""Load an official mPLUG-Owl3 checkpoint (local directory or Hugging Face hub id) into `Owl3Model`.

- Inspects the checkpoint (`checkpoint.py`: where it is, its safetensors headers, the architecture
  its keys imply) and checks it against the official layout (§3) computed from its own config.json:
  a missing key, a key of the wrong shape, an unknown hyper-attention or gate key (the G1 gates are
  `self_attn.gate_proj.0.*`, 240728, and `self_attn.gate`, 241014), hyper keys on layers config.json
  does not list, a tokenizer whose specials disagree with config.json: each is a `CheckpointError`
  with one line naming the problem and key.
- Ignores the vision keys the model never uses (last encoder layer, post_layernorm, pooling head;
  §10.6: they may or may not be stored), and `lm_head.weight` when embeddings are tied.
- Facts the reference marks unverified are read, not assumed: hyper_layers and all sizes from
  config.json (§10.2), the `<|image|>` token count from the tokenizer (§10.3), the image size from
  `vision_config.image_size`, and the prompt rules (video span, cut beside videos, cut prompt) from
  the checkpoint's own `processing_mplugowl3.py` / `image_processing_mplugowl3.py` when they state
  them, else the published default of the weights' release (`prompt_rules.py`; read as text, never
  executed).
- Reads only the tensors a caller asks for (`parts=`) with `safe_open`, straight onto the target
  device and dtype.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from ..config_checks import checked_config
from ..generation_config import answer_length
from ..safetensors_folder import safetensors_files, tensor_shapes
from .checkpoint import (
    LM,
    PROJECTOR,
    VISION,
    CheckpointError,
    check_layout,
    detect_architecture,
    detect_gate_form,
    official_shapes,
    resolve_folder,
)
from .config import FORM_NOTES, Owl3Config
from .modeling import Owl3Model
from .processor import Owl3Processor
from .prompt_rules import PromptRules, differences, read_prompt_rules
from .tokenizer import Owl3Tokenizer

log = logging.getLogger(__name__)

PARTS = {"vision": VISION, "projector": PROJECTOR, "lm": LM}


# --------------------------------------------------------------------------------------------------
# inspecting a checkpoint
# --------------------------------------------------------------------------------------------------
@dataclass
class CheckpointInfo:
    """What a checkpoint directory holds, read from config.json, the safetensors headers and the
    tokenizer."""

    path: Path
    config: Owl3Config  # generation / projector / gate_form filled from the keys
    files: dict[str, Path]  # key -> safetensors file holding it
    shapes: dict[str, tuple[int, ...]]
    # the keys the model loads (official minus unused vision keys, minus tied lm_head)
    used_keys: list[str]
    ignored_keys: list[str]
    prompt_rules: PromptRules  # video span, cut beside videos, cut prompt, and where each came from
    image_placeholder_len: int = 0  # how many BPE tokens "<|image|>" is (never hard-coded; §10.3)
    notes: list[str] = field(default_factory=list)
    max_new_tokens: int | None = None  # the answer length its generation_config.json asks for


def _check_tokenizer(d: Path, cfg: Owl3Config, info_notes: list[str]) -> int:
    f = d / "tokenizer.json"
    if not f.exists():
        raise CheckpointError(f"{d} has no tokenizer.json (the Qwen2 tokenizer of the checkpoint)")
    try:
        tok = Owl3Tokenizer.from_file(f)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{f} cannot be read: {(str(e).splitlines() or [''])[0][:200]}"
        ) from None
    if len(tok) > cfg.vocab_size:
        raise CheckpointError(
            f"tokenizer.json has {len(tok)} tokens but config.json vocab_size is "
            f"{cfg.vocab_size}: the embedding table would be too small"
        )
    if isinstance(cfg.eos_token_id, int) and cfg.eos_token_id != tok.im_end_id:
        raise CheckpointError(
            f"config.json eos_token_id {cfg.eos_token_id} is not the tokenizer's <|im_end|> "
            f"({tok.im_end_id})"
        )
    if isinstance(cfg.bos_token_id, int) and cfg.bos_token_id != tok.endoftext_id:
        raise CheckpointError(
            f"config.json bos_token_id {cfg.bos_token_id} is not the tokenizer's <|endoftext|> "
            f"({tok.endoftext_id})"
        )
    n = len(tok.encode("<|image|>"))
    if n == 1:
        info_notes.append(
            "<|image|> is a single token in this tokenizer (the reference expects plain text)"
        )
    return n


def _read_config_json(d: Path) -> dict[str, Any]:
    """config.json as a dict, refused unless it is an mPLUG-Owl3 config with the keys we read."""
    cfg_file = d / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{d} is not an mPLUG-Owl3 checkpoint: no config.json")
    raw = checked_config(cfg_file)
    if raw.get("model_type") != "mplugowl3":
        raise CheckpointError(
            f"{cfg_file} has model_type {raw.get('model_type')!r}, not 'mplugowl3': not an "
            f"mPLUG-Owl3 checkpoint"
        )
    for k in ("hyper_layers", "vision_config", "hidden_size", "num_hidden_layers", "vocab_size"):
        if k not in raw:
            raise CheckpointError(f"{cfg_file} has no {k!r} (it is read, never assumed)")
    return raw


def inspect_checkpoint(
    path_or_id: str | os.PathLike, revision: str | None = None
) -> CheckpointInfo:
    """Resolve, read config.json + safetensors headers + tokenizer, detect the architecture, check
    the layout."""
    d = resolve_folder(path_or_id, revision)
    raw = _read_config_json(d)
    files = safetensors_files(d)
    generation, projector = detect_architecture(files)
    try:
        cfg = Owl3Config.from_dict(
            raw, generation=generation, projector=projector, gate_form=detect_gate_form(files)
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{d / 'config.json'}: {e}") from None
    shapes = tensor_shapes(files)
    notes: list[str] = []
    n_img = _check_tokenizer(d, cfg, notes)
    used, ignored = check_layout(d, cfg, shapes)
    rules = read_prompt_rules(d, cfg.form)
    notes.extend(differences(rules, cfg.form))
    return CheckpointInfo(
        path=d,
        config=cfg,
        files=files,
        shapes=shapes,
        used_keys=used,
        ignored_keys=ignored,
        prompt_rules=rules,
        image_placeholder_len=n_img,
        notes=notes,
        max_new_tokens=answer_length(d),
    )


# --------------------------------------------------------------------------------------------------
# loading tensors and the model
# --------------------------------------------------------------------------------------------------
def _device_str(device: torch.device | str) -> str:
    dev = torch.device(device)
    return (
        str(dev)
        if dev.type != "cuda" or dev.index is not None
        else f"cuda:{torch.cuda.current_device()}"
    )


def load_tensors(
    info: CheckpointInfo,
    keys: Iterable[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Read only `keys` (default: every used key) with safe_open, straight onto `device`, cast to
    `dtype`."""
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
    """Stands in for a part a rank did not load (`load_model(parts=...)`): calling it or reaching
    into it raises one clear error."""

    def __init__(self, part: str):
        super().__init__()
        self.part = part

    def _error(self) -> PartNotLoadedError:
        return PartNotLoadedError(
            f"the {self.part!r} part of the model was not loaded; add it to load_model(parts=...)"
        )

    def forward(self, *args, **kwargs):
        raise self._error()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise self._error() from None


class LoadedModel(NamedTuple):
    model: Owl3Model
    config: Owl3Config
    processor: Owl3Processor


class _SkipInit(TorchFunctionMode):
    """Skips nn.init's fills (this thread only): the checkpoint overwrites every weight, and
    `normal_` on a meta tensor alone imports torch._dynamo, over a second of every rank's start."""

    FILLS = {
        getattr(torch.nn.init, name)
        for name in "normal_ uniform_ kaiming_uniform_ trunc_normal_ zeros_ ones_ constant_".split()
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _empty_model(cfg: Owl3Config) -> Owl3Model:
    """The model's skeleton on the meta device, not initialised (the checkpoint fills it)."""
    with torch.device("meta"), _SkipInit():
        return Owl3Model(cfg)


def load_model(
    path_or_id: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    parts: Sequence[str] = ("vision", "projector", "lm"),
    fuse: bool = True,
) -> LoadedModel:
    """(model, config, processor) from a local directory or a hub id; see the module docstring for
    the checks.

    `parts` picks what this process needs ("vision" = SigLIP tower, "projector", "lm" = HyperQwen2
    language model); only those tensors are read. Parts left out are replaced by a module that
    raises if called. The model is in eval mode on `device` in `dtype`. `fuse`: the language
    model's q/k/v and gate/up projections each run as one matmul without autograd
    (`Owl3Model.fuse_projections`; training passes False: its parameters then own their memory).
    """
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"parts must be a non-empty subset of {tuple(PARTS)}, got {tuple(parts)}")
    info = inspect_checkpoint(path_or_id, revision)
    cfg = info.config
    log.info("%s: %s (%s)", info.path, cfg.form, FORM_NOTES[cfg.form])
    for note in info.notes:
        log.info("%s: %s", info.path, note)
    model = _empty_model(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    layout = official_shapes(cfg, include_unused=False)
    if (
        want != layout
    ):  # the model and the layout must agree; a mismatch is a bug in models/, not the checkpoint
        diff = sorted(set(want) ^ set(layout)) or sorted(k for k in want if want[k] != layout[k])
        raise RuntimeError(
            f"Owl3Model parameters do not match the official layout at {diff[0]} (a bug in models/)"
        )
    prefixes = tuple(PARTS[p] for p in parts)
    tensors = load_tensors(
        info, [k for k in info.used_keys if k.startswith(prefixes)], dtype=dtype, device=device
    )
    # tied: Qwen2LM has no lm_head parameter at all
    model.load_state_dict(tensors, strict=False, assign=True)
    del tensors  # the model holds them now; fusing below frees each layer's separate copies
    for name, mod_prefix in PARTS.items():
        if name not in parts:
            setattr(model, mod_prefix.rstrip("."), _NotLoaded(name))
    still_meta = [
        n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta
    ]
    if still_meta:
        raise RuntimeError(
            f"Owl3Model tensor {still_meta[0]} was not loaded (a bug in models/ or the layout)"
        )
    if fuse and "lm" in parts:
        model.fuse_projections()
    model.eval()
    processor = Owl3Processor.from_checkpoint(info)
    return LoadedModel(model, cfg, processor)
