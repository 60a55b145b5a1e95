"""A server of the OpenAI-compatible API on an engine stand-in (no model), run as its own process
so its memory high-water mark (`VmHWM`) is the requests' alone: `python request_memory_server.py
FOLDER REQUEST_MB ALL_MB` prints its port, then serves until killed."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from test_service import StandIn

from lvx_app.config import Config
from lvx_app.runtime.service import EngineService
from lvx_ui.openai_request import VideoFiles
from lvx_ui.openai_routes import OpenAIApi
from lvx_ui.request_memory import MemoryLimits
from scripts.gloo_ranks import free_port


class Answers(StandIn):
    """The stand-in answering a whole conversation as it answers a question."""

    def chat(self, turns, **generation):
        return self.ask(turns[-1]["content"][-8:], **generation)

    def describe(self) -> dict:
        return {}


def main(folder: str, request_mb: str, all_mb: str) -> None:
    config = Config.from_options(model=folder)
    serve = replace(
        config.serve, request_memory_mb=float(request_mb), requests_memory_mb=float(all_mb)
    )
    config = replace(config, serve=serve)
    limits = MemoryLimits.of(serve)
    service = EngineService(Answers(), queue_size=serve.queue_size)
    files = VideoFiles([], limits.upload_mb, Path(folder) / "uploads")
    app = FastAPI()
    OpenAIApi(service, config, files, report=lambda line: print(line, flush=True)).mount(app)
    port = free_port()
    print(port, flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(*sys.argv[1:])
