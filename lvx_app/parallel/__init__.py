"""Process-group set-up, the ring P2P helper and the test-rank spawner."""

from lvx_app.parallel.group import (
    DistInfo,
    barrier,
    destroy_distributed,
    get_rank,
    get_world_size,
    init_distributed,
)
from lvx_app.parallel.ring import RingComm

__all__ = [
    "DistInfo",
    "RingComm",
    "barrier",
    "destroy_distributed",
    "get_rank",
    "get_world_size",
    "init_distributed",
]
