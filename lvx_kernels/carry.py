"""A few integers that ride on the decode combine: what a `Feed` carries to the first replicated
visual combine of a forward (the application's `decode_xattn`), which packs them into its float
partials and hands every rank's back. The engine agrees on the decoded token this way, without a
collective of its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class Carry:
    """Integers this rank adds to the next `decode_xattn` call; `received` (n, m) int64: every
    rank's, in rank order, once that call has run. They ride bit for bit inside the float partials
    (an int32 in a float32 slot, an int64 in a float64 one), so any id travels exactly; they are
    written on the device from the host's integers (no host-to-device copy to wait for)."""

    def __init__(self, send: Tensor | Sequence[int], *, on_device: bool = False) -> None:
        """`on_device`: `send` is a device tensor whose values are copied when the call runs, never
        read on the host (a captured decode step replays the copy)."""
        self.source = send.flatten() if on_device else None
        numbers = send.flatten().tolist() if isinstance(send, Tensor) and not on_device else send
        self.numbers = [] if on_device else list(numbers)
        self.received: Tensor | None = None

    @property
    def count(self) -> int:
        return len(self.numbers) if self.source is None else self.source.numel()

    def write(self, slots: Tensor) -> None:
        """Put the numbers' bits into `slots` (float32 or float64, one per number)."""
        bits = slots.view(_BITS[slots.dtype])
        if self.source is not None:
            bits.copy_(self.source)
        for i, number in enumerate(self.numbers):
            bits[i] = number

    def unpack(self, gathered: Tensor) -> None:
        """Keep every rank's integers from their packed rows (n, m), as a copy of their own."""
        self.received = gathered.contiguous().view(_BITS[gathered.dtype]).to(torch.int64).clone()


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}
