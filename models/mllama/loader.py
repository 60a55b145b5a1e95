"""Load a published Llama-3.2-Vision checkpoint folder (config.json, safetensors, tokenizer,
preprocessor_config.json) into `MllamaModel` and its processor."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from ..safetensors_folder import CheckpointError, safetensors_files
from .checkpoint import check_layout
from .config import MllamaConfig
from .modeling import MllamaModel
from .processor import MllamaProcessor
from .text import rope_inv_freq


class LoadedMllama(NamedTuple):
    model: MllamaModel
    processor: MllamaProcessor
    config: MllamaConfig


def load_mllama(
    directory: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> LoadedMllama:
    """The model in eval mode on `device` in `dtype`, with its processor, from a local folder."""
    d = Path(directory)
    if not (d / "config.json").exists():
        raise CheckpointError(f"{d} holds no config.json: not a checkpoint folder")
    cfg = MllamaConfig.from_json(d / "config.json")
    files = safetensors_files(d)
    check_layout(files, cfg)
    with torch.device("meta"):
        model = MllamaModel(cfg)
    state = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), "pt", device=str(device)) as f:
            for key in f.keys():
                state[key] = f.get_tensor(key).to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    # the RoPE table is no checkpoint tensor: made again on the device (it was made on meta)
    model.language_model.model.inv_freq = rope_inv_freq(cfg.text).to(device)
    return LoadedMllama(model.eval(), MllamaProcessor.from_pretrained(d), cfg)
