"""Host reads of tensors, counted from outside: every `Tensor.item / tolist / cpu / numpy` and every
`int() / float() / bool()` or index use of a tensor, in every thread of the process.

Each is a point where a process on a GPU waits for the device (on a CPU the same code reads the
same values, so a CPU run counts what a GPU run would wait for). The engine is not told: the methods
are wrapped on `torch.Tensor` while the block runs. `tests/test_host_syncs.py` holds the decode loop
to its targets with it; `bench_decode.py` reports it beside CUDA's own sync count.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch

READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def counting_host_reads() -> Iterator[Counter]:
    """Within the block every host read of a tensor adds one to the yielded counter (by name)."""
    counts: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, real):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return real(self, *args, **kwargs)

        return read

    for name, real in saved.items():
        setattr(torch.Tensor, name, wrap(name, real))
    try:
        yield counts
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)
