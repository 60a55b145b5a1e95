"""A decoded token waits on the device once: the sampled id in one process, and on a group also the
agreed token that rode on the first visual combine. Counted from outside (`host_syncs`): every host
read of a tensor anywhere in the process while the answer runs, as the slope between a short and a
longer answer."""

from __future__ import annotations

import pytest
from host_syncs import decode_reads, prefill_copies

from scripts.gloo_ranks import run_ranks

SHORT, LONG = 6, 22


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "sampled"]
)
def test_one_process_reads_the_host_once_per_decoded_token(tiny_checkpoints, short_video, sampling):
    reads, _, lengths = run_ranks(
        decode_reads, 1, tiny_checkpoints["g2"], short_video, SHORT, LONG, sampling
    )[0]
    assert lengths == [SHORT, LONG]
    assert reads <= 1, f"{reads} host reads per decoded token (the sampled id is the one needed)"


@pytest.mark.slow
def test_each_rank_of_a_group_reads_the_host_twice_per_decoded_token_and_answers_alike(
    tiny_checkpoints, short_video
):
    args = (tiny_checkpoints["g2"], short_video, SHORT, LONG)
    _, one_process, _ = run_ranks(decode_reads, 1, *args)[0]
    (reads, answers, lengths), other = run_ranks(decode_reads, 2, *args)
    assert lengths == [SHORT, LONG] and answers == one_process
    for rank, count in enumerate((reads, other)):
        assert count <= 2, (
            f"rank {rank}: {count} host reads per decoded token (the sampled id and the agreed one)"
        )


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_prefill_copies_no_received_mask_to_the_host(
    tiny_checkpoints, short_video, world
):
    """Every rank's query positions travel with the forward's feed, so the LV-XAttn rounds plan the
    query blocks they receive from host copies: no `.cpu()` in a ring round of any layer."""
    for rank, copies in enumerate(
        run_ranks(prefill_copies, world, tiny_checkpoints["g2"], short_video)
    ):
        assert copies and not any(copies), f"rank {rank}: {copies} host copies per prefill"
