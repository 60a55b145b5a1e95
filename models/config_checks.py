"""The one check of a checkpoint's JSON files that every family's config reader calls: a file that
is missing or not a JSON object, a size that is no whole number above 0, an epsilon or a RoPE
number that is not finite and above 0, a llama3 `rope_scaling` without its numbers: each is one
`CheckpointError` line naming the file and the field, before any model is built (a zero head
count would divide by zero, a NaN epsilon would answer `!!!` without a word)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .safetensors_folder import CheckpointError

# sizes: whole numbers above 0 (null where a config leaves one to its default)
SIZES = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "max_position_embeddings",
        "vocab_size",
        "patch_size",
        "image_size",
        "head_dim",
        "num_channels",
        "max_num_tiles",
        "vision_output_dim",
        "num_global_layers",
        "original_max_position_embeddings",
    }
)
# real numbers that must be finite and above 0
POSITIVE = frozenset(
    {
        "rms_norm_eps",
        "layer_norm_eps",
        "norm_eps",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
    }
)
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_json_object(path: str | Path, what: str = "") -> dict[str, Any]:
    """The JSON object in `path`; a missing file, one that is no JSON or no object is one line
    (`what` says what the file is for, when it is missing)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        needed = f" ({what})" if what else ""
        raise CheckpointError(f"{path} is missing{needed}: not a complete checkpoint") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(data).__name__}, not an object of the config's fields"
        )
    return data


def checked_config(path: str | Path) -> dict[str, Any]:
    """config.json at `path`, its sizes, epsilons and RoPE numbers checked (in nested sections
    too: vision_config, text_config, rope_scaling)."""
    data = read_json_object(path)
    check_fields(data, Path(path))
    return data


def check_fields(data: dict[str, Any], path: Path, where: str = "") -> None:
    """Raise a CheckpointError naming `path` and the field for the first bad value in `data`."""
    for name, value in data.items():
        field = f"{where}{name}"
        if isinstance(value, dict):
            check_fields(value, path, f"{field}.")
            if name in ("rope_scaling", "rope_parameters"):
                _check_rope(value, path, field)
        elif value is None:
            continue
        elif name in SIZES and not (_whole(value) and value > 0):
            raise CheckpointError(f"{path}: {field} is {value!r}; expected an int above 0")
        elif name in POSITIVE and not (_real(value) and math.isfinite(value) and value > 0):
            raise CheckpointError(
                f"{path}: {field} is {value!r}; expected a float, finite and above 0"
            )


def _check_rope(rope: dict[str, Any], path: Path, field: str) -> None:
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return
    missing = [k for k in LLAMA3_ROPE if rope.get(k) is None]
    if missing:
        raise CheckpointError(f"{path}: {field} of rope_type llama3 has no {', '.join(missing)}")
    if rope["high_freq_factor"] <= rope["low_freq_factor"]:
        raise CheckpointError(f"{path}: {field}.high_freq_factor must be above its low_freq_factor")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
