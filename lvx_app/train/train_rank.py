"""One rank of `lvx finetune`: `python -m lvx_app.train.train_rank --config JSON --world JSON` (the
`Config` as `Config.to_dict` writes it, the `World` the launcher resolved), under torchrun or alone.

A module of its own, not imported by `lvx_app.train`, so `python -m` runs it without runpy's warning
about a module already imported by its package.
"""

from __future__ import annotations

import sys
from typing import Optional

from lvx_app.config import Config
from lvx_app.parallel.group import run_rank
from lvx_app.parallel.world import World
from lvx_app.runtime.rank_main import rank_arguments, set_up_rank
from lvx_app.train.loop import run_training
from lvx_app.video.errors import VideoError
from lvx_models.api import CheckpointError


def user_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message says what to do (bad data, video or checkpoint): one line, no
    traceback."""
    return (ValueError, FileNotFoundError, VideoError, CheckpointError)


def train_as_rank(config: Config, world: World | None = None) -> None:
    """Join the group torchrun described (or run alone) and train; `world`: the one the launcher
    resolved (by default the one torchrun describes)."""
    info = set_up_rank(config, world or World.of_torchrun(config.parallel.gpus))
    run_training(config, info.device)


def main(argv: Optional[list[str]] = None) -> int:
    """Run one rank of the finetuning group described by --config and --world."""
    given = rank_arguments(argv, __doc__)
    if given is None:
        return 2
    config, world = given
    return run_rank(
        lambda: train_as_rank(config, world),
        "lvx finetune",
        user_errors=user_errors(),
        finish_together=True,
    )


if __name__ == "__main__":
    sys.exit(main())
