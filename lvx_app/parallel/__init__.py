"""Process-group set-up, the ring P2P helper, the test-rank spawner, which items each rank holds
(shards, layout), and the launcher side of a group: ranks that die with their launcher (lifeline),
the rank that failed first (failures), torchrun in one line and the command that starts a local
group under it (torchrun), the ranks and GPUs a run resolved (world)."""

from lvx_app.parallel.group import (
    DistInfo,
    barrier,
    destroy_distributed,
    get_rank,
    get_world_size,
    init_distributed,
)
from lvx_app.parallel.ring_comm import RingComm

__all__ = [
    "DistInfo",
    "RingComm",
    "barrier",
    "destroy_distributed",
    "get_rank",
    "get_world_size",
    "init_distributed",
]
