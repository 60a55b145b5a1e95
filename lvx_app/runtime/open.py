"""Open an engine for a frontend: one rank in this process (one GPU or CPU), more as a local
torchrun group.

Every frontend (terminal chat, browser, Video-MME eval, demo, the Python API) starts its engine with
`open_engine` and closes it when done (`with open_engine(config) as engine: ...`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

import torch
from rich.console import Console

from lvx_app.config import Config
from lvx_app.devices import usable_cores
from lvx_app.engine.api import EngineError, EngineWarning
from lvx_app.engine.session import RankSession
from lvx_app.parallel.group import init_distributed
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver
from lvx_app.runtime.engine_handle import Engine
from lvx_app.runtime.launcher import RANK_ENTRY, RemoteEngine


def resolve_world(gpus: int | None, ranks: int | None) -> tuple[int, int]:
    """(number of ranks, GPUs used: 0 or the number of ranks) from --gpus / --ranks, with errors
    that say what to do."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus is None:
        gpus = 1 if visible else 0
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
        return gpus, gpus
    return ranks or 1, 0


def crowded_cores(ranks: int, cores: int) -> str | None:
    """The warning for more CPU ranks than cores: every rank loads its own copy of the model and
    they take turns on the cores, so the start takes long and every answer is slow."""
    if ranks <= cores:
        return None
    return (
        f"{ranks} CPU ranks on {cores} core(s): every rank loads the model and they take turns on "
        f"the cores, so starting takes long and answers are slow; use --ranks {cores} or fewer"
    )


def open_engine(
    config: Config, console: Console | None = None, entry: Sequence[str] = RANK_ENTRY
) -> Engine:
    """Start the model on the ranks `config.parallel` asks for (with a spinner on `console`); the
    caller closes it. `entry`: what each rank of a group runs (benchmarks pass their own)."""
    nproc, gpus = resolve_world(config.parallel.gpus, config.parallel.ranks)
    crowded = None if gpus else crowded_cores(nproc, usable_cores())
    if crowded:
        warnings.warn(crowded, EngineWarning, stacklevel=2)
    config = replace(config, parallel=replace(config.parallel, gpus=gpus, ranks=nproc))
    where = f"{nproc} GPU rank(s)" if gpus else f"{nproc} CPU rank(s)"
    spinner = console.status(f"loading {config.model.path} on {where} ...") if console else None
    with spinner or nullcontext():
        if nproc > 1:
            return RemoteEngine(config, nproc, entry=entry)
        info = init_distributed(cuda=bool(gpus), timeout_s=config.parallel.timeout_s)
        return GroupDriver(RankSession(config, info), ControlChannel(), config)
