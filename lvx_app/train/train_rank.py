"""One rank of `lvx finetune`: `python -m lvx_app.train.train_rank --config JSON` (the `Config` as
`Config.to_dict` writes it), under torchrun or alone.

A module of its own, not imported by `lvx_app.train`, so `python -m` runs it without runpy's warning
about a module already imported by its package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from lvx_app.config import Config, ConfigError
from lvx_app.parallel.group import init_distributed, run_rank
from lvx_app.train.loop import run_training
from lvx_app.video.errors import VideoError
from lvx_models.mplug_owl3.checkpoint import CheckpointError


def user_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message says what to do (bad data, video or checkpoint): one line, no
    traceback."""
    return (ValueError, FileNotFoundError, VideoError, CheckpointError)


def train_as_rank(config: Config) -> None:
    """Join the group torchrun described (or run alone) and train."""
    info = init_distributed(cuda=config.parallel.cuda, timeout_s=config.parallel.timeout_s)
    run_training(config, info.device)


def main(argv: Optional[list[str]] = None) -> int:
    """Run one rank of the finetuning group described by --config."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="the Config as JSON")
    args = parser.parse_args(argv)
    try:
        config = Config.from_dict(json.loads(args.config))
    except (ValueError, ConfigError) as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: --config: {exc}", file=sys.stderr)
        return 2
    return run_rank(
        lambda: train_as_rank(config),
        "lvx finetune",
        user_errors=user_errors(),
        finish_together=True,
    )


if __name__ == "__main__":
    sys.exit(main())
