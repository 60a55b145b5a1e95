"""Small collectives the distributed paths share: sizes, sequences, one integer, byte accounting.

Every transfer goes through torch.distributed's own functions, looked up when called, so a benchmark
that wraps them (scripts/emulated_link.py) sees every byte the product sends."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lvx_app.parallel.group import get_world_size


def all_gather_flat(every: torch.Tensor, mine: torch.Tensor, group=None) -> None:
    """Every rank's `mine` into `every`, concatenated along dim 0 in rank order (for flat tensors:
    ranks x its length): one collective into a buffer the caller keeps."""
    # torch >= 2.10 renamed the tensor collectives; keep working on torch 2.5
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(every, mine, group=group)


def _reduce_scatter(out: torch.Tensor, stacked: torch.Tensor, group=None) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, stacked, group=group)


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def exchange_sizes(*local: int, group=None, device=None) -> list[list[int]]:
    """All-gather a few integers per rank; returns one list (indexed by rank) per argument."""
    world = get_world_size(group)
    if world == 1:
        return [[n] for n in local]
    mine = torch.tensor(local, dtype=torch.int64, device=device)
    every = torch.empty(world * len(local), dtype=torch.int64, device=device)
    all_gather_flat(every, mine, group=group)
    rows = every.view(world, len(local)).tolist()
    return [[row[i] for row in rows] for i in range(len(local))]


def count_bytes(stats: dict | None, key: str, n: int) -> None:
    """Add n to stats[key] when the caller asked for statistics."""
    if stats is not None:
        stats[key] = stats.get(key, 0) + n


def _pad_seq(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[1] == length:
        return x.contiguous()
    pad = x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)


def allgather_seq(x: torch.Tensor, sizes: list[int], group=None) -> tuple[torch.Tensor, int]:
    """Concatenate every rank's `x` along dim 1 (rank order); returns (full, bytes sent by this
    rank)."""
    world = len(sizes)
    if world == 1:
        return x, 0
    longest = max(sizes)
    mine = _pad_seq(x, longest)
    every = mine.new_empty((world * mine.shape[0], *mine.shape[1:]))
    all_gather_flat(every, mine, group=group)
    every = every.view(world, *mine.shape)
    full = torch.cat([every[j, :, : sizes[j]] for j in range(world)], dim=1)
    return full, (world - 1) * nbytes(mine)


def reduce_scatter_seq(x: torch.Tensor, sizes: list[int], group=None) -> tuple[torch.Tensor, int]:
    """Sum `x` (full sequence on dim 1) over ranks and keep this rank's slice; returns (slice,
    bytes)."""
    world = len(sizes)
    if world == 1:
        return x, 0
    longest = max(sizes)
    parts = [_pad_seq(p, longest) for p in x.split(sizes, dim=1)]
    stacked = torch.cat(parts, dim=0)  # (world * B, longest, ...)
    mine = stacked.new_empty(parts[0].shape)
    _reduce_scatter(mine, stacked, group=group)
    rank = dist.get_rank(group)
    return mine[:, : sizes[rank]], (world - 1) * nbytes(mine)


def on_wire(box: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`box` where the process group can send it: on this rank's GPU under NCCL, as it is under
    gloo."""
    return box.to(device) if dist.get_backend() == "nccl" else box


def all_min(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (every rank calls this at the same point)."""
    if get_world_size() == 1:
        return value
    box = on_wire(torch.tensor([value], dtype=torch.int64), device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box[0])
