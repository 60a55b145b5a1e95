"""Decoding without a collective of its own for the token: the ranks feed their own sampled token
and agree on rank 0's inside the step's first visual combine (`Carry` on `decode_xattn`). The loop
must end with the same tokens and the same cache as one process agreeing with itself, and ranks that
sampled differently must be put back on rank 0's token."""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_configs import engine_config
from test_engine import QUESTIONS
from test_generation_cache import ONE_PROCESS, _setup

from lvx_app.attention import Carry, decode_xattn
from lvx_app.config import GenerationConfig
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.generator import Generator, LoopOutcome
from lvx_models.api import AttentionHooks
from scripts.gloo_ranks import run_ranks


class RidingStandIn:
    """A group's visual attention as the generator relies on it, for one process: the numbers that
    ride on a decoded step's first visual combine (the step's `Feed.carry`, from the host or, as the
    static step sends them, a device tensor) come back as rank 0's, whose token differs from the one
    fed at step `disagree_at` (as when another rank sampled differently)."""

    def __init__(self, model, disagree_at: int | None = None) -> None:
        self.vocab, self.disagree_at, self.steps = model.config.vocab_size, disagree_at, 0
        local = AttentionHooks()  # one process's own attention, around which it stands
        self.text, self.local = local.text, local.visual

    def visual(self, q, step, layer: int):
        carry = step.feed.carry
        if carry is not None and carry.received is None:
            self.steps += 1
            sent = carry.source if carry.source is not None else torch.tensor(carry.numbers)
            token, stop = sent.tolist()
            if self.steps == self.disagree_at and not stop:
                carry.received = torch.tensor([[(token + 1) % self.vocab, stop], [token, stop]])
            else:
                carry.received = sent.view(1, -1).clone()
        return self.local(q, step, layer)


def _answer(model, ids, visual, generation, stop_ids=(), *, rides, stop_at=None, **kw):
    """(tokens, cache length, outcome) of one answer; `rides`: through the riding agreement."""
    disagree_at = kw.pop("disagree_at", None)
    attn = RidingStandIn(model, disagree_at) if rides else None  # the conversation's hooks
    conversation = Conversation(model, ONE_PROCESS, attn)
    conversation.show_video(visual)
    logits, _ = conversation.prefill(ids.view(-1), whole=True)
    calls = [0]

    def should_stop() -> bool:
        calls[0] += 1
        return stop_at is not None and calls[0] > stop_at

    generator = Generator(conversation, stop_ids)
    generator.leader = kw.pop("leader", True)
    outcome = LoopOutcome()
    tokens = list(
        generator.answer(logits, kw.pop("first_src", None), generation, outcome, should_stop)
    )
    return tokens, conversation.cache.length, outcome


CASES = ["truncated", "stop token", "interrupted", "one token", "two tokens", "sampled"]
VARIANTS = [(leader, src) for leader in (False, True) for src in (None, 0)]


def _every_case(rank: int, world: int) -> list:
    """Every case and variant, riding and not: run in a world of one (the explicit agreement of a
    first or last token is a real broadcast)."""
    model, ids, visual = _setup("g2")
    out = []
    for case in CASES:
        generation = GenerationConfig(
            max_new_tokens={"one token": 1, "two tokens": 2}.get(case, 8),
            temperature=0.8 if case == "sampled" else 0.0,
            seed=5,
        )
        first = _answer(model, ids, visual, generation, rides=False)[0]
        stop_ids = [first[3]] if case == "stop token" else []
        stop_at = 4 if case == "interrupted" else None
        plain = _answer(model, ids, visual, generation, stop_ids, rides=False, stop_at=stop_at)
        for leader, src in VARIANTS:
            kw = dict(leader=leader, first_src=src, stop_at=stop_at)
            riding = _answer(model, ids, visual, generation, stop_ids, rides=True, **kw)
            out.append((case, leader, src, first, plain, riding))
    return out


def test_riding_loop_yields_and_caches_what_one_process_does():
    for case, leader, src, first, plain, riding in run_ranks(_every_case, 1)[0]:
        where = (case, leader, src)
        assert riding[0] == plain[0] and riding[1] == plain[1], where
        same = vars(riding[2]) | {"first_token_at": 0} == vars(plain[2]) | {"first_token_at": 0}
        assert same, where
        if case == "stop token":
            assert plain[0][-1] == first[3] and len(plain[0]) == 4
        if case == "interrupted":
            assert plain[2].interrupted and len(plain[0]) == 4


def _disagreeing(rank: int, world: int) -> tuple:
    model, ids, visual = _setup("g2")
    generation = GenerationConfig(max_new_tokens=8)
    # as a rank other than 0: its token is put back on rank 0's
    tokens, length, _ = _answer(
        model, ids, visual, generation, rides=True, disagree_at=2, leader=False
    )
    greedy = _answer(model, ids, visual, generation, rides=False)[0]
    # what follows is the model's continuation of the agreed tokens: recompute it from the prompt
    full = torch.cat([ids, torch.tensor([tokens[:2]])], dim=1)
    rest = _answer(model, full, visual, GenerationConfig(max_new_tokens=6), rides=False)[0]
    return tokens, length, greedy, rest, ids.shape[1], model.config.vocab_size


def test_a_disagreeing_step_continues_from_rank_0s_token():
    tokens, length, greedy, rest, prompt, vocab = run_ranks(_disagreeing, 1)[0]
    assert tokens[:1] == greedy[:1] and tokens[1] == (greedy[1] + 1) % vocab
    assert rest == tokens[2:]
    assert length == prompt + len(tokens) - 1  # the truncated answer's last token is not fed


def _carry_rank(rank: int, world: int) -> list:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 8, generator=g)
    k = torch.randn(1, 3 * world, 2, 8, generator=g)
    v = torch.randn(1, 3 * world, 2, 8, generator=g)
    mine = slice(3 * rank, 3 * rank + 3)
    plain = decode_xattn(q, k[:, mine], v[:, mine])
    carry = Carry(torch.tensor([2**31 - 7 - rank, int(rank == 0)]))  # any int32 rides exactly
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
        assert received == [[2**31 - 7 - r, int(r == 0)] for r in range(world)]
        assert same_first and same_second and unchanged


def _interrupted_conversation(
    rank: int, world: int, checkpoint: str, video: str, cache_dir: str, diverge: bool
):
    """Rank 0 stops the first answer after three pieces, then asks a follow-up; with `diverge`, rank
    1 samples another token once (as if its logits differed)."""
    from lvx_app.engine import generator
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed
    from lvx_app.runtime.control import ControlChannel
    from lvx_app.runtime.driver import GroupDriver, worker_loop

    if diverge and rank == 1:
        real, calls = generator.sample_token, [0]

        def other_token_once(logits, generation, i):
            calls[0] += 1
            token = real(logits, generation, i)
            return (token + 1) % logits.numel() if calls[0] == 2 else token

        generator.sample_token = other_token_once
    config = engine_config(checkpoint, cache_dir)
    session = RankSession(config, init_distributed(cuda=False))
    channel = ControlChannel()

    def text_cache():
        layers = session.conversation.cache.layers
        kv = [t[:, : layer.length].flatten() for layer in layers for t in (layer.k, layer.v)]
        return torch.cat(kv).numpy()

    if rank != 0:
        worker_loop(session, channel)
        return text_cache()
    engine = GroupDriver(session, channel, config)
    engine.load_video(video)
    pieces = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for piece in engine.ask(QUESTIONS[0], max_new_tokens=12):
            pieces.append(piece)
            if len(pieces) == 3:
                engine.interrupt()
        interrupted = engine.last_answer.interrupted
        follow = "".join(engine.ask(QUESTIONS[1], max_new_tokens=8))
    cache = text_cache()
    engine.close()
    return "".join(pieces), interrupted, follow, [str(w.message) for w in seen], cache


@pytest.mark.slow
@pytest.mark.parametrize("diverge", [False, True])
def test_sharded_interrupt_and_divergence_leave_the_conversation_of_one_process(
    tiny_checkpoints, short_video, tmp_path, diverge
):
    checkpoint = tiny_checkpoints["g2"]
    one = run_ranks(
        _interrupted_conversation, 1, checkpoint, short_video, str(tmp_path / "1"), False
    )[0]
    two, rank1_cache = run_ranks(
        _interrupted_conversation, 2, checkpoint, short_video, str(tmp_path / "2"), diverge
    )
    assert one[1] and two[1], "the first answer was interrupted"
    assert two[:3] == one[:3]
    assert any("decoded different tokens" in w for w in two[3]) == diverge
    assert two[4].shape == one[4].shape and (two[4] == rank1_cache).all(), (
        "every rank holds the same text cache"
    )
