"""`python -m lvx_app.parallel.torchrun ARGS`: torch's torchrun (same arguments) that ends a failed
group in one line.

torchrun ends a failed group with a Python traceback (ChildFailedError), a summary block and error
log lines, and the ranks that merely lost their peer print gloo tracebacks of their own. This runs
the same launcher, `torch.distributed.run.run`, with a run folder (`RUN_DIR_ENV`) where ranks
started through `lvx_app.parallel.group.run_rank` write their pid and error instead of printing
them, and prints one line naming the rank that failed first and why (`lvx_app.parallel.failures`,
the same choice `lvx chat` makes). The launcher dies with the launcher of ours that started it (when
that one set `LAUNCHER_PID_ENV`), and its ranks die with it (`lvx_app.parallel.lifeline`).
Exit codes: 0 when every rank succeeded (also when ranks that had all met in `run_rank`'s last
barrier crashed while exiting: a warning line says so), 1 when one failed, 130 when stopped by
Ctrl-C or SIGTERM.

`local_group` builds the command line (and environment) that starts a local group under it: the one
builder `lvx chat/serve/eval --gpus N` and `lvx finetune` use.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from lvx_app.devices import usable_cores
from lvx_app.parallel import failures
from lvx_app.parallel.failures import (
    FAILURE_PREFIX,
    RUN_DIR_ENV,
    RankFailure,
    error_file,
    first_failure,
)
from lvx_app.parallel.lifeline import LAUNCHER_PID_ENV, die_with_parent, mark_launcher
from lvx_app.parallel.run_dirs import RunDir
from lvx_app.parallel.world import World


def local_group(
    world: World, entry: Sequence[str], env: Mapping[str, str] = os.environ
) -> tuple[list[str], dict[str, str]]:
    """(command line, environment) that run `entry` (what follows `python`) on `world.ranks` ranks
    of this machine under this launcher; CPU ranks share the cores (OMP_NUM_THREADS, unless set)."""
    command = [
        *(sys.executable, "-m", "lvx_app.parallel.torchrun", "--standalone"),
        *(f"--nproc-per-node={world.ranks}", "--monitor-interval=0.5", *entry),
    ]
    env = dict(env)
    if not world.cuda:
        env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // world.ranks)))
    return command, env


def failure_line(exc: ChildFailedError, run_dir: Path) -> str:
    """'error: rank R failed: why' for the rank that failed first, pointing at its trace when it
    left one."""
    observed = sorted(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    chosen = first_failure(
        [RankFailure(rank, failure.exitcode) for rank, failure in observed], run_dir
    )
    if chosen is None:
        return f"{FAILURE_PREFIX}the worker group failed without naming a rank"
    failure, why = chosen
    own = error_file(run_dir, failure.rank)
    trace = (
        f" (trace: {own})"
        if own.exists() and len(own.read_text(errors="replace").strip().splitlines()) > 1
        else ""
    )
    return f"{FAILURE_PREFIX}rank {failure.rank} failed: {why}{trace}"


def main(argv: Optional[list[str]] = None) -> int:
    if os.environ.get(
        LAUNCHER_PID_ENV
    ):  # started by a launcher of ours that asked us to die with it
        die_with_parent()
    args = get_args_parser().parse_args(argv)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    given = os.environ.get(RUN_DIR_ENV)
    own = None if given else RunDir()  # a launcher of ours that gave one removes it itself
    run_dir = Path(given) if given else own.path
    os.environ[RUN_DIR_ENV] = str(run_dir)
    if args.log_dir is None:  # torchrun's own logs go with the run, not to a folder of their own
        args.log_dir = str(run_dir / "torchelastic")
    mark_launcher()
    code = _run(args, run_dir)
    if own is not None:
        own.close(keep=code == 1)  # kept only when a rank failed: its trace is there
    return code


def _run(args, run_dir: Path) -> int:
    try:
        run(args)
    except ChildFailedError as exc:
        ranks = [RankFailure(rank, f.exitcode) for rank, f in sorted(exc.failures.items())]
        if failures.crashed_after_done(
            ranks, run_dir
        ):  # the work is complete; say what happened, do not fail the run
            print(
                f"warning: {failures.describe_failures(ranks, run_dir)} while exiting, after every "
                "rank had finished "
                f"its work; nothing was lost",
                file=sys.stderr,
            )
            return 0
        print(failure_line(exc, run_dir), file=sys.stderr)
        return 1
    except SignalException:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
