"""`lvx serve`, as a typer-ready function; the CLI registers it with
`app.command("serve")(serve_command)`.

The options it shares with `lvx chat` come from `lvx_app.cli_options`.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from lvx_app import cli_options as opt


def serve_command(
    gpus: Optional[int] = opt.GPUS,
    ranks: Optional[int] = opt.RANKS,
    model: str = opt.MODEL,
    revision: Optional[str] = opt.REVISION,
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to bind; other machines can connect only if you change it (then use --auth).",
    ),
    port: int = typer.Option(7860, "--port", help="Port to serve on."),
    allow_paths: Optional[List[Path]] = typer.Option(
        None,
        "--allow-paths",
        help="Folder whose videos may be opened by path instead of uploaded (repeatable).",
    ),
    max_upload_mb: float = typer.Option(
        4096.0, "--max-upload-mb", help="Largest upload accepted, in MB."
    ),
    auth: Optional[str] = typer.Option(
        None, "--auth", help="Require a login, given as user:password."
    ),
    share: bool = typer.Option(
        False, "--share/--no-share", help="Also open a public Gradio share link (off by default)."
    ),
    fps: float = typer.Option(
        1.0, "--fps", help="Default frames sampled per second of video (changeable in the page)."
    ),
    max_frames: Optional[int] = typer.Option(
        None, "--max-frames", help="Default cap on frames (changeable in the page)."
    ),
    max_new_tokens: int = opt.MAX_NEW_TOKENS,
    temperature: float = opt.TEMPERATURE,
    top_p: float = opt.TOP_P,
    dtype: str = opt.DTYPE,
    kv_cache: Optional[bool] = opt.KV,
    xattn_schedule: str = opt.XATTN_SCHEDULE,
    layout: str = opt.LAYOUT,
    timeout: float = opt.TIMEOUT,
    decode_timeout: float = opt.DECODE_TIMEOUT,
    queue_size: int = typer.Option(
        8, "--queue-size", help="Requests that may wait for the model; more are turned away."
    ),
    no_cache: bool = opt.NO_CACHE,
    cache_dir: Optional[Path] = opt.CACHE_DIR,
    subtitle_tokens: int = opt.SUBTITLE_TOKENS,
) -> None:
    # long: to be split: it mixes several steps
    """Chat about videos in the browser (Gradio), on the same engine as `lvx chat`."""
    # imported here, not at the top: the CLI registers this command without loading torch or gradio
    from lvx_app.engine.api import EngineError, GenerationParams
    from lvx_app.engine.open import session_config
    from lvx_ui.serve import run_serve

    try:
        config = session_config(
            model=model,
            revision=revision,
            fps=fps,
            max_frames=max_frames,
            dtype=dtype,
            kv_cache=kv_cache,
            timeout=timeout,
            use_cache=not no_cache,
            cache_dir=str(cache_dir) if cache_dir else None,
            decode_timeout=decode_timeout,
            subtitle_tokens=subtitle_tokens,
            xattn_schedule=xattn_schedule,
            layout=layout,
        )
    except EngineError as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        raise typer.Exit(2) from None
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    code = run_serve(
        config=config,
        gpus=gpus,
        ranks=ranks,
        host=host,
        port=port,
        allow_paths=[str(p) for p in allow_paths or []],
        max_upload_mb=max_upload_mb,
        auth=auth,
        share=share,
        params=params,
        queue_size=queue_size,
    )
    raise typer.Exit(code)


if __name__ == "__main__":
    typer.run(serve_command)
