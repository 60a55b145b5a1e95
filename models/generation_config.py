"""What a checkpoint's `generation_config.json` says that lvx uses, for every family alike."""

from __future__ import annotations

import json
from pathlib import Path


def answer_length(folder: Path) -> int | None:
    """`max_new_tokens` of the checkpoint's generation_config.json, when it names a positive one
    (the published checkpoints of both families name none: lvx's default applies)."""
    try:
        value = json.loads((Path(folder) / "generation_config.json").read_text()).get(
            "max_new_tokens"
        )
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None
