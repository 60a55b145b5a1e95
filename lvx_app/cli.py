"""The `lvx` command line. Commands stay thin: the work lives in importable modules."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lvx_app.engine.session import DEFAULT_MODEL

app = typer.Typer(
    name="lvx",
    help="Chat with hour-long videos: mPLUG-Owl3 with LV-XAttn distributed cross-attention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

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
NO_CACHE = typer.Option(False, "--no-cache", help="Do not read or write the visual-feature cache.")
CACHE_DIR = typer.Option(None, "--cache-dir", help="Feature cache folder (default ~/.cache/lvx or $LVX_CACHE_DIR).")


@app.callback()
def main() -> None:
    """lvx: long-video question answering."""
    from lvx_app.warning_lines import install

    install()


@app.command()
def info() -> None:
    """Versions, devices, attention backends and the cache location."""
    from lvx_app.info import print_info

    print_info()


@app.command()
def chat(
    video: Path = typer.Argument(..., help="Video file to chat about."),
    model: str = MODEL,
    revision: Optional[str] = REVISION,
    fps: float = FPS,
    max_frames: Optional[int] = MAX_FRAMES,
    gpus: Optional[int] = GPUS,
    ranks: Optional[int] = RANKS,
    dtype: str = DTYPE,
    kv_cache: Optional[bool] = KV,
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Longest answer, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (reproducible)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass when --temperature > 0."),
    timeout: float = TIMEOUT,
    no_cache: bool = NO_CACHE,
    cache_dir: Optional[Path] = CACHE_DIR,
) -> None:
    """Chat about a video in the terminal; answers stream token by token."""
    from lvx_app.engine.api import GenerationParams
    from lvx_app.engine.runner import run_chat_command

    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    code = run_chat_command(
        video=str(video), model=model, revision=revision, fps=fps, max_frames=max_frames, gpus=gpus, ranks=ranks,
        dtype=dtype, kv_cache=kv_cache, params=params, timeout=timeout, use_cache=not no_cache,
        cache_dir=str(cache_dir) if cache_dir else None,
    )  # fmt: skip
    raise typer.Exit(code)


@app.command()
def demo(
    gpus: Optional[int] = GPUS,
    ranks: Optional[int] = typer.Option(None, "--ranks", help="CPU ranks when there is no GPU (default 2)."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where to write the demo video and checkpoint."),
    generation: str = typer.Option("g2", "--generation", help="Tiny checkpoint generation: g1 or g2."),
) -> None:
    """Run the whole pipeline on a synthetic video with a tiny random-weight model (no downloads)."""
    from lvx_app.demo import run_demo

    raise typer.Exit(run_demo(gpus=gpus, ranks=ranks, workdir=workdir, generation=generation))


def _register_subcommands() -> None:
    from lvx_app.eval.cli import eval_app
    from lvx_app.serve_cli import serve_command
    from lvx_app.train.cli import finetune_command
    from lvx_app.video.cache_cli import cache_app

    app.add_typer(eval_app, name="eval", help="Batch evaluation (Video-MME).")
    app.add_typer(cache_app, name="cache", help="List or remove cached visual features.")
    app.command("serve", help="Chat with a video in the browser (Gradio) on the same worker group.")(serve_command)
    app.command("finetune", help="Finetune on video conversations with LV-XAttn (K/V recomputed in backward).")(
        finetune_command
    )


_register_subcommands()

if __name__ == "__main__":
    app()
