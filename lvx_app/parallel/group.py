"""Process-group helpers: torchrun env or an in-process world of one.

Everything above this module asks `get_rank(group)` / `get_world_size(group)` and works unchanged
whether torch.distributed is initialised or not.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import sys
import traceback
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lvx_app.defaults import DEFAULT_TIMEOUT_S
from lvx_app.parallel.failures import RUN_DIR_ENV, done_file, error_file, pid_file
from lvx_app.parallel.lifeline import die_with_parent


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the worker group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when running in-process with world size 1


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when a process group exists and has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group)
    return 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if is_distributed(group):
        dist.barrier(group)


def _pick_device(local_rank: int, want_cuda: bool | None) -> torch.device:
    use_cuda = torch.cuda.is_available() if want_cuda is None else want_cuda
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CUDA was requested but no GPU is visible; run with --gpus 0 for CPU ranks."
            )
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# torch's flight recorder: the names it reads its size from, the first one set winning
FLIGHT_RECORDER_SIZE_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def flight_recorder_off_unless_asked(env: MutableMapping[str, str]) -> None:
    """Turn torch's flight recorder off unless the user sized it. By default it keeps the last
    2,000 collectives of the process, each with the Python stack that called it: host work on
    every collective of every decoded token, and megabytes of a rank's memory that a long-running
    server never uses (a user debugging a hang sets `TORCH_FR_BUFFER_SIZE` and gets it back)."""
    if not any(name in env for name in FLIGHT_RECORDER_SIZE_ENV):
        env[FLIGHT_RECORDER_SIZE_ENV[0]] = "0"


def init_distributed(
    *, cuda: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None
) -> DistInfo:
    """Join the group torchrun described in the environment, or run as a world of one.

    NCCL on CUDA, gloo on CPU. The timeout bounds how long a collective waits for a dead or hung
    peer before the group is torn down with an error.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(local_rank, cuda)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistInfo(0, 1, 0, device, None)
    if not dist.is_initialized():
        flight_recorder_off_unless_asked(os.environ)
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        kwargs = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            rank=rank,
            world_size=world_size,
            **kwargs,
        )
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


def destroy_distributed() -> None:
    """Tear the process groups down, after collecting garbage: objects that hold a group (DDP,
    attention hooks) die while the group and the interpreter are still whole, not during interpreter
    shutdown."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _print_stack_on_crash() -> None:
    """A fatal signal (SIGABRT, SIGSEGV) prints the Python stack to stderr, when stderr is a real
    file."""
    try:
        faulthandler.enable()
    except (
        ValueError,
        OSError,
        AttributeError,
    ):  # stderr replaced by an object without a file descriptor
        pass


def run_rank(
    work: Callable[[], Optional[int]],
    label: str,
    record: Optional[Callable[[str], None]] = None,
    user_errors: tuple[type[BaseException], ...] = (),
    finish_together: bool = False,
) -> int:
    # long: every way a rank can end, each with its exit code
    """Run one rank's `work` as a process entry point and return its exit code (the code `work`
    returns, else 0).

    The rank dies with its launcher (`die_with_parent`). A failure prints one readable line naming
    the rank (`label rank R: Error: message`) before the trace; for `user_errors` (a bad video, a
    bad checkpoint: the message says what to do) that line is all. `record` also gets the trace (the
    engine writes it to a file its launcher reads). Under `lvx_app.parallel.torchrun` (`RUN_DIR_ENV`
    set, no `record`) the rank writes its pid and error to the run folder and prints nothing: that
    launcher prints one line for the whole group, naming the rank that failed first. Ctrl-C exits
    quietly with 130. The process group is torn down either way. A clean `SystemExit` passes
    through.

    With `finish_together` (ranks that all return at the end of the same work, as finetuning's do)
    the ranks meet in a last barrier and each then writes `done_file`: a crash while tearing down
    after that (gloo has aborted a rank in its exit path) cannot lose work, and the launcher says so
    instead of failing the run. A fatal signal prints the rank's Python stack (faulthandler), so
    such a crash says where it happened.
    """
    from lvx_app.warning_lines import install

    install()
    die_with_parent()
    _print_stack_on_crash()
    rank, run_dir = int(os.environ.get("RANK", "0")), os.environ.get(RUN_DIR_ENV)
    quiet = record is None and bool(run_dir)
    if run_dir:
        pid_file(run_dir, rank).write_text(str(os.getpid()))
    if quiet:
        record = error_file(run_dir, rank).write_text
    try:
        code = work()
        if finish_together and not code:
            if is_distributed():
                dist.barrier()
            if run_dir:
                done_file(run_dir, rank).write_text("done")
    except KeyboardInterrupt:  # Ctrl-C reached the rank too: the launcher says what was kept
        return 130
    except BaseException as exc:  # noqa: BLE001 - one line per failed rank, then the trace
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        line = f"{type(exc).__name__}: {exc}"
        if (
            record is not None
        ):  # a launcher printing one line for the group points at a trace only for a bug
            record(
                line + "\n"
                if quiet and isinstance(exc, user_errors)
                else f"{traceback.format_exc()}\n{line}\n"
            )
        if not quiet:
            print(f"{label} rank {rank}: {line}", file=sys.stderr)
            if not isinstance(exc, user_errors):
                traceback.print_exc()
        return 1
    finally:
        destroy_distributed()
    return int(code or 0)
