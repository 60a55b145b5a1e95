"""Rank 0 tells every other rank what to do next, in one order for all.

Commands travel over a gloo group even when the data path is NCCL, so that waiting for the next
command never holds a GPU stream or trips NCCL's watchdog while the user is typing. That group has
no deadline in practice (`NEXT_COMMAND_WAIT`): a user may stay quiet for hours, and the group must
answer the next question at once. A rank that dies meanwhile is still noticed at once (its sockets
close), and the work a command starts keeps the group's `--timeout` for its collectives.

A command travels as the `Request` the frontend's link carries (`lvx_app.wire`), and every rank's
result of a gathered command as a `Reply`, through the same codec.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from lvx_app.parallel.group import get_rank, get_world_size, is_distributed
from lvx_app.wire import Reply, Request, decode, encode

# How long a rank waits for rank 0's next command: ten years, as gloo has no "never"
NEXT_COMMAND_WAIT = datetime.timedelta(days=3650)


class ControlChannel:
    """Rank 0's requests to every rank, and every rank's results back to rank 0."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.active = is_distributed()
        if self.active and group is None and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
        self.group = group  # results of a command's work: under the work's timeout
        idle = NEXT_COMMAND_WAIT
        self.commands = dist.new_group(backend="gloo", timeout=idle) if self.active else None
        self.rank = get_rank()
        self.world_size = get_world_size()

    def broadcast(self, request: Request | None = None) -> Request:
        """Rank 0 passes `request`; every rank returns rank 0's request (the others wait for it as
        long as it takes)."""
        if not self.active:
            assert request is not None, "rank 0 sends a request"
            return request
        box = [encode(request) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return decode(box[0])

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank passes its result; rank 0 gets the list by rank, others get None."""
        if not self.active:
            return [value]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(encode(Reply(value)), out, dst=0, group=self.group)
        return None if out is None else [decode(data).value for data in out]
