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
import sys
from dataclasses import replace
from pathlib import Path

from lvx_app.config import Config
from lvx_app.engine.api import EngineError
from lvx_app.parallel.lifeline import mark_launcher
from lvx_app.runtime.open import resolve_world
from lvx_app.train.data import DataError, load_jsonl
from lvx_app.train.outlock import OutputBusy, check_out_is_not_model, lock_output
from lvx_app.train.saving import STATE_FILE


class FinetuneError(RuntimeError):
    """A run that cannot start; its message says what to do."""


def check_run(config: Config) -> tuple[Config, int]:
    """(the config with the device choice resolved, ranks), once the devices, the data and the
    output folder are checked: before anything is written."""
    t = config.train
    try:
        check_out_is_not_model(Path(t.out), config.model.path)
        world, gpus = resolve_world(config.parallel.gpus, config.parallel.ranks)
        load_jsonl(t.data, t.video_dir)  # check the data before starting ranks
    except (EngineError, DataError, OutputBusy) as exc:
        raise FinetuneError(str(exc)) from None
    if t.resume and not (Path(t.out) / STATE_FILE).exists():
        raise FinetuneError(
            f"no {STATE_FILE} in {t.out} to resume from; run without --resume to start fresh"
        )
    parallel = replace(config.parallel, gpus=gpus, ranks=world)
    return replace(config, parallel=parallel), world


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
    return lock


def run_group(config: Config, world: int, keep_fds: tuple[int, ...] = ()) -> int:
    """Run `config` on `world` local torchrun ranks; returns the launcher's exit code (1: it printed
    the line naming the rank that failed first; 130: stopped by Ctrl-C or SIGTERM)."""
    env = dict(os.environ)
    if not config.parallel.cuda:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    cmd = [
        *(sys.executable, "-m", "lvx_app.parallel.torchrun", "--standalone"),
        *(f"--nproc-per-node={world}", "--monitor-interval=0.5"),
        *("-m", "lvx_app.train.train_rank", "--config", json.dumps(config.to_dict())),
    ]
    proc = subprocess.Popen(cmd, env=mark_launcher(env), pass_fds=keep_fds)
    try:
        proc.wait()
    except KeyboardInterrupt:  # the group got the same Ctrl-C; let torchrun stop its ranks
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 130
    return proc.returncode
