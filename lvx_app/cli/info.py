"""`lvx info`: what this install can use, in one table; with `--model`, what a checkpoint is (from
its config.json and safetensors headers, no weights read)."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform

from rich.console import Console
from rich.markup import escape
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
        "gpus": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        or "none",
        "cpu cores": str(os.cpu_count()),
    }
    for dist in ("flash-attn", "decord", "gradio", "tokenizers", "safetensors", "transformers"):
        rows[dist] = _version(dist)
    from lvx_models.api import family_names

    rows["model families"] = family_names()
    try:
        from lvx_kernels.backends import available_backends

        rows["attention backends"] = ", ".join(available_backends())
    except ImportError:
        pass
    try:
        from lvx_app.defaults import default_cache_dir

        rows["cache"] = str(default_cache_dir())
    except ImportError:
        pass
    return rows


def checkpoint_rows(model: str) -> dict[str, str]:
    """What the checkpoint's family says of it (generation, sizes, the release it matches, its
    prompt rules with where each came from) and what `--kv-mode auto` would choose for it (raises
    CheckpointError)."""
    from lvx_models.api import family_of

    family = family_of(model)
    info = family.inspect(model)
    return {
        **family.describe(info),
        "kv mode auto, 1 h at 1 fps on one device": auto_kv_line(info.config),
    }


def auto_kv_line(config) -> str:
    """What `--kv-mode auto` would choose now for an hour at 1 fps on one rank (the first GPU's
    free memory, in bf16), with the figures it compares."""
    import torch

    from lvx_app.engine.kv_choice import choose_kv_mode

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return choose_kv_mode("auto", config, 3600, 1, 2, device).line()


def print_info(model: str | None = None) -> int:
    """Print the table (and the checkpoint's, with `model`); 2 with a one-line error if it cannot be
    read."""
    console = Console()
    rows = collect_info()
    if model is not None:
        from lvx_models.api import CheckpointError

        try:
            rows.update(checkpoint_rows(model))
        except CheckpointError as e:
            console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
            return 2
    table = Table(title="lvx info", show_header=False)
    for key, value in rows.items():
        table.add_row(key, value)
    console.print(table)
    return 0
