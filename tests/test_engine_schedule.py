"""While answering, the sharded engine's text attention is rank-local: a short question's prefill
and every decoded token cost one collective per hyper layer (the visual combine), nothing per text
layer."""

import pytest
import torch.distributed as dist
from engine_configs import engine_config

from lvx_app.config import ConfigError
from lvx_app.engine.records import VideoRequest
from lvx_app.engine.session import RankSession
from scripts.gloo_ranks import run_ranks

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "broadcast",
    "batch_isend_irecv",
    "reduce_scatter_tensor",
    "send",
    "recv",
)


# the decode combine's one collective into a kept buffer (torch >= 2.10 names it all_gather_single)
COMBINE = {"all_gather_single", "all_gather_into_tensor"}


def _one_combine_per_hyper_layer(step: list, hyper: int) -> bool:
    return len(step) == hyper and set(step) <= COMBINE


def _counted(calls: list, name: str, fn):
    def run(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return run


def _collectives_per_step(rank, world, checkpoint, video, cache_dir):
    """Every rank runs the session (SPMD); returns the collectives of the question's prefill and of
    each token."""
    from lvx_app.parallel.group import init_distributed

    session = RankSession(engine_config(checkpoint, cache_dir), init_distributed(cuda=False))
    calls: list = []
    for name in COLLECTIVES:
        setattr(dist, name, _counted(calls, name, getattr(dist, name)))
    steps: dict = {"prefill": [], "token": []}

    def phase(key, fn):
        def run(*args, **kwargs):
            start = len(calls)
            out = fn(*args, **kwargs)
            steps[key].append(calls[start:])
            return out

        return run

    conversation = session.conversation
    conversation.prefill = phase("prefill", conversation.prefill)
    conversation.feed = phase("token", conversation.feed)
    session.load_video(VideoRequest(video, session.config.video))
    generation = session.config.generation.__class__(max_new_tokens=6)
    answer = "".join(session.ask("what happens in the video?", generation))
    return (
        steps,
        len(session.model.config.hyper_layer_indices),
        session.model.config.num_hidden_layers,
        answer,
    )


@pytest.mark.slow
def test_question_and_tokens_cost_one_collective_per_hyper_layer(
    tiny_checkpoints, short_video, tmp_path
):
    for rank, (steps, hyper, layers, _) in enumerate(
        run_ranks(_collectives_per_step, 2, tiny_checkpoints["g2"], short_video, str(tmp_path))
    ):
        assert hyper < layers
        video_prompt, question = steps["prefill"]
        assert _one_combine_per_hyper_layer(question, hyper), (
            f"rank {rank}: question prefill ran {question}"
        )
        assert len(steps["token"]) == 5
        for token in steps["token"]:
            assert _one_combine_per_hyper_layer(token, hyper), (
                f"rank {rank}: one decoded token ran {token}"
            )
        assert len(video_prompt) > 2 * layers  # the video prompt still goes round the rings


def test_an_unknown_schedule_is_one_line_naming_the_choices():
    with pytest.raises(
        ConfigError, match="unknown --xattn-schedule 'tree'; use one of auto, ring, gather"
    ):
        engine_config("m", xattn_schedule="tree")
    assert engine_config("m", xattn_schedule="ring").parallel.xattn_schedule == "ring"
