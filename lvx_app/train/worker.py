"""One rank of `lvx finetune`: `python -m lvx_app.train.worker --config JSON` (under torchrun, or
alone).

A module of its own, not imported by `lvx_app.train`, so `python -m` runs it without runpy's warning
about a module already imported by its package.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from lvx_app.parallel.group import init_distributed, run_rank
from lvx_app.train.loop import TrainConfig, run_training
from lvx_app.video.errors import VideoError
from lvx_models.mplug_owl3.checkpoint import CheckpointError


def user_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message says what to do (bad data, video or checkpoint): one line, no
    traceback."""
    return (ValueError, FileNotFoundError, VideoError, CheckpointError)


def main(argv: Optional[list[str]] = None) -> int:
    """Run one rank of the finetuning group described by --config (a TrainConfig as JSON)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    args = parser.parse_args(argv)
    cfg = TrainConfig(**json.loads(args.config))

    def work() -> None:
        info = init_distributed(cuda=cfg.cuda, timeout_s=cfg.timeout_s)
        run_training(cfg, info.device)

    return run_rank(work, "lvx finetune", user_errors=user_errors(), finish_together=True)


if __name__ == "__main__":
    sys.exit(main())
