"""The pass-KV ring both Ring Attention baselines run on: K/V shards travel, queries stay.

Each round the next shard's transfer is posted before this round's block is computed. Backward
rotates K/V again, and a second ring carries each shard's float32 dK/dV accumulator along with it,
so the gradient arrives back at the shard's owner after n hops (ring-flash-attn's scheme); dQ
accumulates locally (in the caller's `compute`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from lvx_app.parallel.group import get_rank
from lvx_app.parallel.ring_comm import RingComm

Block = list  # the travelling tensors of one shard: [k, v] or [k, v, k_frame]


def _resized(x: torch.Tensor, length: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], length, *x.shape[2:]))


def _rotate(comm: RingComm, block: Block, length: int) -> Block:
    """Post sending `block` to rank+1 and receiving the previous rank's (of `length`) into new
    buffers."""
    incoming = [_resized(x, length) for x in block]
    comm.post(list(zip(block, incoming)))
    return incoming


def pass_kv_forward(
    block: Block, sizes: Sequence[int], group, compute: Callable[[int, Block], None]
) -> int:
    """Visit every rank's shard: `compute(src_rank, shard)` once per non-empty shard; returns bytes
    sent."""
    world, rank = len(sizes), get_rank(group)
    comm = RingComm(group, block[0].device) if world > 1 else None
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            nxt = _rotate(comm, block, sizes[(src - 1) % world])
        if sizes[src] > 0:
            compute(src, block)
        if step < world - 1:
            comm.wait()
            block = nxt
    return comm.bytes_sent if comm is not None else 0


def pass_kv_backward(
    block: Block, sizes: Sequence[int], group, compute: Callable[[int, Block], tuple | None]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Backward ring: `compute(src, shard)` returns (first key row, dk, dv) of that shard's part, or
    None.

    The float32 (dk, dv) accumulator of each shard travels with it and reaches its owner after the
    last hop. Returns this rank's (dk, dv, bytes sent).
    """
    world, rank = len(sizes), get_rank(group)
    k = block[0]
    incoming = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
    if world == 1:
        _add_grads(incoming, compute(rank, block) if sizes[rank] > 0 else None)
        return incoming[0], incoming[1], 0
    kv_comm, grad_comm = RingComm(group, k.device), RingComm(group, k.device)
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            nxt = _rotate(kv_comm, block, sizes[(src - 1) % world])
        grads = compute(src, block) if sizes[src] > 0 else None
        if step > 0:
            grad_comm.wait()  # the accumulator of the shard now held, from rank-1
        acc = incoming
        _add_grads(acc, grads)
        # Send this shard's accumulator on; after the last round it goes home.
        incoming = _rotate(grad_comm, acc, sizes[(src - 1) % world])
        if step < world - 1:
            kv_comm.wait()
            block = nxt
    grad_comm.wait()
    return incoming[0], incoming[1], kv_comm.bytes_sent + grad_comm.bytes_sent


def _add_grads(acc: list[torch.Tensor], grads: tuple | None) -> None:
    if grads is not None:
        start, dk, dv = grads
        acc[0][:, start : start + dk.shape[1]] += dk
        acc[1][:, start : start + dv.shape[1]] += dv


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 (out, lse) a query block starts from before any shard is merged in: (0, -inf)."""
    b, s, h, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse
