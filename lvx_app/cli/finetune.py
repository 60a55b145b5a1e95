"""`lvx finetune`: a thin typer command over `lvx_app.train` (the CLI registers `finetune_command`).

One rank runs in this process; more run as a local torchrun group (`lvx_app.train.launch`). Several
machines: run this same command under your own `torchrun --nnodes ... --rdzv-endpoint ...`; each
process is then one rank of that group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from lvx_app.cli.options import config_options, fail
from lvx_app.config import Config

if TYPE_CHECKING:
    from lvx_app.parallel.world import World


def _interrupted(out: str) -> int:
    typer.secho(
        f"interrupted: the last checkpoint in {out} (every --save-every steps) is kept; rerun with"
        " --resume to continue from it",
        err=True,
        fg="yellow",
    )
    return 130


@config_options(
    "model",
    "video",
    "parallel",
    "train",
    include=(
        *("path", "dtype", "attn_backend", "fps", "max_frames", "cache_dir", "decode_timeout_s"),
        *("gpus", "ranks", "layout", "timeout_s", "data", "out", "video_dir", "mode", "lora_rank"),
        *("recompute", "checkpoint_lm", "lr", "steps", "save_every", "resume", "seed"),
    ),
    defaults={"timeout_s": 600.0},
)
def finetune_command(*, config: Config) -> None:
    """Finetune on video conversations.

    LV-XAttn in forward and backward; with --recompute (the default) each hyper layer's visual K/V
    are recomputed in backward from one copy of the features."""
    # imported here: the CLI registers this command without loading torch
    from lvx_app.cli.chat import under_torchrun
    from lvx_app.train.launch import FinetuneError, check_run, lock_out, release_out, run_group
    from lvx_app.train.train_rank import train_as_rank, user_errors

    if under_torchrun():  # one rank of a group the user started
        from lvx_app.parallel.group import run_rank

        done = run_rank(lambda: train_as_rank(config), "lvx finetune", user_errors=user_errors())
        raise typer.Exit(done or 0)
    try:
        world = check_run(config)
        lock = lock_out(config)
    except FinetuneError as exc:
        raise fail(str(exc)) from None
    try:
        alone = world.ranks == 1
        code = _run_alone(config, world) if alone else run_group(config, world, keep_fds=(lock,))
    finally:
        release_out(config, lock)
    out = config.train.out
    if code == 130:
        code = _interrupted(out)
    elif code not in (0, 1):  # 1: the launcher printed the line naming the rank that failed first
        typer.secho(f"error: the finetuning group failed (exit {code})", err=True, fg="red")
    if code:
        raise typer.Exit(code)
    typer.echo(
        f"saved {out} (load it with: lvx chat VIDEO --model {out}); loss curve: {out}/loss.png"
    )


def _run_alone(config: Config, world: World) -> int:
    """One rank, in this process; returns the exit code."""
    from lvx_app.parallel.group import destroy_distributed
    from lvx_app.train.train_rank import train_as_rank, user_errors

    try:
        train_as_rank(config, world)
    except user_errors() as exc:
        typer.secho(f"error: {exc}", err=True, fg="red")
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        destroy_distributed()
    return 0
