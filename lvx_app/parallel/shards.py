"""How n items are dealt to the ranks of a group: contiguous runs whose sizes differ by at most one.

Used for video frames (each rank's share of the plan), decode chunks (each worker's share) and
prompt tokens (each rank's share of a prefill).
"""

from __future__ import annotations


def shard_bounds(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous run when `total` items are split as evenly as possible.

    The first `total % world_size` ranks get one extra item; a rank may own nothing when total <
    world_size.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
