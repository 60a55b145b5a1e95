"""Start a finetuning run: in this process for one rank, else a local torchrun group; checks that
need no ranks come first, and the output folder is locked for the run's whole life.

The group's launcher (`python -m lvx_app.parallel.torchrun`, torch's own minus its failure
traceback) inherits the lock and dies with this process, its ranks with it. Several machines: run
`lvx finetune` itself under your torchrun (`lvx_app.cli.finetune` notices and runs as one rank).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from lvx_app.config import Config
from lvx_app.engine.records import EngineError
from lvx_app.parallel.lifeline import mark_launcher, stop_group
from lvx_app.parallel.torchrun import local_group
from lvx_app.parallel.world import World
from lvx_app.runtime.fit import refuse_what_does_not_fit
from lvx_app.runtime.open import resolve_world
from lvx_app.train.data import DataError, load_jsonl
from lvx_app.train.out_folder import STATE_FILE, discard_partial
from lvx_app.train.outlock import OutputBusy, check_out_is_not_model, lock_output, release_output

STOP_GRACE_S = 10.0  # after Ctrl-C, how long the ranks get to end a save before they are killed


class FinetuneError(RuntimeError):
    """A run that cannot start; its message says what to do."""


def check_run(config: Config) -> World:
    """The ranks the run gets, once the devices, the data and the output folder are checked:
    before anything is written."""
    t = config.train
    try:
        check_out_is_not_model(Path(t.out), config.model.path)
        world = resolve_world(config.parallel)
        # a lower bound (gradients and optimizer state come on top): refused before any rank
        refuse_what_does_not_fit(config.model.path, config.model.dtype, world)
        load_jsonl(t.data, t.video_dir)  # check the data before starting ranks
    except (EngineError, DataError, OutputBusy) as exc:
        raise FinetuneError(str(exc)) from None
    if t.resume and not (Path(t.out) / STATE_FILE).exists():
        raise FinetuneError(
            f"no {STATE_FILE} in {t.out} to resume from; run without --resume to start fresh"
        )
    return world


def lock_out(config: Config) -> int:
    """Hold `--out` for this run (one line naming the holder's pid if another run has it); returns
    the lock's fd."""
    out = Path(config.train.out)
    try:
        lock = lock_output(out)
    except OutputBusy as exc:
        raise FinetuneError(str(exc)) from None
    if not config.train.resume and (out / STATE_FILE).exists():
        os.close(lock)
        raise FinetuneError(
            f"{out} already holds a finetuning run; pass --resume to continue it, or choose "
            "another --out"
        )
    discard_partial(out)  # a save killed half-way (power cut, kill -9): this run holds the lock
    return lock


def release_out(config: Config, lock: int) -> None:
    """The run is over: `--out`'s lock file goes, and the lock with it."""
    release_output(Path(config.train.out), lock)


def run_group(config: Config, world: World, keep_fds: tuple[int, ...] = ()) -> int:
    """Run `config` on the local torchrun ranks of `world`; returns the launcher's exit code (1: it
    printed the line naming the rank that failed first; 130: stopped by Ctrl-C or SIGTERM).

    The launcher runs in a session of its own, so Ctrl-C reaches it from here only: it gets
    `STOP_GRACE_S` to stop its ranks, then it and every rank are killed, as `lvx chat` does."""
    entry = ["-m", "lvx_app.train.train_rank", "--config", json.dumps(config.to_dict())]
    cmd, env = local_group(world, [*entry, "--world", json.dumps(world.to_dict())])
    proc = subprocess.Popen(cmd, env=mark_launcher(env), pass_fds=keep_fds, start_new_session=True)
    try:
        proc.wait()
    except KeyboardInterrupt:
        stop_group(proc, STOP_GRACE_S)
        return 130
    return proc.returncode
