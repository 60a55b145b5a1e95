"""Options shared by the commands that start the model (`lvx chat`, `lvx serve`, `lvx finetune`), declared once.

A module of its own so `lvx_app.serve_cli` can use them without importing the CLI that registers it.
"""

from __future__ import annotations

import typer

from lvx_app.defaults import DEFAULT_DECODE_TIMEOUT_S, DEFAULT_MODEL

MODEL = typer.Option(DEFAULT_MODEL, "--model", help="Local mPLUG-Owl3 checkpoint directory or Hugging Face hub id.")
REVISION = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit).")
FPS = typer.Option(1.0, "--fps", help="Frames sampled per second of video.")
MAX_FRAMES = typer.Option(None, "--max-frames", help="Cap on frames; more are thinned uniformly.")
GPUS = typer.Option(None, "--gpus", help="GPUs to use, one rank each (default: 1 if a GPU is visible, else 0 = CPU).")
RANKS = typer.Option(None, "--ranks", help="CPU ranks when --gpus 0 (gloo); default 1.")
DTYPE = typer.Option("auto", "--dtype", help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16.")
KV = typer.Option(
    None, "--kv-cache/--recompute-kv",
    help="Keep each hyper layer's visual K/V resident, or recompute them from one copy of the features "
    "per turn (less memory). Default: cache when it fits.",
)  # fmt: skip
TIMEOUT = typer.Option(300.0, "--timeout", help="Seconds a rank waits for a dead or hung peer before the group stops.")
DECODE_TIMEOUT = typer.Option(
    DEFAULT_DECODE_TIMEOUT_S, "--decode-timeout",
    help="Seconds one chunk of frames may take to decode before its worker is killed and the chunk retried frame "
    "by frame (some H.264 files hang the decoder).",
)  # fmt: skip
NO_CACHE = typer.Option(False, "--no-cache", help="Do not read or write the visual-feature cache.")
CACHE_DIR = typer.Option(None, "--cache-dir", help="Feature cache folder (default ~/.cache/lvx or $LVX_CACHE_DIR).")


def check_seconds(options: dict[str, float]) -> None:
    """Raise ValueError naming the first option (e.g. "--timeout") that is not a positive number of seconds."""
    for name, value in options.items():
        if not value > 0:
            raise ValueError(f"{name} must be a number of seconds above 0 (got {value:g})")
