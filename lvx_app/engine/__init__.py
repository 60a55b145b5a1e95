"""The engine: one video session held by a worker group, driven by a frontend.

Frontends (terminal chat, Gradio, Video-MME eval) open one with `lvx_app.engine.open.open_engine`
and talk to it as an `Engine`:
- `GroupDriver` runs on rank 0 and broadcasts each command to the other ranks;
  with world size 1 it is the whole in-process engine.
- `RemoteEngine` runs in the `lvx` process and forwards to rank 0 of a torchrun
  group over a local socket, so Ctrl-C in the terminal never reaches the group.
"""

from lvx_app.engine.api import (
    AnswerStats,
    Engine,
    EngineError,
    EngineWarning,
    GenerationParams,
    GroupFailed,
    VideoSummary,
)

__all__ = [
    "AnswerStats",
    "Engine",
    "EngineError",
    "EngineWarning",
    "GenerationParams",
    "GroupFailed",
    "VideoSummary",
]
