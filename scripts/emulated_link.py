"""An emulated network link for benchmarks: a transfer completes no earlier than its bytes / rate
after it was posted.

A 2-core machine over loopback has the opposite compute-to-network ratio of a GPU cluster, so
communication-bound effects (the reason LV-XAttn beats Ring Attention) barely show on it. Inside
`emulated_link(gbps)` every transfer the product makes through torch.distributed — batched P2P
(`batch_isend_irecv`, whose requests' `wait` is held), all_gather, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single — is held until `posted + bytes / rate`; compute posted in
between proceeds meanwhile, as with a NIC. It is an emulation (a host-side sleep), wrapped around
torch.distributed from outside: the product's code is not changed by it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

# collective -> bytes this rank sends, from (its positional arguments, world size)
_SENT: dict[str, Callable[[tuple, int], int]] = {
    "all_gather": lambda a, n: _bytes(a[1]) * (n - 1),
    "all_gather_into_tensor": lambda a, n: _bytes(a[1]) * (n - 1),
    "all_gather_single": lambda a, n: _bytes(a[1]) * (n - 1),
    "reduce_scatter_tensor": lambda a, n: _bytes(a[0]) * (n - 1),
    "reduce_scatter_single": lambda a, n: _bytes(a[0]) * (n - 1),
    "all_to_all_single": lambda a, n: _bytes(a[1]) * (n - 1) // n,
}


def _bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(o) for o in obj)
    return 0


def _hold(posted: float, nbytes: int, rate: float) -> None:
    """Sleep until `posted` + nbytes / rate."""
    left = posted + nbytes / rate - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _HeldRequest:
    """A P2P request whose `wait` also waits out the batch's emulated transfer."""

    def __init__(self, request: Any, posted: float, nbytes: int, rate: float) -> None:
        self.request, self.posted, self.nbytes, self.rate = request, posted, nbytes, rate

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self.request.wait(*args, **kwargs)
        _hold(self.posted, self.nbytes, self.rate)
        return out


def _collective(name: str, fn: Callable[..., Any], rate: float) -> Callable[..., Any]:
    """A blocking collective held for the bytes this rank sends in it."""

    def held(*args: Any, **kwargs: Any) -> Any:
        posted = time.perf_counter()
        out = fn(*args, **kwargs)
        _hold(posted, _SENT[name](args, dist.get_world_size(kwargs.get("group"))), rate)
        return out

    return held


def _batch(fn: Callable[..., Any], rate: float) -> Callable[..., Any]:
    """batch_isend_irecv whose requests wait for the batch's larger direction to cross the link."""

    def held(ops: list) -> list:
        posted = time.perf_counter()
        sent = sum(_bytes(op.tensor) for op in ops if op.op is dist.isend)
        received = sum(_bytes(op.tensor) for op in ops if op.op is dist.irecv)
        return [_HeldRequest(r, posted, max(sent, received), rate) for r in fn(ops)]

    return held


@contextmanager
def emulated_link(gbps: float | None) -> Iterator[None]:
    """Within the block, every transfer takes at least bytes / (gbps · 1e9) s from its post
    (None: off)."""
    if gbps is None:
        yield
        return
    if not gbps > 0:
        raise ValueError(f"the emulated link needs a positive rate in GB/s, not {gbps}")
    rate = gbps * 1e9
    names = [n for n in (*_SENT, "batch_isend_irecv") if hasattr(dist, n)]
    saved = {name: getattr(dist, name) for name in names}
    try:
        for name, fn in saved.items():
            batch = name == "batch_isend_irecv"
            setattr(dist, name, _batch(fn, rate) if batch else _collective(name, fn, rate))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
