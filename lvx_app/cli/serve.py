"""`lvx serve`: the browser chat (Gradio) in front of the same engine as `lvx chat`."""

from __future__ import annotations

import os

import typer

from lvx_app.cli.options import config_options, fail
from lvx_app.config import Config


@config_options(
    "model",
    "video",
    "parallel",
    "generation",
    "serve",
    exclude=("subtitle_lang", "subtitle_encoding", "seed"),
)
def serve_command(*, config: Config) -> None:
    """Chat about videos in the browser.

    The Gradio page runs on the same engine as `lvx chat`; its fps, max frames, subtitles and max
    new tokens start at the options' values, and so do the API's."""
    if config.serve.api_key is None and os.environ.get("LVX_API_KEY") == "":
        raise fail(  # an empty variable is no key: never serve without one silently
            "LVX_API_KEY is set but empty (an unset variable?): give the key, or unset LVX_API_KEY "
            "to serve without one"
        )
    # imported here: the CLI registers this command without loading torch or gradio
    from lvx_ui.server import run_serve

    raise typer.Exit(run_serve(config))
