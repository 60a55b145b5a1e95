"""Spawn N gloo ranks on CPU and run a function on each: the tests' and benchmarks' local group.

Uses a forkserver that has already imported torch, so each rank starts in milliseconds instead of
re-importing torch. A failure on any rank re-raises in the parent with that rank's traceback; a hang
is killed after `timeout_s`.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import queue as queue_module
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed"])
    return _CTX


PORTS_DEALT = Path(tempfile.gettempdir()) / f"lvx-ports-dealt-{os.getuid()}"
LOWEST_DEALT_PORT = 15000


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to `bind(0)` and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for a server a test starts a moment later, which no other process of this machine is
    handed meanwhile. A port the kernel picked (`bind(0)`) can be picked again for someone else
    before our server binds it; so ports are dealt in turn from below the kernel's ephemeral range
    (where no `bind(0)`, gloo pair or outgoing connection lands), through a counter every process
    shares under a file lock, skipping ports in use."""
    floor = _ephemeral_floor()
    if floor <= LOWEST_DEALT_PORT + 1000:  # a machine with no room below its ephemeral range
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    span = floor - LOWEST_DEALT_PORT
    with open(PORTS_DEALT, "a+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)  # released when the file closes
        counter.seek(0)
        text = counter.read().strip()
        dealt = int(text) if text.isdigit() else os.getpid()
        for step in range(1, span + 1):
            port = LOWEST_DEALT_PORT + (dealt + step) % span
            if _bindable(port):
                break
        else:
            raise RuntimeError(f"no free port in {LOWEST_DEALT_PORT}..{floor - 1}")
        counter.seek(0)
        counter.truncate()
        counter.write(str(dealt + step))
    return port


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


def _load_per_core() -> float:
    """How many times busier than one process per core the machine is now (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, os.getloadavg()[0] / max(1, cores or 1))


def _collect(procs: list, queue, results: dict, errors: list[str], guard_s: float) -> None:
    """Wait for every rank's result; stop at the first failure, at a rank that died without one,
    or after `guard_s`."""
    deadline = time.monotonic() + guard_s
    while len(results) < len(procs) and not errors:
        try:
            rank, ok, payload = queue.get(timeout=0.5)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if dead and queue.empty():
                codes = ", ".join(f"rank {r}: exit {procs[r].exitcode}" for r in dead)
                raise RankFailed(f"ranks died without a result ({codes})") from None
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"ranks did not finish within {guard_s:.0f}s (got {sorted(results)})"
                ) from None
            continue
        if ok:
            results[rank] = payload
        else:
            errors.append(f"rank {rank} failed:\n{payload}")


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.

    `fn` must be importable (module-level) and its arguments and result picklable. Return numpy
    arrays or plain Python values, not torch tensors: a tensor's shared memory dies with the rank
    that made it. A rank that dies without a result fails the call at once; `timeout_s` (stretched
    by the machine's load per core) only guards against a hang.
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
        _collect(procs, queue, results, errors, timeout_s * _load_per_core())
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankFailed("\n".join(errors))
    return [results[r] for r in range(world_size)]
