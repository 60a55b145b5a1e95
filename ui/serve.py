"""`lvx serve`: open the engine once, put the browser chat in front of it, close the engine on
exit."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from lvx_app.engine.api import EngineError, GenerationParams
from lvx_app.engine.open import open_engine
from lvx_app.engine.session import SessionConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_auth(auth: str | None) -> tuple[str, str] | None:
    """`user:pass` -> (user, pass); the password may itself contain colons."""
    if not auth:
        return None
    user, sep, password = auth.partition(":")
    if not sep or not user or not password:
        raise EngineError("--auth takes user:password, for example --auth alice:s3cret")
    return user, password


def check_allow_paths(paths: Sequence[str] | None) -> list[str]:
    out = []
    for p in paths or []:
        path = Path(p).expanduser()
        if not path.is_dir():
            raise EngineError(
                f"--allow-paths {p} is not a directory; name a folder that holds your videos"
            )
        out.append(str(path.resolve()))
    return out


def _stop_on_sigterm() -> None:
    """SIGTERM ends Gradio's wait loop like Ctrl-C does, so the engine is closed and the group shut
    down."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run_serve(
    *,
    config: SessionConfig,
    gpus: int | None,
    ranks: int | None,
    host: str = "127.0.0.1",
    port: int = 7860,
    allow_paths: Sequence[str] | None = None,
    max_upload_mb: float = 4096,
    auth: str | None = None,
    share: bool = False,
    params: GenerationParams = GenerationParams(),
    queue_size: int = 8,
    console: Console | None = None,
) -> int:
    # long: to be split: it mixes several steps
    """Serve until Ctrl-C or SIGTERM; returns the process exit code."""
    console = console or Console(highlight=False)
    try:
        credentials = parse_auth(auth)
        folders = check_allow_paths(allow_paths)
        if max_upload_mb <= 0:
            raise EngineError("--max-upload-mb must be above 0")
        _stop_on_sigterm()
        engine = open_engine(config, gpus, ranks, console)
        close = engine.close
        try:
            from lvx_ui.app import (
                build_app,
            )  # gradio takes seconds to import: bad options fail before it

            demo = build_app(
                engine,
                allow_paths=folders,
                max_upload_mb=max_upload_mb,
                default_fps=config.fps,
                default_max_frames=config.max_frames,
                params=params,
                reopen=lambda: open_engine(config, gpus, ranks),
            )
            # the engine the page holds now: a dead group is replaced by a fresh one
            close = demo.lvx_close
            demo.queue(max_size=queue_size, default_concurrency_limit=1)
            if host not in LOOPBACK and credentials is None:
                console.print(
                    f"[yellow]warning:[/yellow] serving on {host} without --auth; anyone who can "
                    "reach "
                    "this port can use the model and read the allowed folders"
                )
            _, url, share_url = demo.launch(
                server_name=host,
                server_port=port,
                share=share,
                auth=credentials,
                show_error=True,
                quiet=True,
                prevent_thread_lock=True,
                ssr_mode=False,
                footer_links=[],
                **demo.lvx_launch,
            )
            console.print(
                f"lvx serve: ready on {url}" + (f" (public: {share_url})" if share_url else "")
            )
            console.print("[dim]Ctrl-C stops the server and the worker group.[/dim]")
            try:
                demo.block_thread()
            finally:
                demo.close()
        finally:
            close()
        return 0
    except EngineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the model was still loading
        console.print("stopped")
        return 130
    except OSError as exc:  # e.g. the port is taken
        console.print(f"[red]error:[/red] {exc}; pick another --port")
        return 2
