"""The `lvx` command line. Commands stay thin: the work lives in importable modules."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lvx_app.cli.options import config_options, new_app
from lvx_app.config import Config
from lvx_app.interrupts import ctrl_c_deferred
from lvx_app.version import __version__

app = new_app(
    "lvx",
    "Chat with hour-long videos in the terminal, the browser or through an OpenAI-compatible API:"
    " mPLUG-Owl3 or Llama-3.2-Vision with LV-XAttn distributed cross-attention.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lvx {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", help="Print lvx's version and exit.", is_eager=True, callback=_version
    ),
) -> None:
    """lvx: long-video question answering."""
    from lvx_app.warning_lines import install

    install()


@app.command()
def info(
    model: Optional[str] = typer.Option(
        None,
        "--model",
        help="Also say what this checkpoint (directory or hub id) is: its family, generation "
        "(mPLUG-Owl3: G1 gate form, projector), sizes.",
        metavar="DIR|HUB_ID",
    ),
) -> None:
    """Versions, devices, backends, the cache folder.

    With --model, what a checkpoint is: its release, prompt rules, sizes."""
    from lvx_app.cli.info import print_info

    raise typer.Exit(print_info(model))


@app.command()
@config_options("model", "video", "parallel", "generation")
def chat(
    video: Path = typer.Argument(..., help="Video file to chat about.", metavar="VIDEO"),
    *,
    config: Config,
) -> None:
    """Chat about a video in the terminal.

    Answers stream token by token; /help lists the chat's commands."""
    try:  # Ctrl-C while torch loads: exit quietly, like Ctrl-C anywhere before the chat starts
        # imported here: `lvx --help`, `lvx eval report` and the like start without torch
        with ctrl_c_deferred():
            from lvx_app.cli.chat import run_chat_command
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise typer.Exit(run_chat_command(str(video), config))


@app.command()
@config_options(
    "parallel",
    include=("gpus", "ranks"),
    helps={
        "ranks": "CPU ranks when there is no GPU or with --gpus 0. Default: 2, to show the "
        "frames sharded over ranks."
    },
)
def demo(
    workdir: Optional[Path] = typer.Option(
        None,
        "--workdir",
        help="Where to write the demo video and checkpoint. Default: demo in the cache folder "
        "($LVX_CACHE_DIR, else ~/.cache/lvx).",
        metavar="DIR",
    ),
    model_family: Optional[str] = typer.Option(
        None,
        "--model-family",
        help="Which model family's tiny checkpoint to write and run, by its name or id in any "
        "case: mPLUG-Owl3 (mplug_owl3), Llama-3.2-Vision (mllama) or OpenFlamingo (openflamingo), "
        "as `lvx info` lists them. Default: mPLUG-Owl3.",
        metavar="NAME",
    ),
    generation: Optional[str] = typer.Option(
        None,
        "--generation",
        help="Tiny checkpoint generation, one of the model family's (`lvx info --model` names a "
        "checkpoint's; a name it has not lists them). Default: its latest release's.",
        metavar="NAME",
    ),
    examples: Optional[Path] = typer.Option(
        None,
        "--examples",
        help="Also write small files to try every command on (a video with subtitles, a "
        "4-question Video-MME folder, a finetuning file) into DIR.",
        metavar="DIR",
    ),
    *,
    config: Config,
) -> None:
    """Try the whole pipeline, no download needed.

    A synthetic video and a tiny random-weight checkpoint in the family's published layout go
    through decode, encode, sharded visual tokens and LV-XAttn answers; then the paths made and
    ready-to-run lines for every command are printed."""
    from lvx_app.cli.demo import run_demo

    raise typer.Exit(
        run_demo(
            config, workdir=workdir, generation=generation, family=model_family, examples=examples
        )
    )


def _register_subcommands() -> None:
    from lvx_app.cli.cache import cache_app
    from lvx_app.cli.evaluate import eval_app
    from lvx_app.cli.finetune import finetune_command
    from lvx_app.cli.serve import serve_command

    app.add_typer(eval_app, name="eval", help="Batch evaluation (Video-MME).")
    app.add_typer(
        cache_app,
        name="cache",
        help="List or remove cached features, saved prompts and visual K/V.",
    )
    # short_help: the line `lvx --help` shows, whole at 80 columns
    app.command(
        "serve",
        short_help="The browser chat and an OpenAI-compatible API.",
        help="Chat with a video in the browser (Gradio) and serve an OpenAI-compatible API at /v1,"
        " both on the same worker group.",
    )(serve_command)
    app.command(
        "finetune",
        short_help="Finetune on video conversations (LV-XAttn).",
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
