"""lvx: chat with hour-long videos using mPLUG-Owl3 or Llama-3.2-Vision and LV-XAttn.

import lvx_app as lvx

with lvx.open("mPLUG/mPLUG-Owl3-7B-241101", gpus=8) as engine:
    engine.load_video("movie.mp4", fps=1)
    for piece in engine.ask("What happens after the storm?"):
        print(piece, end="")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lvx_app.version import __version__

__all__ = ["__version__", "open"]

if TYPE_CHECKING:
    from lvx_app.runtime.engine_handle import Engine


def open(model: str, **options: Any) -> Engine:  # noqa: A001 - the API's verb, as in lvx.open
    """Load `model` (a checkpoint folder or hub id) on the ranks the options ask for and return its
    `Engine`; close it when done (it is a context manager).

    `options` are the command line's, by field name: `gpus`, `ranks`, `dtype`, `fps`, `max_frames`,
    `kv_mode`, `cache_dir`, `layout`, `max_new_tokens`, `temperature`, ... (`lvx_app.config`). A bad
    name or value raises `lvx_app.config.ConfigError`; a model or device problem `EngineError`.
    `engine.load_video(path, ...)` and `engine.ask(question, ...)` take the video and generation
    options again for one call (`kv_mode="recompute"`, `subtitles="none"`, `max_new_tokens=64`);
    each is honoured, or refused in one `EngineError` line.
    """
    # imported here: `import lvx_app` (and the CLI's start) stays free of torch
    from lvx_app.config import Config
    from lvx_app.runtime.open import open_engine

    return open_engine(Config.from_options(model=model, **options))
