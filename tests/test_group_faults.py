"""A worker group outlives a quiet spell longer than its timeout, and a timeout is named as one."""

from __future__ import annotations

import time

import pytest
from test_engine import QUESTIONS, _config

from lvx_app.parallel.failures import RankFailure, describe_failures, error_file


@pytest.mark.slow
def test_a_group_quiet_for_longer_than_its_timeout_answers_the_next_question(
    tiny_checkpoints, short_video, tmp_path
):
    """The other ranks wait for rank 0's next command without a deadline; the collectives of the
    work keep `--timeout`."""
    from lvx_app.parallel.world import World
    from lvx_app.runtime.launcher import RemoteEngine

    timeout_s = 2.0
    config = _config(tiny_checkpoints["g2"], str(tmp_path), timeout_s=timeout_s, gpus=0)
    engine = RemoteEngine(config, World(2))
    try:
        engine.load_video(short_video)
        first = "".join(engine.ask(QUESTIONS[0]))
        time.sleep(3 * timeout_s)  # quiet for longer than the timeout
        engine.reset()
        assert "".join(engine.ask(QUESTIONS[0])) == first
        time.sleep(3 * timeout_s)
        assert [row["rank"] for row in engine.stats()["ranks"]] == [0, 1]
        assert engine.dead() is None
    finally:
        engine.close()


def test_a_rank_that_gave_up_waiting_is_named_not_the_rank_torchrun_stopped(tmp_path):
    """A collective past its timeout (a hung peer) is the reason to give, not torchrun's SIGTERM to
    the ranks left, and it reads as a timeout."""
    error_file(tmp_path, 1).write_text(
        "Traceback ...\nRuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78]"
        " Timed out waiting 300000ms for recv operation to complete\n"
    )
    line = describe_failures([RankFailure(0, -15), RankFailure(1, 1)], tmp_path)
    assert line == (
        "rank 1 failed: gave up after waiting 300 s for another rank (--timeout): a rank hung or "
        "is far slower than the others"
    )
    # a cause still comes first: the rank killed by the OOM killer, not the one that waited for it
    killed = describe_failures([RankFailure(1, 1), RankFailure(0, -9)], tmp_path)
    assert killed == "rank 0 failed: killed by SIGKILL (out of memory, a crash, or by hand)"
