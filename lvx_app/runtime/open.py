"""Open an engine for a frontend: one rank in this process (one GPU or CPU), more as a local
torchrun group, once it is known to fit the machine's memory (`fit`).

Every frontend (terminal chat, browser, Video-MME eval, demo, the Python API) starts its engine with
`open_engine` and closes it when done (`with open_engine(config) as engine: ...`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from rich.console import Console

from lvx_app.config import Config, ParallelConfig
from lvx_app.devices import usable_cores
from lvx_app.engine.records import EngineError, EngineWarning
from lvx_app.engine.session import RankSession
from lvx_app.parallel.world import World
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver
from lvx_app.runtime.engine_handle import Engine
from lvx_app.runtime.fit import refuse_what_does_not_fit
from lvx_app.runtime.launcher import RANK_ENTRY, RemoteEngine
from lvx_app.runtime.rank_main import set_up_rank


def resolve_world(parallel: ParallelConfig) -> World:
    """The ranks and GPUs --gpus / --ranks ask for on this machine, with errors that say what to
    do."""
    gpus, ranks = parallel.gpus, parallel.ranks
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
        return World(gpus, gpus)
    return World(ranks or 1, 0)


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
    world = resolve_world(config.parallel)
    refuse_what_does_not_fit(config.model.path, config.model.dtype, world)  # before any rank
    crowded = None if world.cuda else crowded_cores(world.ranks, usable_cores())
    if crowded:
        warnings.warn(crowded, EngineWarning, stacklevel=2)
    where = f"{world.ranks} {'GPU' if world.cuda else 'CPU'} rank(s)"
    spinner = console.status(f"loading {config.model.path} on {where} ...") if console else None
    with spinner or nullcontext():
        if world.ranks > 1:
            return RemoteEngine(config, world, entry=entry)
        info = set_up_rank(config, world)
        return GroupDriver(RankSession(config, info), ControlChannel(), config)
