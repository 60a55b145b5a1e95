"""Open an engine for a command and always close it, with errors as one line."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.console import Console

from lvx_app.cli_options import check_seconds
from lvx_app.defaults import DEFAULT_DECODE_TIMEOUT_S
from lvx_app.engine.api import Engine, EngineError, GenerationParams
from lvx_app.engine.factory import open_engine, resolve_world
from lvx_app.engine.session import SessionConfig


@contextmanager
def engine_for(config: SessionConfig, gpus: int | None, ranks: int | None, console: Console) -> Iterator[Engine]:
    """Start the model on the requested ranks (with a spinner) and shut the group down afterwards."""
    nproc, cuda = resolve_world(gpus, ranks)
    where = f"{nproc} GPU rank(s)" if cuda else f"{nproc} CPU rank(s)"
    with console.status(f"loading {config.model} on {where} ..."):
        engine = open_engine(config, nproc, cuda)
    try:
        yield engine
    finally:
        engine.close()


def session_config(
    *, model: str, revision: str | None, fps: float, max_frames: int | None, dtype: str, kv_cache: bool | None,
    timeout: float, use_cache: bool, cache_dir: str | None, decode_timeout: float = DEFAULT_DECODE_TIMEOUT_S,
) -> SessionConfig:  # fmt: skip
    kv_mode = "auto" if kv_cache is None else ("cache" if kv_cache else "recompute")
    try:
        check_seconds({"--timeout": timeout, "--decode-timeout": decode_timeout})
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    return SessionConfig(
        model=model, revision=revision, dtype=dtype, kv_mode=kv_mode, fps=fps, max_frames=max_frames,
        timeout_s=timeout, cache=use_cache, cache_dir=cache_dir, decode_timeout_s=decode_timeout,
    )  # fmt: skip


def run_chat_command(
    *, video: str, gpus: int | None, ranks: int | None, params: GenerationParams, console: Console | None = None,
    **config_args,
) -> int:  # fmt: skip
    """`lvx chat`: returns the process exit code."""
    from lvx_app.engine.chat import run_chat
    from lvx_app.video import VideoError, check_video_path

    console = console or Console(highlight=False)
    try:
        config = session_config(**config_args)
        check_video_path(video)  # fail before spending minutes loading a model
    except (EngineError, VideoError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    try:
        with engine_for(config, gpus, ranks, console) as engine:
            return run_chat(engine, video=video, fps=config.fps, max_frames=config.max_frames, params=params,
                            console=console)  # fmt: skip
    except EngineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
