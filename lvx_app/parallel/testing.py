"""Spawn N gloo ranks on CPU and run a function on each; used by pytest and benchmarks.

Uses a forkserver that has already imported torch, so each rank starts in milliseconds instead of
re-importing torch. A failure on any rank re-raises in the parent with that rank's traceback; a hang
is killed after `timeout_s`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import traceback
from typing import Any, Callable

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed"])
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    from lvx_app.parallel.group import destroy_distributed, init_distributed

    try:
        init_distributed(cuda=False, timeout_s=120)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - the parent re-raises it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.

    `fn` must be importable (module-level) and its arguments and result picklable. Return numpy
    arrays or plain Python values, not torch tensors: a tensor's shared memory dies with the rank
    that made it.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout_s)
            except queue_module.Empty as exc:
                raise RankFailed(
                    f"ranks did not finish within {timeout_s:.0f}s (got {sorted(results)})"
                ) from exc
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankFailed("\n".join(errors))
    return [results[r] for r in range(world_size)]
