"""More ranks than frames: the ranks without frames hold an empty shard, take part in every
collective, and the answers are those of one rank; a warning says the extra ranks idle."""

from __future__ import annotations

import warnings

import pytest
from test_engine import QUESTIONS, _config

from lvx_app.engine.session import RankSession
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from scripts.gloo_ranks import run_ranks


def _two_loads(rank: int, world: int, checkpoint: str, video: str, cache_dir: str, options: dict):
    """Rank 0 loads the video twice (encoded, then from the caches) and asks two questions after
    each load (the second long enough for the ring); returns the answers and rank 0's warnings."""
    from lvx_app.parallel.group import init_distributed

    config = _config(checkpoint, cache_dir, save_visual_kv="always", **options)
    session = RankSession(config, init_distributed(cuda=False))
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return None
    engine = GroupDriver(session, channel, config)
    answers = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            summary = engine.load_video(video)
            answers.append(summary.frames)
            answers += ["".join(engine.ask(q)) for q in (QUESTIONS[0], QUESTIONS[1] * 20)]
    frames = [row.get("frames") for row in engine.stats()["ranks"]]
    engine.close()
    return answers, frames, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "world, max_frames, schedule", [(3, 2, "auto"), (3, 1, "ring"), (4, 3, "gather")]
)
@pytest.mark.slow
def test_ranks_without_frames_answer_like_one_rank(
    tiny_checkpoints, short_video, tmp_path, world, max_frames, schedule
):
    checkpoint = tiny_checkpoints["g2"]
    options = dict(max_frames=max_frames, xattn_schedule=schedule)
    one, _, _ = run_ranks(_two_loads, 1, checkpoint, short_video, str(tmp_path / "1"), options)[0]
    many, frames, said = run_ranks(
        _two_loads, world, checkpoint, short_video, str(tmp_path / "n"), options
    )[0]
    assert many == one and one[0] == max_frames
    assert sorted(frames) == [0] * (world - max_frames) + [1] * max_frames
    idle = f"{world} ranks for {max_frames} frame(s): {world - max_frames} rank(s) hold no frames"
    assert any(line.startswith(idle) for line in said), said
