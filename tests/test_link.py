"""The emulated link of the benchmarks: a transfer of N bytes at X GB/s takes at least N/X, the
transfers of one rank share its NIC (one per direction), every message pays the latency, and nothing
changes outside it."""

import time

import pytest
import torch
import torch.distributed as dist

from lvx_app.parallel import RingComm
from lvx_app.parallel.collectives import allgather_seq
from scripts.emulated_link import Nic, emulated_link
from scripts.gloo_ranks import run_ranks

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


def _two_batches(rank: int, world: int, gbps: float, latency_s: float, tensors: int):
    """Rank 0 posts two batches at once, each sending `tensors` tensors of 1 MB / `tensors`; rank 1
    posts the matching receives. Returns the seconds until both batches are done."""
    parts = [torch.zeros(250_000 // tensors) for _ in range(tensors)]
    with emulated_link(gbps, latency_s):
        dist.barrier()
        t0 = time.perf_counter()
        batches = []
        for _ in range(2):
            op, peer = (dist.isend, 1) if rank == 0 else (dist.irecv, 0)
            batches.append(dist.batch_isend_irecv([dist.P2POp(op, t, peer) for t in parts]))
        for requests in batches:
            for request in requests:
                request.wait()
        return time.perf_counter() - t0


def test_two_transfers_of_one_rank_take_the_sum_of_their_times():
    one = 1_000_000 / (GBPS * 1e9)  # 0.3 s
    for seconds in run_ranks(_two_batches, 2, GBPS, 0.0, 1):
        # sender and receiver alike: the second transfer queues behind the first on the NIC
        assert seconds >= 2 * one
        assert seconds < 3 * one  # and is not held once more on top


def test_every_message_pays_the_latency():
    latency = 0.15
    # 2 batches x 2 messages of ~0 bytes at 1 TB/s: 4 latencies on each rank's NIC
    for seconds in run_ranks(_two_batches, 2, 1000.0, latency, 2):
        assert seconds >= 4 * latency
        assert seconds < 6 * latency


def test_a_nic_queues_transfers_and_frees_up():
    nic = Nic(rate=1e6, latency_s=0.01)  # 1 MB/s
    assert nic.book(0.0, 500_000) == pytest.approx(0.51)
    assert nic.book(0.1, 500_000, messages=2) == pytest.approx(0.51 + 0.52)  # queued behind
    assert nic.book(5.0, 0, messages=1) == pytest.approx(5.01)  # idle NIC: from its post
    assert nic.book(6.0, 10, messages=0) == 6.0  # nothing to send


def test_without_the_link_transfers_are_not_held():
    for ring_s, gather_s, _, _ in run_ranks(_timed_transfers, 2, None):
        assert ring_s < COMPUTE_S + 0.09 and gather_s < 0.2  # held, they would take >= 0.3 s more


def test_emulated_link_refuses_a_rate_that_is_not_positive():
    with pytest.raises(ValueError, match="positive"):
        with emulated_link(0):
            pass
    with pytest.raises(ValueError, match="latency"):
        with emulated_link(1.0, -1e-6):
            pass
