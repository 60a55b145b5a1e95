"""Ring P2P: send tensors to rank+1 and receive from rank-1 in one batched call.

Post the next round's transfer with `send_recv` + `commit` before computing
this round, then `wait` — the overlap LV-XAttn relies on. `bytes_sent` counts
payload so tests can prove what travels (and what never does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lvx_app.parallel.group import get_rank, get_world_size


class RingComm:
    """One rank's view of a ring over `group` (the default group when None)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = get_rank(group)
        self.world_size = get_world_size(group)
        to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.send_to = to_global((self.rank + 1) % self.world_size)
        self.recv_from = to_global((self.rank - 1) % self.world_size)
        self.bytes_sent = 0
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []

    def send_recv(self, tensor: torch.Tensor, recv_buf: torch.Tensor | None = None) -> torch.Tensor:
        """Queue sending `tensor` forward and receiving a same-shaped one from behind."""
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor) if recv_buf is None else recv_buf
        self._ops.append(dist.P2POp(dist.isend, tensor, self.send_to, self.group))
        self._ops.append(dist.P2POp(dist.irecv, out, self.recv_from, self.group))
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return out

    def commit(self) -> None:
        if self._reqs:
            raise RuntimeError("RingComm.commit called twice without wait")
        if self._ops:
            self._reqs = dist.batch_isend_irecv(self._ops)

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []
        self._ops = []
