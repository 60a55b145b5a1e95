"""An emulated network link for benchmarks: a transfer completes no earlier than its bytes / rate
after it was posted.

A 2-core VM over loopback has the opposite compute-to-network ratio of a GPU cluster, so
communication-bound effects (the reason LV-XAttn beats Ring Attention) barely show here. Inside
`emulated_link(gbps)` every transfer the attention schedules make — `RingComm`'s P2P batches, the
collectives of `collectives.py` and Ulysses' all-to-alls — is held until `posted + bytes / rate`;
compute posted in between proceeds meanwhile, as with a NIC. It is an emulation (a host-side sleep):
no contention, latency or topology. Only `scripts/bench_xattn.py
--link-gbps` turns it on; outside the context manager nothing changes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

_rate: float | None = None  # bytes per second of the emulated link; None = the real transport only


@contextmanager
def emulated_link(gbps: float | None) -> Iterator[None]:
    """Within the block, every transfer takes at least bytes / (gbps · 1e9) seconds from its post
    (None: off)."""
    global _rate
    if gbps is not None and gbps <= 0:
        raise ValueError(f"the emulated link needs a positive rate in GB/s, not {gbps}")
    before, _rate = _rate, None if gbps is None else gbps * 1e9
    try:
        yield
    finally:
        _rate = before


def hold(posted: float, nbytes: int) -> None:
    """Sleep until `posted` (a time.perf_counter()) + nbytes / rate when a link is emulated; else
    return at once."""
    if _rate is None or nbytes <= 0:
        return
    left = posted + nbytes / _rate - time.perf_counter()
    if left > 0:
        time.sleep(left)


@contextmanager
def transfer(nbytes: int) -> Iterator[None]:
    """Wrap one blocking collective that sends `nbytes` from this rank: held as if posted on
    entry."""
    posted = time.perf_counter()
    yield
    hold(posted, nbytes)
