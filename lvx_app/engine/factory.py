"""Choose how to run: in this process (one GPU or CPU) or as a torchrun group."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lvx_app.engine.api import Engine, EngineError


def resolve_world(gpus: int | None, ranks: int | None) -> tuple[int, bool]:
    """(number of ranks, use CUDA) from --gpus / --ranks, with errors that say what to do."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus is None:
        gpus = 1 if visible else 0
    if gpus < 0:
        raise EngineError("--gpus must be 0 (CPU) or a positive number of GPUs")
    if gpus > visible:
        found = f"only {visible} GPU(s) are visible" if visible else "no GPU is visible"
        raise EngineError(f"--gpus {gpus} asked for GPUs but {found}; use --gpus {visible} (0 runs on CPU ranks)")
    if gpus > 0:
        if ranks not in (None, gpus):
            raise EngineError("--ranks only applies to CPU runs (--gpus 0); with GPUs there is one rank per GPU")
        return gpus, True
    ranks = ranks or 1
    if ranks < 1:
        raise EngineError("--ranks must be at least 1")
    return ranks, False


def open_engine(config: Any, nproc: int, cuda: bool, on_wait: Any = None) -> Engine:
    """An engine over `nproc` ranks; one rank runs here, more run under torchrun."""
    config.cuda = cuda
    if nproc > 1:
        from lvx_app.engine.launch import RemoteEngine

        return RemoteEngine(asdict(config), nproc, cuda=cuda, on_wait=on_wait)
    from lvx_app.parallel.group import init_distributed
    from lvx_app.engine.control import ControlChannel
    from lvx_app.engine.driver import GroupDriver
    from lvx_app.engine.session import Session

    info = init_distributed(cuda=cuda, timeout_s=config.timeout_s)
    return GroupDriver(Session(config, info), ControlChannel())
