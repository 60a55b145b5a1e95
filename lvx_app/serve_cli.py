"""`lvx serve`, as a typer-ready function; the CLI registers it with `app.command("serve")(serve_command)`.

The options repeat `lvx chat`'s wording; they are declared here rather than
imported from `lvx_app.cli` so that importing this module never imports the
CLI that imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from lvx_app.engine.session import DEFAULT_MODEL


def serve_command(
    gpus: Optional[int] = typer.Option(
        None, "--gpus", help="GPUs to use, one rank each (default: 1 if a GPU is visible, else 0 = CPU)."
    ),
    ranks: Optional[int] = typer.Option(None, "--ranks", help="CPU ranks when --gpus 0 (gloo); default 1."),
    model: str = typer.Option(
        DEFAULT_MODEL, "--model", help="Local mPLUG-Owl3 checkpoint directory or Hugging Face hub id."
    ),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; other machines can connect only if you "
                             "change it (then use --auth)."),  # fmt: skip
    port: int = typer.Option(7860, "--port", help="Port to serve on."),
    allow_paths: Optional[List[Path]] = typer.Option(
        None, "--allow-paths", help="Folder whose videos may be opened by path instead of uploaded (repeatable)."
    ),
    max_upload_mb: float = typer.Option(4096.0, "--max-upload-mb", help="Largest upload accepted, in MB."),
    auth: Optional[str] = typer.Option(None, "--auth", help="Require a login, given as user:password."),
    share: bool = typer.Option(
        False, "--share/--no-share", help="Also open a public Gradio share link (off by default)."
    ),
    fps: float = typer.Option(
        1.0, "--fps", help="Default frames sampled per second of video (changeable in the page)."
    ),
    max_frames: Optional[int] = typer.Option(
        None, "--max-frames", help="Default cap on frames (changeable in the page)."
    ),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Default longest answer, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (reproducible)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass when --temperature > 0."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16."
    ),
    kv_cache: Optional[bool] = typer.Option(
        None, "--kv-cache/--recompute-kv",
        help="Keep each hyper layer's visual K/V resident, or recompute them from one copy of the features "
        "per turn (less memory). Default: cache when it fits.",
    ),  # fmt: skip
    timeout: float = typer.Option(
        300.0, "--timeout", help="Seconds a rank waits for a dead or hung peer before the group stops."
    ),
    queue_size: int = typer.Option(
        8, "--queue-size", help="Requests that may wait for the model; more are turned away."
    ),
    no_cache: bool = typer.Option(False, "--no-cache", help="Do not read or write the visual-feature cache."),
    cache_dir: Optional[Path] = typer.Option(
        None, "--cache-dir", help="Feature cache folder (default ~/.cache/lvx or $LVX_CACHE_DIR)."
    ),
) -> None:
    """Chat about videos in the browser (Gradio), on the same engine as `lvx chat`."""
    from lvx_app.engine.api import GenerationParams
    from lvx_app.engine.runner import session_config
    from ui.serve import run_serve

    config = session_config(
        model=model, revision=revision, fps=fps, max_frames=max_frames, dtype=dtype, kv_cache=kv_cache,
        timeout=timeout, use_cache=not no_cache, cache_dir=str(cache_dir) if cache_dir else None,
    )  # fmt: skip
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    code = run_serve(
        config=config, gpus=gpus, ranks=ranks, host=host, port=port,
        allow_paths=[str(p) for p in allow_paths or []], max_upload_mb=max_upload_mb, auth=auth, share=share,
        params=params, queue_size=queue_size,
    )  # fmt: skip
    raise typer.Exit(code)


if __name__ == "__main__":
    typer.run(serve_command)
