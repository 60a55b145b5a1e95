"""Open an engine for a frontend: one rank in this process (one GPU or CPU), more as a local
torchrun group.

Every frontend (terminal chat, browser, Video-MME eval, demo) starts its engine with `open_engine`
and closes it when done, e.g. `with contextlib.closing(open_engine(config, gpus, ranks, console)) as
engine: ...`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, replace

import torch
from rich.console import Console

from lvx_app.attention.schedule import choose_schedule
from lvx_app.defaults import (
    DEFAULT_DECODE_TIMEOUT_S,
    DEFAULT_LAYOUT,
    DEFAULT_SUBTITLE_TOKENS,
    check_seconds,
)
from lvx_app.engine.api import Engine, EngineError
from lvx_app.engine.control import ControlChannel
from lvx_app.engine.driver import GroupDriver
from lvx_app.engine.launch import RemoteEngine
from lvx_app.engine.session import Session, SessionConfig
from lvx_app.parallel.group import init_distributed
from lvx_app.parallel.layout import check_layout


def resolve_world(gpus: int | None, ranks: int | None) -> tuple[int, bool]:
    """(number of ranks, use CUDA) from --gpus / --ranks, with errors that say what to do."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus is None:
        gpus = 1 if visible else 0
    if gpus < 0:
        raise EngineError("--gpus must be 0 (CPU) or a positive number of GPUs")
    if gpus > visible:
        found = f"only {visible} GPU(s) are visible" if visible else "no GPU is visible"
        raise EngineError(
            f"--gpus {gpus} asked for GPUs but {found}; use --gpus {visible} (0 runs on CPU ranks)"
        )
    if gpus > 0:
        if ranks not in (None, gpus):
            raise EngineError(
                "--ranks only applies to CPU runs (--gpus 0); with GPUs there is one rank per GPU"
            )
        return gpus, True
    ranks = ranks or 1
    if ranks < 1:
        raise EngineError("--ranks must be at least 1")
    return ranks, False


def session_config(
    *,
    model: str,
    revision: str | None,
    fps: float,
    max_frames: int | None,
    dtype: str,
    kv_cache: bool | None,
    timeout: float,
    use_cache: bool,
    cache_dir: str | None,
    decode_timeout: float = DEFAULT_DECODE_TIMEOUT_S,
    subtitle_tokens: int = DEFAULT_SUBTITLE_TOKENS,
    xattn_schedule: str = "auto",
    layout: str = DEFAULT_LAYOUT,
) -> SessionConfig:
    """The session settings from the command's options, checked (an EngineError names the bad
    option)."""
    kv_mode = "auto" if kv_cache is None else ("cache" if kv_cache else "recompute")
    try:
        check_seconds({"--timeout": timeout, "--decode-timeout": decode_timeout})
        choose_schedule(1, 1, xattn_schedule)  # an unknown --xattn-schedule names the choices
        check_layout(layout)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    if subtitle_tokens < 0:
        raise EngineError(
            f"--subtitle-tokens must be 0 (no subtitles) or more (got {subtitle_tokens})"
        )
    return SessionConfig(
        model=model,
        revision=revision,
        dtype=dtype,
        kv_mode=kv_mode,
        fps=fps,
        max_frames=max_frames,
        timeout_s=timeout,
        cache=use_cache,
        cache_dir=cache_dir,
        decode_timeout_s=decode_timeout,
        subtitle_tokens=subtitle_tokens,
        xattn_schedule=xattn_schedule,
        layout=layout,
    )


def open_engine(
    config: SessionConfig, gpus: int | None, ranks: int | None, console: Console | None = None
) -> Engine:
    """Start the model on the ranks --gpus / --ranks ask for (with a spinner on `console`); the
    caller closes it.

    `config` is not changed: the ranks get a copy that says whether they use CUDA."""
    nproc, cuda = resolve_world(gpus, ranks)
    config = replace(config, cuda=cuda)
    where = f"{nproc} GPU rank(s)" if cuda else f"{nproc} CPU rank(s)"
    with (
        console.status(f"loading {config.model} on {where} ...")
        if console is not None
        else nullcontext()
    ):
        if nproc > 1:
            return RemoteEngine(asdict(config), nproc, cuda=cuda)
        info = init_distributed(cuda=cuda, timeout_s=config.timeout_s)
        return GroupDriver(Session(config, info), ControlChannel())
