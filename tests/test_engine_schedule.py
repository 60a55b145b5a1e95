"""While answering, the sharded engine's text attention is rank-local: a short question's prefill
and every decoded token cost one collective per hyper layer (the visual combine), nothing per text
layer."""

import torch.distributed as dist

from lvx_app.engine.api import GenerationParams
from lvx_app.engine.session import Session, SessionConfig
from lvx_app.parallel import collectives
from lvx_app.parallel.testing import run_ranks

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "batch_isend_irecv",
    "reduce_scatter_tensor",
    "send",
    "recv",
)


def _counted(calls: list, name: str, fn):
    def run(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return run


def _collectives_per_step(rank, world, checkpoint, video, cache_dir):
    """Every rank runs the session (SPMD); returns the collectives of the question's prefill and of
    each token."""
    from lvx_app.parallel.group import init_distributed

    session = Session(
        SessionConfig(model=checkpoint, cache_dir=cache_dir, decode_workers=1),
        init_distributed(cuda=False),
    )
    calls: list = []
    for name in COLLECTIVES:
        setattr(dist, name, _counted(calls, name, getattr(dist, name)))
    collectives._all_gather = _counted(calls, "all_gather_into_tensor", collectives._all_gather)
    steps: dict = {"prefill": [], "token": []}

    def phase(key, fn):
        def run(*args, **kwargs):
            start = len(calls)
            out = fn(*args, **kwargs)
            steps[key].append(calls[start:])
            return out

        return run

    session._prefill = phase("prefill", session._prefill)
    session._feed_token = phase("token", session._feed_token)
    session.load_video(video, 1.0, None)
    answer = "".join(session.ask("what happens in the video?", GenerationParams(max_new_tokens=6)))
    return (
        steps,
        len(session.model.config.hyper_layer_indices),
        session.model.config.num_hidden_layers,
        answer,
    )


def test_question_and_tokens_cost_one_collective_per_hyper_layer(
    tiny_checkpoints, short_video, tmp_path
):
    for rank, (steps, hyper, layers, _) in enumerate(
        run_ranks(_collectives_per_step, 2, tiny_checkpoints["g2"], short_video, str(tmp_path))
    ):
        assert hyper < layers
        video_prompt, question = steps["prefill"]
        assert question == ["all_gather"] * hyper, f"rank {rank}: question prefill ran {question}"
        assert len(steps["token"]) == 5
        for token in steps["token"]:
            assert token == ["all_gather"] * hyper, f"rank {rank}: one decoded token ran {token}"
        assert len(video_prompt) > 2 * layers  # the video prompt still goes round the rings


def test_an_unknown_schedule_is_one_line_naming_the_choices():
    import pytest

    from lvx_app.engine.api import EngineError
    from lvx_app.runtime.open import session_config

    with pytest.raises(
        EngineError, match="unknown cross-attention schedule 'tree'; use one of auto, ring, gather"
    ):
        session_config(
            model="m",
            revision=None,
            fps=1.0,
            max_frames=None,
            dtype="auto",
            kv_cache=None,
            timeout=60.0,
            use_cache=False,
            cache_dir=None,
            xattn_schedule="tree",
        )
    assert (
        session_config(
            model="m",
            revision=None,
            fps=1.0,
            max_frames=None,
            dtype="auto",
            kv_cache=None,
            timeout=60.0,
            use_cache=False,
            cache_dir=None,
            xattn_schedule="ring",
        ).xattn_schedule
        == "ring"
    )
