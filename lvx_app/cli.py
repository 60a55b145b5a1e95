"""The `lvx` command line. Commands stay thin: the work lives in importable modules."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lvx_app import cli_options as opt
from lvx_app.interrupts import ctrl_c_deferred

app = opt.new_app(
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
    from lvx_app.info import print_info

    raise typer.Exit(print_info(model))


@app.command()
def chat(
    video: Path = typer.Argument(..., help="Video file to chat about."),
    model: str = opt.MODEL,
    revision: Optional[str] = opt.REVISION,
    fps: float = opt.FPS,
    max_frames: Optional[int] = opt.MAX_FRAMES,
    gpus: Optional[int] = opt.GPUS,
    ranks: Optional[int] = opt.RANKS,
    dtype: str = opt.DTYPE,
    kv_cache: Optional[bool] = opt.KV,
    xattn_schedule: str = opt.XATTN_SCHEDULE,
    layout: str = opt.LAYOUT,
    max_new_tokens: int = opt.MAX_NEW_TOKENS,
    temperature: float = opt.TEMPERATURE,
    top_p: float = opt.TOP_P,
    timeout: float = opt.TIMEOUT,
    decode_timeout: float = opt.DECODE_TIMEOUT,
    no_cache: bool = opt.NO_CACHE,
    cache_dir: Optional[Path] = opt.CACHE_DIR,
    subtitles: str = opt.SUBTITLES,
    subtitle_lang: Optional[str] = opt.SUBTITLE_LANG,
    subtitle_encoding: Optional[str] = opt.SUBTITLE_ENCODING,
    subtitle_tokens: int = opt.SUBTITLE_TOKENS,
) -> None:
    """Chat about a video in the terminal; answers stream token by token."""
    try:  # Ctrl-C while torch loads: exit quietly, like Ctrl-C anywhere else before the chat starts
        # imported here, not at the top: `lvx --help`, `lvx eval report` and the like start without
        # torch
        with ctrl_c_deferred():
            from lvx_app.engine.api import GenerationParams
            from lvx_app.frontends.terminal import run_chat_command
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    code = run_chat_command(
        video=str(video),
        model=model,
        revision=revision,
        fps=fps,
        max_frames=max_frames,
        gpus=gpus,
        ranks=ranks,
        dtype=dtype,
        kv_cache=kv_cache,
        params=params,
        timeout=timeout,
        use_cache=not no_cache,
        cache_dir=str(cache_dir) if cache_dir else None,
        decode_timeout=decode_timeout,
        subtitles=subtitles,
        subtitle_lang=subtitle_lang,
        subtitle_encoding=subtitle_encoding,
        subtitle_tokens=subtitle_tokens,
        xattn_schedule=xattn_schedule,
        layout=layout,
    )
    raise typer.Exit(code)


@app.command()
def demo(
    gpus: Optional[int] = opt.GPUS,
    ranks: Optional[int] = typer.Option(
        None, "--ranks", help="CPU ranks when there is no GPU (default 2)."
    ),
    workdir: Optional[Path] = typer.Option(
        None, "--workdir", help="Where to write the demo video and checkpoint."
    ),
    generation: str = typer.Option(
        "g2",
        "--generation",
        help="Tiny checkpoint generation: g2 (7B-241101, fused), g1 "
        "(241014, constant gate) or g1-gateproj (7B-240728, input-dependent gate).",
    ),
) -> None:
    """Run the whole pipeline on a synthetic video with a tiny random-weight model (no
    downloads)."""
    from lvx_app.demo import run_demo

    raise typer.Exit(run_demo(gpus=gpus, ranks=ranks, workdir=workdir, generation=generation))


def _register_subcommands() -> None:
    from lvx_app.eval.cli import eval_app
    from lvx_app.serve_cli import serve_command
    from lvx_app.train.cli import finetune_command
    from lvx_app.video.cache_cli import cache_app

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
