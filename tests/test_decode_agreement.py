"""Decoding without a collective of its own for the token: the ranks feed their own sampled token
and agree on rank 0's inside the step's first visual combine (`Carry` on `decode_xattn`). The loop
must end with the same tokens and the same cache as agreeing first, and ranks that sampled
differently must be put back on rank 0's token."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_engine import QUESTIONS, _config
from test_generation_cache import _setup

from lvx_app.attention import Carry, decode_xattn
from lvx_app.engine.api import GenerationParams
from lvx_app.engine.generator import LoopOutcome, token_loop
from lvx_app.parallel.testing import run_ranks


def _loop(
    model,
    ids,
    visual,
    params,
    stop_ids=(),
    *,
    carried: bool,
    stop_at: int | None = None,
    disagree_at=None,
    leader: bool = False,
    carry_first: bool = False,
):
    """The token loop on one model, agreeing first or carried (a carried step may 'disagree' once,
    at step
    `disagree_at`: rank 0's token then differs from the one fed, as when another rank sampled
    differently)."""
    cache = model.new_cache()
    calls = {"stop": 0, "carried": 0}

    def step(token: int) -> torch.Tensor:
        return model(torch.tensor([[token]]), cache=cache, visual=visual, last_only=True)[0, -1]

    def unfeed() -> None:
        cache.truncate(cache.length - 1)

    def carry(token: int, stop: bool):
        calls["carried"] += 1
        logits = step(token)
        agreed = token
        if calls["carried"] == disagree_at and not stop:
            # "rank 0" had another token: redo the step with it
            agreed = (token + 1) % model.config.vocab_size
            unfeed()
            logits = step(agreed)
        return logits, agreed, stop

    def should_stop() -> bool:
        calls["stop"] += 1
        return stop_at is not None and calls["stop"] > stop_at

    outcome = LoopOutcome()
    with torch.no_grad():
        logits = model(ids, cache=cache, visual=visual, last_only=True)[0, -1]
        tokens = list(
            token_loop(
                logits,
                step,
                params,
                set(stop_ids),
                outcome,
                should_stop=should_stop,
                carried=carry if carried else None,
                unfeed=unfeed,
                leader=leader,
                carry_first=carry_first,
            )
        )
    return tokens, cache.length, outcome


@pytest.mark.parametrize(
    "leader,carry_first", [(False, False), (True, False), (True, True), (False, True)]
)
@pytest.mark.parametrize(
    "case", ["truncated", "stop token", "interrupted", "one token", "two tokens", "sampled"]
)
def test_carried_loop_yields_and_caches_what_agreeing_first_does(case, leader, carry_first):
    model, ids, visual = _setup("g2")
    params = GenerationParams(
        max_new_tokens={"one token": 1, "two tokens": 2}.get(case, 8),
        temperature=0.8 if case == "sampled" else 0.0,
        seed=5,
    )
    first = _loop(model, ids, visual, params, carried=False)[0]
    stop_ids = [first[3]] if case == "stop token" else []
    stop_at = 4 if case == "interrupted" else None
    plain = _loop(model, ids, visual, params, stop_ids, carried=False, stop_at=stop_at)
    carried = _loop(
        model,
        ids,
        visual,
        params,
        stop_ids,
        carried=True,
        stop_at=stop_at,
        leader=leader,
        carry_first=carry_first,
    )
    assert carried[0] == plain[0] and carried[1] == plain[1], case
    assert vars(carried[2]) | {"first_token_at": 0} == vars(plain[2]) | {"first_token_at": 0}
    if case == "stop token":
        assert plain[0][-1] == first[3] and len(plain[0]) == 4
    if case == "interrupted":
        assert plain[2].interrupted and len(plain[0]) == 4


def test_a_disagreeing_step_continues_from_rank_0s_token():
    model, ids, visual = _setup("g2")
    params = GenerationParams(max_new_tokens=8)
    tokens, length, _ = _loop(
        model, ids, visual, params, carried=True, disagree_at=2, carry_first=True
    )
    greedy = _loop(model, ids, visual, params, carried=False)[0]
    assert tokens[:1] == greedy[:1] and tokens[1] == (greedy[1] + 1) % model.config.vocab_size
    # what follows is the model's continuation of the agreed tokens: recompute it from the prompt
    # and those tokens
    full = torch.cat([ids, torch.tensor([tokens[:2]])], dim=1)
    assert (
        _loop(model, full, visual, GenerationParams(max_new_tokens=6), carried=False)[0]
        == tokens[2:]
    )
    assert length == ids.shape[1] + len(tokens) - 1  # the truncated answer's last token is not fed


def _carry_rank(rank: int, world: int) -> list:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 8, generator=g)
    k = torch.randn(1, 3 * world, 2, 8, generator=g)
    v = torch.randn(1, 3 * world, 2, 8, generator=g)
    mine = slice(3 * rank, 3 * rank + 3)
    plain = decode_xattn(q, k[:, mine], v[:, mine])
    carry = Carry(torch.tensor([100.0 + rank, float(rank == 0)]))
    first = decode_xattn(q, k[:, mine], v[:, mine], carry=carry)
    received = carry.received.clone()
    # already exchanged: rides no further
    second = decode_xattn(q, k[:, mine], v[:, mine], carry=carry)
    return [
        received.tolist(),
        all(torch.equal(a, b) for a, b in zip(plain, first)),
        all(torch.equal(a, b) for a, b in zip(plain, second)),
        torch.equal(received, carry.received),
    ]


@pytest.mark.parametrize("world", [1, 3])
def test_decode_xattn_carries_every_ranks_numbers_in_rank_order(world):
    for received, same_first, same_second, unchanged in run_ranks(_carry_rank, world):
        assert received == [[100.0 + r, float(r == 0)] for r in range(world)]
        assert same_first and same_second and unchanged


def _interrupted_conversation(
    rank: int, world: int, checkpoint: str, video: str, cache_dir: str, diverge: bool
):
    """Rank 0 stops the first answer after three pieces, then asks a follow-up; with `diverge`, rank
    1 samples another token once (as if its logits differed)."""
    from lvx_app.engine import generation
    from lvx_app.runtime.control import ControlChannel
    from lvx_app.runtime.driver import GroupDriver, worker_loop
    from lvx_app.engine.session import Session
    from lvx_app.parallel.group import init_distributed

    if diverge and rank == 1:
        real, calls = generation.sample_next, [0]

        def other_token_once(logits, **kw):
            calls[0] += 1
            token = real(logits, **kw)
            return (token + 1) % logits.numel() if calls[0] == 2 else token

        generation.sample_next = other_token_once
    session = Session(_config(checkpoint, cache_dir), init_distributed(cuda=False))
    channel = ControlChannel()

    def text_cache():
        return torch.cat(
            [
                t[:, : layer.length].flatten()
                for layer in session.cache.layers
                for t in (layer.k, layer.v)
            ]
        ).numpy()

    if rank != 0:
        worker_loop(session, channel)
        return text_cache()
    engine = GroupDriver(session, channel)
    engine.load_video(video, 1.0)
    pieces = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for piece in engine.ask(QUESTIONS[0], GenerationParams(max_new_tokens=12)):
            pieces.append(piece)
            if len(pieces) == 3:
                engine.interrupt()
        interrupted = engine.last_answer.interrupted
        follow = "".join(engine.ask(QUESTIONS[1], GenerationParams(max_new_tokens=8)))
    cache = text_cache()
    engine.close()
    return "".join(pieces), interrupted, follow, [str(w.message) for w in seen], cache


@pytest.mark.parametrize("diverge", [False, True])
def test_sharded_interrupt_and_divergence_leave_the_conversation_of_one_process(
    tiny_checkpoints, short_video, tmp_path, diverge
):
    one = run_ranks(
        _interrupted_conversation,
        1,
        tiny_checkpoints["g2"],
        short_video,
        str(tmp_path / "1"),
        False,
    )[0]
    two, rank1_cache = run_ranks(
        _interrupted_conversation,
        2,
        tiny_checkpoints["g2"],
        short_video,
        str(tmp_path / "2"),
        diverge,
    )
    assert one[1] and two[1], "the first answer was interrupted"
    assert two[:3] == one[:3]
    assert any("decoded different tokens" in w for w in two[3]) == diverge
    assert two[4].shape == one[4].shape and (two[4] == rank1_cache).all(), (
        "every rank holds the same text cache"
    )
