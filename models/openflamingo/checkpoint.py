"""Where an OpenFlamingo checkpoint's files are and how its tensors are read.

A published OpenFlamingo is three downloads (open_flamingo's README): the release's hub repository
holds only `checkpoint.pt` (a state dict of what open_flamingo trained: the perceiver, the gated
cross-attention layers and the text model's input embeddings resized to the tokenizer with its
added tokens), and the factory builds the rest from the vision and text models it names:

- 3B: `openflamingo/OpenFlamingo-3B-vitl-mpt1b`, text `anas-awadalla/mpt-1b-redpajama-200b`;
- 9B: `openflamingo/OpenFlamingo-9B-vitl-mpt7b`, text `anas-awadalla/mpt-7b`;
- both: vision open_clip's `ViT-L-14` `openai` weights, `timm/vit_large_patch14_clip_224.openai`.

lvx reads a folder (or a hub id) holding any of the three repositories' files side by side, their
names as published (they never collide):
- `checkpoint.pt` (required: it marks the folder as OpenFlamingo);
- `open_clip_model.safetensors` (or `open_clip_pytorch_model.bin`), the vision repo's weights as
  open_clip 3 fetches them, and `open_clip_config.json` where it has one (else the sizes are
  open_clip's `ViT-L-14`, the tower every release names);
- the text model's `config.json`, weights (`pytorch_model*.bin` as published, or
  `model*.safetensors`) and tokenizer files (`tokenizer.json`, `tokenizer_config.json`,
  `special_tokens_map.json`, `generation_config.json`).
A part whose files the folder lacks comes from its published hub repository (the release is told
by the width of `checkpoint.pt`'s embeddings), from the Hugging Face cache when offline. A folder
lvx finetuning wrote holds every tensor of the model in one `model.safetensors` (or its shards),
under the model's own names, which then replaces the three weight files.

Tensors are read safely: `torch.load(..., weights_only=True)` for the `.pt`/`.bin` pickles (plain
tensors and containers only, never arbitrary objects), `safetensors` where published."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint_folder import COMMON_HUB_FILES, resolve_checkpoint
from ..safetensors_folder import CheckpointError, safetensors_files
from ..torch_files import torch_tensors

FLAMINGO_FILE = "checkpoint.pt"
CLIP_CONFIG = "open_clip_config.json"
CLIP_WEIGHTS = "open_clip_model.safetensors"
CLIP_PICKLE = "open_clip_pytorch_model.bin"  # what open_clip 3 fetches where no safetensors are
VISION_HUB_FILES = (CLIP_CONFIG, CLIP_WEIGHTS)
TEXT_HUB_FILES = (
    *COMMON_HUB_FILES,
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "special_tokens_map.json",
)
# the files of a hub repo OpenFlamingo reads (its `Family.hub_files`): a release's repo matches
# only `checkpoint.pt`; a repo holding all three parts side by side matches them all
HUB_FILES = (FLAMINGO_FILE, *VISION_HUB_FILES, CLIP_PICKLE, *TEXT_HUB_FILES)
LVX_PREFIXES = ("vision_encoder.", "perceiver.", "lang_encoder.")  # the model's own names


@dataclass(frozen=True)
class Release:
    """A published OpenFlamingo and the repositories its parts come from."""

    name: str
    repo: str
    vision_repo: str
    text_repo: str
    width: int  # the text model's width (`checkpoint.pt`'s embeddings tell the release by it)
    note: str


RELEASES = (
    Release(
        "3B",
        "openflamingo/OpenFlamingo-3B-vitl-mpt1b",
        "timm/vit_large_patch14_clip_224.openai",
        "anas-awadalla/mpt-1b-redpajama-200b",
        2048,
        "OpenFlamingo-3B-vitl-mpt1b: CLIP ViT-L/14, MPT-1B, a cross layer before every block",
    ),
    Release(
        "9B",
        "openflamingo/OpenFlamingo-9B-vitl-mpt7b",
        "timm/vit_large_patch14_clip_224.openai",
        "anas-awadalla/mpt-7b",
        4096,
        "OpenFlamingo-9B-vitl-mpt7b: CLIP ViT-L/14, MPT-7B, a cross layer before every 4th block",
    ),
)


@dataclass(frozen=True)
class Parts:
    """The local folders of a checkpoint's three parts (one folder when they lie together)."""

    flamingo: Path  # holds checkpoint.pt (and, when lvx finetuning wrote it, model.safetensors)
    vision: Path
    text: Path

    @property
    def folders(self) -> tuple[Path, ...]:
        return tuple(dict.fromkeys((self.flamingo, self.vision, self.text)))


def _has_text(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "tokenizer.json").exists()


def clip_weights(folder: Path) -> Path | None:
    """The CLIP model's weights in `folder`, as open_clip 3 reads them: safetensors first."""
    return next((folder / f for f in (CLIP_WEIGHTS, CLIP_PICKLE) if (folder / f).exists()), None)


def _has_vision(folder: Path) -> bool:
    """The CLIP weights (or lvx's own weights, which hold the tower)."""
    return clip_weights(folder) is not None or lvx_weights(folder) is not None


def _vision_repo(repo: str) -> Path:
    """The vision repo's files, its safetensors where it has them, else its PyTorch weights
    (never both downloaded)."""
    folder = resolve_checkpoint(repo, None, VISION_HUB_FILES)
    if clip_weights(folder) is None:
        folder = resolve_checkpoint(repo, None, (CLIP_CONFIG, CLIP_PICKLE))
    return folder


def resolve_parts(path_or_id: str | os.PathLike, revision: str | None = None) -> Parts:
    """The three parts' folders of a checkpoint folder or hub id (see the module docstring)."""
    folder = resolve_checkpoint(path_or_id, revision, HUB_FILES)
    if not (folder / FLAMINGO_FILE).exists():
        raise CheckpointError(
            f"{folder} holds no {FLAMINGO_FILE}: not an OpenFlamingo checkpoint (download it from "
            f"{RELEASES[0].repo} or {RELEASES[1].repo})"
        )
    vision = folder if _has_vision(folder) else None
    text = folder if _has_text(folder) else None
    if vision is None or text is None:
        release = release_of(folder / FLAMINGO_FILE)
        if vision is None:
            vision = _vision_repo(release.vision_repo)
        if text is None:
            text = resolve_checkpoint(release.text_repo, None, TEXT_HUB_FILES)
    return Parts(folder, vision, text)


# ---- reading tensors -----------------------------------------------------------------------------
def _safetensors_state(files: dict[str, Path], keep=lambda key: True) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if keep(k)})
    return out


def release_of(flamingo_file: Path) -> Release:
    """The published release whose text model `checkpoint.pt`'s embeddings are as wide as."""
    state = flamingo_keys(torch_tensors(flamingo_file))
    wte = state.get("lang_encoder.transformer.wte.weight")
    width = int(wte.shape[1]) if wte is not None and wte.ndim == 2 else None
    for release in RELEASES:
        if release.width == width:
            return release
    raise CheckpointError(
        f"{flamingo_file} matches no published OpenFlamingo (text width {width}): put its text "
        "model's files (config.json, weights, tokenizer) and the vision files beside it"
    )


_CROSS = re.compile(r"lang_encoder\.gated_cross_attn_layers\.(\d+)\.")
_OLD_BLOCK = re.compile(r"lang_encoder\.old_decoder_blocks\.(\d+)\.")


def flamingo_key(key: str) -> str:
    """A key of open_flamingo's `Flamingo.state_dict()` under its first name, the model's (the
    released files' form, `...blocks.{i}.gated_cross_attn_layer.*`): the same tensors listed again
    under `lang_encoder.gated_cross_attn_layers.{i}.*` or `old_decoder_blocks.{i}.*` are read as
    `...transformer.blocks.{i}.gated_cross_attn_layer.*` / `.decoder_layer.*`; DDP's `module.`
    prefix is dropped."""
    key = key.removeprefix("module.")
    for pattern, part in ((_CROSS, "gated_cross_attn_layer"), (_OLD_BLOCK, "decoder_layer")):
        m = pattern.match(key)
        if m:
            return f"lang_encoder.transformer.blocks.{m.group(1)}.{part}." + key[m.end() :]
    return key


def flamingo_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {flamingo_key(k): v for k, v in state.items()}


def mpt_key(key: str) -> str:
    """A key of the MPT model's published weights under the model's names: `transformer.blocks.
    {i}.X` is block i's `decoder_layer.X`, `mosaic_gpt`'s part names (MPT-1B's) as MPT's."""
    from .modeling import MOSAIC_GPT_NAMES  # the module tree's names (imported when weights load)

    head, _, rest = key.partition(".")
    if head == "transformer":
        for old, new in MOSAIC_GPT_NAMES.items():
            rest = rest.replace(old, new, 1)
        if rest.startswith("blocks."):
            i, _, part = rest.removeprefix("blocks.").partition(".")
            rest = f"blocks.{i}.decoder_layer.{part}"
    return f"lang_encoder.{head}.{rest}" if rest else f"lang_encoder.{head}"


def vision_state(folder: Path) -> dict[str, torch.Tensor]:
    """open_clip's `visual.*` tensors as `vision_encoder.*` (the text tower is not read)."""
    path = clip_weights(folder)
    if path is None:
        raise CheckpointError(f"{folder} holds no {CLIP_WEIGHTS} or {CLIP_PICKLE}")
    state = {k: v for k, v in _file_tensors(path).items() if k.startswith("visual.")}
    if not state:
        raise CheckpointError(f"{path} holds no visual.* tensors: not an open_clip CLIP model")
    return {"vision_encoder." + k.removeprefix("visual."): v for k, v in state.items()}


def _has_safetensors(folder: Path) -> bool:
    return any((folder / f).exists() for f in ("model.safetensors", "model.safetensors.index.json"))


def text_weight_files(folder: Path) -> list[Path]:
    """The text model's weight files: safetensors where present, else the published `.bin`s."""
    if _has_safetensors(folder):
        return sorted(set(safetensors_files(folder).values()))
    index = folder / "pytorch_model.bin.index.json"
    if index.exists():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise CheckpointError(f"{index} is not a weights index: {exc}") from None
        return sorted(folder / n for n in names)
    if (folder / "pytorch_model.bin").exists():
        return [folder / "pytorch_model.bin"]
    raise CheckpointError(
        f"{folder} holds no text model weights (pytorch_model.bin, its shards, or "
        "model.safetensors)"
    )


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one weights file, safetensors or a PyTorch pickle (`weights_only`)."""
    if path.suffix != ".safetensors":
        return torch_tensors(path)
    try:
        return _safetensors_state({"": path})
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({type(exc).__name__})"
        ) from None


def text_state(folder: Path) -> dict[str, torch.Tensor]:
    """The MPT model's tensors (`transformer.*`, and `lm_head.*` where untied) under the model's
    names (`mpt_key`)."""
    state: dict[str, torch.Tensor] = {}
    for path in text_weight_files(folder):
        state.update(_file_tensors(path))
    return {mpt_key(k): v for k, v in state.items()}


def lvx_weights(folder: Path) -> dict[str, Path] | None:
    """key -> file of a folder lvx finetuning wrote (every tensor in `model*.safetensors` under
    the model's own names), or None for the published layout."""
    if not _has_safetensors(folder):
        return None
    files = safetensors_files(folder)
    return files if files and all(k.startswith(LVX_PREFIXES) for k in files) else None


def published_state(parts: Parts) -> dict[str, torch.Tensor]:
    """Every tensor of the model under its own names: lvx's own weights where finetuning wrote
    them, else the text model, the vision tower, then `checkpoint.pt` over them (its embeddings
    replace the text model's, resized to the tokenizer)."""
    own = lvx_weights(parts.flamingo)
    if own is not None:
        return _safetensors_state(own)
    state = text_state(parts.text)
    state.update(vision_state(parts.vision))
    state.update(flamingo_keys(torch_tensors(parts.flamingo / FLAMINGO_FILE)))
    return state


def _file_keys(path: Path, keep=lambda key: True) -> dict[str, Path]:
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as f:
            return {k: path for k in f.keys() if keep(k)}
    return {k: path for k in torch_tensors(path) if keep(k)}


def weight_files(folder: Path) -> dict[str, Path]:
    """{key: the file holding it} of every tensor the model loads, under each file's own names
    (headers read, pickles memory-mapped): lvx's own weights, or `checkpoint.pt`, the tower's
    `visual.*` and the text model's tensors but its embeddings (`checkpoint.pt`'s replace them)."""
    parts = resolve_parts(folder)
    own = lvx_weights(parts.flamingo)
    if own is not None:
        return own
    files = _file_keys(clip_weights(parts.vision), lambda k: k.startswith("visual."))
    for path in text_weight_files(parts.text):
        files.update(_file_keys(path, lambda k: k != "transformer.wte.weight"))
    files.update(_file_keys(parts.flamingo / FLAMINGO_FILE))
    return files
