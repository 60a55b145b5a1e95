"""`lvx info`: what this install can use, in one table."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform

from rich.console import Console
from rich.table import Table


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def collect_info() -> dict[str, str]:
    import torch

    import lvx_app

    rows = {
        "lvx": lvx_app.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda) if torch.cuda.is_available() else "not available",
        "gpus": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "none",
        "cpu cores": str(os.cpu_count()),
    }
    for dist in ("flash-attn", "decord", "gradio", "tokenizers", "safetensors", "transformers"):
        rows[dist] = _version(dist)
    try:
        from lvx_app.attention.backends import available_backends

        rows["attention backends"] = ", ".join(available_backends())
    except ImportError:
        pass
    try:
        from lvx_app.video.cache import default_cache_dir

        rows["cache"] = str(default_cache_dir())
    except ImportError:
        pass
    return rows


def print_info() -> None:
    table = Table(title="lvx info", show_header=False)
    for key, value in collect_info().items():
        table.add_row(key, value)
    Console().print(table)
