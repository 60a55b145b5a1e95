"""Ring P2P: send tensors to rank+1 and receive from rank-1 in one batched call.

Post the next round's transfers with `post` before computing this round, then `wait` — the overlap
every ring here relies on. Transfers are one-sided: each side skips empty tensors, so blocks may be
uneven or empty as long as both sides know the lengths. `bytes_sent` counts payload so tests can
prove what travels (and what never does). On CUDA (device given, world > 1) the P2P runs on a side
stream that first waits for the compute stream; `wait` makes the compute stream wait for it.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from lvx_app.parallel.group import get_rank, get_world_size


class RingComm:
    """One rank's view of a ring over `group` (the default group when None) on `device`."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None
    ) -> None:
        self.group = group
        self.rank = get_rank(group)
        self.world_size = get_world_size(group)
        to_global = (
            (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        )
        self.send_to = to_global((self.rank + 1) % self.world_size)
        self.recv_from = to_global((self.rank - 1) % self.world_size)
        self.bytes_sent = 0
        self._reqs: list = []
        device = None if device is None else torch.device(device)
        cuda = device is not None and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda and self.world_size > 1 else None

    def post(self, pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]]) -> None:
        """Start sending each `send` to rank+1 and receiving into each `recv` from rank-1, all in
        one batch.

        pairs: [(send tensor or None, recv buffer or None)]. Empty tensors are skipped on both sides
        (both know every block's length). Call `wait` before the next `post`."""
        if self._reqs:
            raise RuntimeError("RingComm.post called twice without wait")
        ops: list[dist.P2POp] = []
        sent = 0
        for send, recv in pairs:
            if send is not None and send.numel():
                send = send.contiguous()
                ops.append(dist.P2POp(dist.isend, send, self.send_to, self.group))
                sent += send.numel() * send.element_size()
            if recv is not None and recv.numel():
                ops.append(dist.P2POp(dist.irecv, recv, self.recv_from, self.group))
        self.bytes_sent += sent
        if not ops:
            return
        if self.stream is None:
            self._reqs = dist.batch_isend_irecv(ops)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        """Block until the posted transfers are done (on CUDA: make the compute stream wait for
        them)."""
        for req in self._reqs:
            req.wait()
        self._reqs = []
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
