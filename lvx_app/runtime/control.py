"""Rank 0 tells every other rank what to do next, in one order for all.

Commands travel over a gloo group even when the data path is NCCL, so that waiting for the next
command never holds a GPU stream or trips NCCL's watchdog while the user is typing. That group has
no deadline in practice (`NEXT_COMMAND_WAIT`): a user may stay quiet for hours, and the group must
answer the next question at once. A rank that dies meanwhile is still noticed at once (its sockets
close), and the work a command starts keeps the group's `--timeout` for its collectives.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from lvx_app.parallel.group import get_rank, get_world_size, is_distributed

# How long a rank waits for rank 0's next command: ten years, as gloo has no "never"
NEXT_COMMAND_WAIT = datetime.timedelta(days=3650)


class ControlChannel:
    """Broadcast small picklable objects from rank 0 to all ranks."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.active = is_distributed()
        if self.active and group is None and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
        self.group = group  # results of a command's work: under the work's timeout
        idle = NEXT_COMMAND_WAIT
        self.commands = dist.new_group(backend="gloo", timeout=idle) if self.active else None
        self.rank = get_rank()
        self.world_size = get_world_size()

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 passes `obj`; every rank returns rank 0's object (the others wait for it as long
        as it takes)."""
        if not self.active:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank passes `obj`; rank 0 gets the list by rank, others get None."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out
