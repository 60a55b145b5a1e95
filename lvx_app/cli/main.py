"""The `lvx` command line. Commands stay thin: the work lives in importable modules."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lvx_app.cli.options import config_options, new_app
from lvx_app.config import Config
from lvx_app.interrupts import ctrl_c_deferred

app = new_app(
    "lvx", "Chat with hour-long videos: mPLUG-Owl3 with LV-XAttn distributed cross-attention."
)


@app.callback()
def main() -> None:
    """lvx: long-video question answering."""
    from lvx_app.warning_lines import install

    install()


@app.command()
def info(
    model: Optional[str] = typer.Option(
        None,
        "--model",
        help="Also say what this checkpoint (directory or hub id) is: "
        "its generation and G1 gate form, projector, sizes.",
    ),
) -> None:
    """Versions, devices, attention backends and the cache location."""
    from lvx_app.cli.info import print_info

    raise typer.Exit(print_info(model))


@app.command()
@config_options("model", "video", "parallel", "generation")
def chat(
    video: Path = typer.Argument(..., help="Video file to chat about.", metavar="VIDEO"),
    *,
    config: Config,
) -> None:
    """Chat about a video in the terminal; answers stream token by token."""
    try:  # Ctrl-C while torch loads: exit quietly, like Ctrl-C anywhere before the chat starts
        # imported here: `lvx --help`, `lvx eval report` and the like start without torch
        with ctrl_c_deferred():
            from lvx_app.cli.chat import run_chat_command
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise typer.Exit(run_chat_command(str(video), config))


@app.command()
@config_options("parallel", include=("gpus", "ranks"))
def demo(
    workdir: Optional[Path] = typer.Option(
        None, "--workdir", help="Where to write the demo video and checkpoint."
    ),
    generation: str = typer.Option(
        "g2",
        "--generation",
        help="Tiny checkpoint generation: g2 (7B-241101, fused), g1 (1B/2B-241014, constant "
        "gate) or g1-gateproj (7B-240728, input-dependent gate).",
    ),
    *,
    config: Config,
) -> None:
    """Run the whole pipeline on a synthetic video with a tiny random-weight model (no
    downloads)."""
    from lvx_app.cli.demo import run_demo

    raise typer.Exit(run_demo(config, workdir=workdir, generation=generation))


def _register_subcommands() -> None:
    from lvx_app.cli.cache import cache_app
    from lvx_app.cli.evaluate import eval_app
    from lvx_app.cli.finetune import finetune_command
    from lvx_app.cli.serve import serve_command

    app.add_typer(eval_app, name="eval", help="Batch evaluation (Video-MME).")
    app.add_typer(cache_app, name="cache", help="List or remove cached visual features.")
    app.command(
        "serve", help="Chat with a video in the browser (Gradio) on the same worker group."
    )(serve_command)
    app.command(
        "finetune",
        help="Finetune on video conversations with LV-XAttn (K/V recomputed in backward).",
    )(finetune_command)


# these import torch (a second or more): Ctrl-C meanwhile exits quietly, not with an import
# traceback
try:
    with ctrl_c_deferred():
        _register_subcommands()
except KeyboardInterrupt:
    raise SystemExit(130) from None

if __name__ == "__main__":
    app()
