"""Options shared by the `lvx` commands (chat, serve, eval, finetune), declared once, and the one
way to make a typer app.

A leaf module (typer and `lvx_app.defaults` only), so `lvx_app.serve_cli`, `lvx_app.eval.cli` (which
must not import torch) and `lvx_app.video.cache_cli` can use it without importing the CLI that
registers them.
"""

from __future__ import annotations

import typer

from lvx_app.defaults import (
    DEFAULT_DECODE_TIMEOUT_S,
    DEFAULT_LAYOUT,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_SUBTITLE_TOKENS,
    DEFAULT_TIMEOUT_S,
)

MODEL = typer.Option(
    DEFAULT_MODEL, "--model", help="Local mPLUG-Owl3 checkpoint directory or Hugging Face hub id."
)
REVISION = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit).")
FPS = typer.Option(1.0, "--fps", help="Frames sampled per second of video.")
MAX_FRAMES = typer.Option(None, "--max-frames", help="Cap on frames; more are thinned uniformly.")
GPUS = typer.Option(
    None,
    "--gpus",
    help="GPUs to use, one rank each (default: 1 if a GPU is visible, else 0 = CPU).",
)
RANKS = typer.Option(None, "--ranks", help="CPU ranks when --gpus 0 (gloo); default 1.")
DTYPE = typer.Option(
    "auto", "--dtype", help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16."
)
KV = typer.Option(
    None,
    "--kv-cache/--recompute-kv",
    help="Keep each hyper layer's visual K/V resident, or recompute them from one copy of the "
    "features "
    "per turn (less memory). Default: cache when it fits.",
)
TIMEOUT = typer.Option(
    DEFAULT_TIMEOUT_S,
    "--timeout",
    help="Seconds a rank waits for a dead or hung peer before the group stops.",
)
DECODE_TIMEOUT = typer.Option(
    DEFAULT_DECODE_TIMEOUT_S,
    "--decode-timeout",
    help="Seconds one chunk of frames may take to decode before its worker is killed and the chunk "
    "retried frame "
    "by frame (some H.264 files hang the decoder).",
)
XATTN_SCHEDULE = typer.Option(
    "auto",
    "--xattn-schedule",
    help="Cross-attention schedule of a question over the ranks: auto (gather for short questions, "
    "the LV-XAttn "
    "ring for long ones, by a measured crossover), ring or gather. The video prompt always uses "
    "the ring.",
)
LAYOUT = typer.Option(
    DEFAULT_LAYOUT,
    "--layout",
    help="How frames and their prompt tokens are dealt over the ranks: zigzag (balanced, the "
    "default), striped or "
    "contiguous. Only matters with more than one rank; the answers are the same on every layout.",
)
NO_CACHE = typer.Option(False, "--no-cache", help="Do not read or write the visual-feature cache.")
CACHE_DIR = typer.Option(
    None, "--cache-dir", help="Feature cache folder (default ~/.cache/lvx or $LVX_CACHE_DIR)."
)

# Subtitles (lvx chat; lvx serve's token budget): placed after the video in the prompt prefilled at
# load.
_SUBTITLES_HELP = (
    "auto: a .srt/.vtt next to the video with its name (movie.en.srt too), else a text subtitle "
    "stream inside it; "
    "none; or a subtitle FILE. Only the lines at the sampled frames are used, as in the Video-MME "
    "eval."
)
SUBTITLES = typer.Option("auto", "--subtitles", help=_SUBTITLES_HELP)
SUBTITLE_LANG = typer.Option(
    None,
    "--subtitle-lang",
    help="Language of the subtitles to pick with --subtitles auto (en, eng, fr, ...).",
)
SUBTITLE_ENCODING = typer.Option(
    None,
    "--subtitle-encoding",
    help="Text encoding of the subtitle file (default: UTF-8, else detected).",
)
SUBTITLE_TOKENS = typer.Option(
    DEFAULT_SUBTITLE_TOKENS,
    "--subtitle-tokens",
    help="Most tokens the subtitle lines may take; beyond it lines are dropped evenly over the "
    "video, with a warning.",
)

# Generation (lvx chat; lvx serve's defaults for the page).
MAX_NEW_TOKENS = typer.Option(
    DEFAULT_MAX_NEW_TOKENS, "--max-new-tokens", help="Longest answer, in tokens."
)
TEMPERATURE = typer.Option(0.0, "--temperature", help="0 = greedy (reproducible).")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling mass when --temperature > 0.")


def new_app(name: str, help: str) -> typer.Typer:
    """A typer app (or sub-app) as every lvx command group has it: help when called bare, no
    shell-completion commands, plain Python tracebacks."""
    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
