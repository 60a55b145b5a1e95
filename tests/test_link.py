"""The emulated link of the benchmarks: a transfer of N bytes at X GB/s takes at least N/X, and
nothing changes outside it."""

import time

import pytest
import torch
from emulated_link import emulated_link

from lvx_app.parallel import RingComm
from lvx_app.parallel.collectives import allgather_seq
from lvx_app.parallel.testing import run_ranks

GBPS = 1 / 300  # 3.3 MB/s: 1 MB takes 0.3 s, wide margins for a loaded 2-core machine
COMPUTE_S = 0.2


def _timed_transfers(rank: int, world: int, gbps: float | None):
    x = torch.zeros(250_000)  # 1 MB
    comm = RingComm()
    with emulated_link(gbps):
        t0 = time.perf_counter()
        nxt = torch.empty_like(x)
        comm.post([(x, nxt)])
        time.sleep(COMPUTE_S)  # compute while the transfer is in flight counts towards it
        comm.wait()
        ring_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        full, sent = allgather_seq(x.view(1, -1, 1), [x.numel()] * world)
        gather_s = time.perf_counter() - t0
    return ring_s, gather_s, sent, comm.bytes_sent


def test_emulated_link_holds_each_transfer_for_its_bytes():
    for ring_s, gather_s, sent, ring_bytes in run_ranks(_timed_transfers, 2, GBPS):
        assert ring_bytes == 1_000_000 and sent == 1_000_000
        assert ring_s >= ring_bytes / (GBPS * 1e9)
        # the compute overlapped with the transfer, it was not added (that is >= 0.5 s)
        assert ring_s < 0.45
        assert gather_s >= sent / (GBPS * 1e9)


def _timed_decode(rank: int, world: int, gbps: float):
    from lvx_app.attention import decode_xattn

    q = torch.randn(1, 1, 8, 64)
    k = v = torch.randn(1, 16, 2, 64)
    stats: dict = {}
    with emulated_link(gbps):
        t0 = time.perf_counter()
        decode_xattn(q, k, v, stats=stats)
        return time.perf_counter() - t0, stats["fwd_bytes"]


def test_decode_combine_counts_its_bytes_and_is_held_for_them():
    for seconds, sent in run_ranks(_timed_decode, 2, 1e-5):  # 10 kB/s
        assert sent == (8 * 64 + 8) * 4  # one packed float32 (out, lse) partial to the other rank
        assert seconds >= sent / 1e4


def test_without_the_link_transfers_are_not_held():
    for ring_s, gather_s, _, _ in run_ranks(_timed_transfers, 2, None):
        assert ring_s < COMPUTE_S + 0.09 and gather_s < 0.2  # held, they would take >= 0.3 s more


def test_emulated_link_refuses_a_rate_that_is_not_positive():
    with pytest.raises(ValueError, match="positive"):
        with emulated_link(0):
            pass
