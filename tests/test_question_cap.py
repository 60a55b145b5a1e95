"""A question too long to prefill is one EngineError on every rank, before any rank allocates for
it."""

from __future__ import annotations

import pytest
from test_engine import QUESTIONS, _config, _lvx

from lvx_app.engine import limits
from lvx_app.engine.records import EngineError
from lvx_app.engine.session import RankSession
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_models.mplug_owl3.config import Owl3Config
from scripts.gloo_ranks import run_ranks

HUGE = "why? " * 40_000  # 200,000 characters: under the character cap, over the context in tokens
PASTE = "why? " * 1_999_999 + "why?!"  # 10,000,000 characters: over the character cap
ROOMY = 1 << 40  # bytes a rank may use: the model's context, not the memory, caps a question


def _long_then_normal(
    rank: int, world: int, checkpoint: str, video: str, cache_dir: str, question: str, budgets: list
):
    """Rank 0 asks `question` (refused), then a normal one (answered); rank r may use `budgets[r]`
    bytes (--rank-memory-gib)."""
    from lvx_app.parallel.group import init_distributed

    config = _config(checkpoint, cache_dir, rank_memory_gib=budgets[rank] / 2**30)
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


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_huge_question_is_refused_by_the_context(tiny_checkpoints, short_video, tmp_path, world):
    results = run_ranks(
        _long_then_normal,
        world,
        tiny_checkpoints["g2"],
        short_video,
        str(tmp_path),
        HUGE,
        [ROOMY] * world,
    )
    refused, refused_calls, answer = results[0]
    assert (
        refused is not None and "the model's context" in refused and "32,768 tokens" in refused
    ), refused
    assert "\n" not in refused
    assert refused_calls == 0, "no prefill may start for a refused question"
    assert answer, "the group keeps answering"


def _paste_then_normal(rank: int, world: int, checkpoint: str, video: str, cache_dir: str):
    """Rank 0 asks a 10M-character question (refused), then a normal one; every rank records the
    questions it tokenized and rank 0 the commands it sent."""
    from lvx_app.parallel.group import init_distributed

    config = _config(checkpoint, cache_dir)
    session = RankSession(config, init_distributed(cuda=False))
    tokenized: list[int] = []
    turns = session.turns
    question_ids = turns.question_ids
    turns.question_ids = lambda question: tokenized.append(len(question)) or question_ids(question)
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return tokenized
    sent: list[str] = []
    broadcast = channel.broadcast
    channel.broadcast = lambda message=None: sent.append(message.command) or broadcast(message)
    engine = GroupDriver(session, channel, config)
    engine.load_video(video)
    try:
        "".join(engine.ask(PASTE))
        refused = None
    except EngineError as exc:
        refused = (type(exc).__name__, str(exc))
    answer = "".join(engine.ask(QUESTIONS[0]))
    engine.close()
    return refused, sent, tokenized, answer


@pytest.mark.slow
def test_a_question_over_the_character_cap_never_reaches_a_rank(
    tiny_checkpoints, short_video, tmp_path
):
    """Refused by its length in characters before it is tokenized or sent: no rank holds a 10 MB
    question's token ids."""
    first, other = run_ranks(
        _paste_then_normal, 2, tiny_checkpoints["g2"], short_video, str(tmp_path)
    )
    refused, sent, tokenized, answer = first
    assert refused is not None and refused[0] == "QuestionTooLong", refused
    assert refused[1].startswith("the question is 10,000,000 characters, more than the"), refused
    assert sent == ["load_video", "ask", "shutdown"], "only the next question was sent"
    assert tokenized == other == [len(QUESTIONS[0])] and answer


def test_the_character_cap_never_refuses_what_the_token_cap_allows(tiny_checkpoints):
    """A question at the character cap made of the longest token still needs more tokens than the
    context: the cap only refuses what the token cap would."""
    from lvx_models.mplug_owl3.tokenizer import Owl3Tokenizer

    tokenizer = Owl3Tokenizer.from_pretrained(tiny_checkpoints["g2"])
    longest = tokenizer.longest_token_bytes()
    vocab = tokenizer.tk.get_vocab(with_added_tokens=True)
    spelled = {i: tokenizer.decode([i], skip_special_tokens=False) for i in vocab.values()}
    assert longest == max(len(text.encode()) for text in spelled.values())
    context = Owl3Config().max_position_embeddings
    limit = limits.question_char_limit(context, longest)
    piece = next(text for text in spelled.values() if len(text.encode()) == longest)
    text = piece * (limit // longest + 1)
    assert len(text) > limit and len(tokenizer.encode(text)) > context


@pytest.mark.slow
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
    assert refused is not None and "the memory a rank may use (--rank-memory-gib)" in refused
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
def test_lvx_chat_refuses_a_huge_question_and_a_pasted_book_in_one_line_each_and_goes_on(
    tiny_checkpoints, short_video, tmp_path
):
    """On two ranks: a question past the tokens a question may have, then a pasted book (refused
    by its characters, never echoed whole), each one error line; the next question is answered."""
    stdin = "\n".join([HUGE, PASTE, QUESTIONS[0], "/quit"]) + "\n"
    chat = ["chat", short_video, "--model", tiny_checkpoints["g2"], "--gpus", "0", "--ranks", "2"]
    result = _lvx(*chat, "--max-new-tokens", "4", "--cache-dir", str(tmp_path), stdin=stdin)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if "error:" in line]
    assert len(errors) == 2 and "tokens a question may have here" in errors[0], result.stdout
    assert errors[1].startswith("error: the question is 10,000,000 characters"), errors
    assert "… (10,000,000 characters)" in result.stdout and len(result.stdout) < 10_000
    assert result.stdout.count("TTFT") == 1, "the next question is answered"
