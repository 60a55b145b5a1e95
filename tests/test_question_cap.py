"""A question too long to prefill is one EngineError on every rank, before any rank allocates for
it."""

from __future__ import annotations

import pytest
from test_engine import QUESTIONS, _config, _lvx

from lvx_app.engine import limits
from lvx_app.engine.api import EngineError
from lvx_app.engine.session import RankSession
from lvx_app.parallel.testing import run_ranks
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_models.mplug_owl3.config import Owl3Config

HUGE = "why? " * 200_000  # 1,000,000 characters


def _long_then_normal(
    rank: int, world: int, checkpoint: str, video: str, cache_dir: str, question: str, budgets: list
):
    """Rank 0 asks `question` (refused), then a normal one (answered); rank r sees `budgets[r]`
    bytes free."""
    from lvx_app.engine import session as session_module
    from lvx_app.parallel.group import init_distributed

    session_module.auto_memory_budget = lambda device: budgets[rank]
    config = _config(checkpoint, cache_dir)
    session = RankSession(config, init_distributed(cuda=False))
    prefill = session.conversation.prefill
    calls: list[int] = []

    def counted(ids, *args, **kw):
        calls.append(int(ids.numel()))
        return prefill(ids, *args, **kw)

    session.conversation.prefill = counted
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return calls
    engine = GroupDriver(session, channel, config)
    engine.load_video(video)
    loaded = len(calls)
    try:
        "".join(engine.ask(question))
        refused = None
    except EngineError as exc:
        refused = str(exc)
    refused_calls = len(calls) - loaded
    answer = "".join(engine.ask(QUESTIONS[0]))
    engine.close()
    return refused, refused_calls, answer


@pytest.mark.parametrize("world", [1, 2])
def test_a_huge_question_is_refused_by_the_context(tiny_checkpoints, short_video, tmp_path, world):
    results = run_ranks(
        _long_then_normal,
        world,
        tiny_checkpoints["g2"],
        short_video,
        str(tmp_path),
        HUGE,
        [None] * world,
    )
    refused, refused_calls, answer = results[0]
    assert (
        refused is not None and "the model's context" in refused and "32,768 tokens" in refused
    ), refused
    assert "\n" not in refused
    assert refused_calls == 0, "no prefill may start for a refused question"
    assert answer, "the group keeps answering"


def test_the_smallest_rank_budget_caps_every_rank(tiny_checkpoints, short_video, tmp_path):
    """Rank 1 has little free memory: every rank refuses a long question the same way (no rank is
    left waiting)."""
    budgets = [1 << 40, 64 << 20]
    results = run_ranks(
        _long_then_normal,
        2,
        tiny_checkpoints["g2"],
        short_video,
        str(tmp_path),
        "why? " * 3000,
        budgets,
    )
    refused, refused_calls, answer = results[0]
    assert refused is not None and "the free memory of a rank" in refused, refused
    assert refused_calls == 0 and answer


def test_question_limit_grows_with_the_budget():
    cfg = Owl3Config()
    shape = limits.PrefillShape(world=8, position=18_000, element_bytes=2)
    assert limits.question_limit(cfg, shape, None) == (
        cfg.max_position_embeddings,
        "the model's context",
    )
    small, why = limits.question_limit(cfg, shape, 1 << 30)
    large, _ = limits.question_limit(cfg, shape, 8 << 30)
    assert why == "the free memory of a rank" and 0 < small < large
    assert (
        limits.prefill_bytes(small, cfg, shape)
        <= 1 << 30
        < limits.prefill_bytes(small + 1, cfg, shape)
    )


@pytest.mark.slow
def test_lvx_chat_refuses_a_huge_question_in_one_line_and_goes_on(
    tiny_checkpoints, short_video, tmp_path
):
    stdin = "\n".join([HUGE, QUESTIONS[0], "/quit"]) + "\n"
    result = _lvx(
        "chat",
        short_video,
        "--model",
        tiny_checkpoints["g2"],
        "--gpus",
        "0",
        "--ranks",
        "2",
        "--max-new-tokens",
        "4",
        "--cache-dir",
        str(tmp_path),
        stdin=stdin,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and "tokens a question may have here" in errors[0], result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout.count("TTFT") == 1, "the next question is answered"
