"""An emulated network link for benchmarks: one NIC per rank and direction, with a per-message
latency.

A 2-core machine over loopback has the opposite compute-to-network ratio of a GPU cluster, so
communication-bound effects (the reason LV-XAttn beats Ring Attention) barely show on it. Inside
`emulated_link(gbps, latency_s)` every transfer the product makes through torch.distributed —
batched P2P (`batch_isend_irecv`, whose requests' `wait` is held), all_gather,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, all_reduce — is held until this
rank's link has carried it:

- a rank has one outgoing and one incoming NIC; every transfer it sends queues on the first, every
  one it receives on the second, so two transfers of one rank share its link (they take the sum of
  their times, not the longer of the two);
- each message costs `latency_s` plus its bytes / rate on its NIC, from when it was posted or the
  NIC came free; a collective is the messages its ring algorithm sends (an all-gather over n ranks:
  n-1 messages of the local tensor; an all-reduce: 2(n-1) messages of 1/n of it);
- bytes are those of the tensors the product hands to torch.distributed (its dtypes, its packing).

Compute posted in between proceeds meanwhile, as with a NIC. It is an emulation (a host-side sleep,
each rank timing its own NICs from its own posts), wrapped around torch.distributed from outside:
the product's code is not changed by it, and it is no network model (no topology, no congestion
beyond one rank's own transfers).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

# Seconds per message: NCCL's own cost model for a ring step over the network with its Simple
# protocol, 8.4 us base latency + 14 us per network hop (NVIDIA/nccl, src/graph/tuning.cc,
# `baseLat` and `hwLat[NCCL_HW_NET]`).
NCCL_NET_LATENCY_S = 22.4e-6


def _bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(o) for o in obj)
    return 0


# collective -> (bytes this rank sends, messages), from (its positional arguments, world size n);
# what it receives is the same
_RING: dict[str, Callable[[tuple, int], tuple[int, int]]] = {
    "all_gather": lambda a, n: (_bytes(a[1]) * (n - 1), n - 1),
    "all_gather_into_tensor": lambda a, n: (_bytes(a[1]) * (n - 1), n - 1),
    "all_gather_single": lambda a, n: (_bytes(a[1]) * (n - 1), n - 1),
    "reduce_scatter_tensor": lambda a, n: (_bytes(a[0]) * (n - 1), n - 1),
    "reduce_scatter_single": lambda a, n: (_bytes(a[0]) * (n - 1), n - 1),
    "all_to_all_single": lambda a, n: (_bytes(a[1]) * (n - 1) // n, n - 1),
    "all_reduce": lambda a, n: (2 * _bytes(a[0]) * (n - 1) // n, 2 * (n - 1)),
}


class Nic:
    """One direction of one rank's link: transfers cross it one after another."""

    def __init__(self, rate: float, latency_s: float) -> None:
        self.rate, self.latency_s = rate, latency_s
        self.free_at = 0.0  # perf_counter time at which the last booked transfer is through

    def book(self, posted: float, nbytes: int, messages: int = 1) -> float:
        """Queue `messages` messages of `nbytes` in all posted at `posted`; returns when they are
        through."""
        if messages <= 0:
            return posted
        start = max(posted, self.free_at)
        self.free_at = start + messages * self.latency_s + nbytes / self.rate
        return self.free_at


class Link:
    """This rank's two NICs."""

    def __init__(self, rate: float, latency_s: float) -> None:
        self.out, self.into = Nic(rate, latency_s), Nic(rate, latency_s)

    def book(self, posted: float, sent: tuple[int, int], received: tuple[int, int]) -> float:
        """(bytes, messages) sent and received by one call posted at `posted`; when it is done."""
        return max(self.out.book(posted, *sent), self.into.book(posted, *received))


def _hold(until: float) -> None:
    left = until - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _HeldRequest:
    """A P2P request whose `wait` also waits until its batch has crossed the link."""

    def __init__(self, request: Any, done_at: float) -> None:
        self.request, self.done_at = request, done_at

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self.request.wait(*args, **kwargs)
        _hold(self.done_at)
        return out


def _collective(name: str, fn: Callable[..., Any], link: Link) -> Callable[..., Any]:
    """A blocking collective held until this rank's NICs carried its ring algorithm's messages."""

    def held(*args: Any, **kwargs: Any) -> Any:
        posted = time.perf_counter()
        out = fn(*args, **kwargs)
        moved = _RING[name](args, dist.get_world_size(kwargs.get("group")))
        _hold(link.book(posted, moved, moved))
        return out

    return held


def _batch(fn: Callable[..., Any], link: Link) -> Callable[..., Any]:
    """batch_isend_irecv whose requests wait until every send crossed this rank's outgoing NIC and
    every receive its incoming one, one message per operation."""

    def held(ops: list) -> list:
        posted = time.perf_counter()
        sends = [_bytes(op.tensor) for op in ops if op.op is dist.isend]
        recvs = [_bytes(op.tensor) for op in ops if op.op is dist.irecv]
        done_at = link.book(posted, (sum(sends), len(sends)), (sum(recvs), len(recvs)))
        return [_HeldRequest(r, done_at) for r in fn(ops)]

    return held


@contextmanager
def emulated_link(
    gbps: float | None, latency_s: float = NCCL_NET_LATENCY_S
) -> Iterator[Link | None]:
    """Within the block, this rank's transfers cross one NIC per direction at `gbps` GB/s, each
    message paying `latency_s` first (gbps None: off). Yields the rank's `Link`."""
    if gbps is None:
        yield None
        return
    if not gbps > 0:
        raise ValueError(f"the emulated link needs a positive rate in GB/s, not {gbps}")
    if not latency_s >= 0:
        raise ValueError(f"the emulated link's latency must be 0 s or more, not {latency_s}")
    link = Link(gbps * 1e9, latency_s)
    names = [n for n in (*_RING, "batch_isend_irecv") if hasattr(dist, n)]
    saved = {name: getattr(dist, name) for name in names}
    try:
        for name, fn in saved.items():
            batch = name == "batch_isend_irecv"
            setattr(dist, name, _batch(fn, link) if batch else _collective(name, fn, link))
        yield link
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
