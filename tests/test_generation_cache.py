"""Generation with the text KV cache: equal to recomputing the whole sequence, prefill in pieces
equal to one prefill (absolute positions: the official top-left mask gets this wrong), the >32768
warning, sampling.

Generation runs the engine's own conversation and token loop (`lvx_app.engine.conversation`,
`lvx_app.engine.generator`) over one model in one process.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_hyper_attention import P, tiny_config, tiny_model

from lvx_app.config import GenerationConfig
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.generator import Generator, LoopOutcome
from lvx_app.engine.sampling import sample_next
from lvx_app.parallel.group import DistInfo

ONE_PROCESS = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


def generate(
    model,
    input_ids,
    *,
    visual=None,
    cache=None,
    max_new_tokens,
    stop_ids=(),
    temperature=0.0,
    top_p=1.0,
    seed=0,
    hooks=None,
) -> list[int]:
    """The product's token loop on one model: prefill `input_ids` (1, L) on `cache` (default a fresh
    one), then sample and feed one token at a time. The stop token is included; a truncated answer's
    last token is not fed. `hooks`: the attention it runs (default one process's)."""
    conversation = Conversation(model, ONE_PROCESS, None)
    if hooks is not None:
        conversation.hooks = hooks
    if cache is not None:
        conversation.cache = cache
    conversation.show_video(visual)
    generation = GenerationConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
    )
    logits, _ = conversation.prefill(input_ids.view(-1), whole=True)
    answer = Generator(conversation, stop_ids).answer(logits, None, generation, LoopOutcome())
    return list(answer)


def _setup(generation: str, n_frames: int = 3):
    cfg = tiny_config(generation)
    model = tiny_model(cfg)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=g)
    starts = torch.tensor([2, 6, 11][:n_frames])
    E = torch.randn(n_frames, P, cfg.hidden_size, generator=g, dtype=torch.float64)
    return model, ids, model.prepare_visual(E, starts)


@pytest.mark.parametrize("generation", ["g1", "g2"])
def test_cached_greedy_generation_equals_full_recompute(generation):
    model, ids, visual = _setup(generation)
    got = generate(model, ids, visual=visual, max_new_tokens=5)
    seq, want = ids, []
    for _ in range(5):  # no cache: the whole sequence every step
        nxt = int(model(seq, visual=visual)[0, -1].argmax())
        want.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
    assert got == want and len(got) == 5
    # the visual K/V are precomputed once: generation never calls visual_kv again
    calls = []
    orig = model.visual_kv
    model.visual_kv = lambda *a, **k: calls.append(1) or orig(*a, **k)
    generate(model, ids, visual=visual, max_new_tokens=3)
    assert calls == []


@pytest.mark.parametrize("generation", ["g1", "g2"])
@pytest.mark.parametrize("split", [[5], [1, 7, 12], [6, 7]])
def test_prefill_in_chunks_on_a_cache_equals_one_prefill(generation, split):
    """A second prefill continues at absolute positions: its text mask is bottom-right causal and
    its tokens see the frames their positions allow (split points fall before, at and after
    placeholders)."""
    model, ids, visual = _setup(generation)
    want = model(ids, visual=visual)
    cache = model.new_cache()
    bounds = [0, *split, ids.shape[1]]
    parts = [model(ids[:, a:b], cache=cache, visual=visual) for a, b in zip(bounds, bounds[1:])]
    assert cache.length == ids.shape[1]
    torch.testing.assert_close(torch.cat(parts, 1), want, rtol=1e-10, atol=1e-10)


def test_multi_turn_reuses_the_cache():
    """Turn 2 prefilled on top of turn 1's cache (prompt + answer) equals one forward of
    everything."""
    model, ids, visual = _setup("g2")
    cache = model.new_cache()
    ans = generate(model, ids[:, :12], visual=visual, cache=cache, max_new_tokens=4)
    assert cache.length == 12 + 3  # the last yielded token is not fed yet
    turn2 = torch.tensor([[ans[-1], 5, 6, 7]])
    last = generate(model, turn2, visual=visual, cache=cache, max_new_tokens=1)
    full = torch.cat([ids[:, :12], torch.tensor([ans[:-1]]), turn2], 1)
    assert last == [int(model(full, visual=visual)[0, -1].argmax())]


def test_eos_stops_and_is_yielded():
    model, ids, visual = _setup("g2")
    first = generate(model, ids, visual=visual, max_new_tokens=3)
    assert generate(model, ids, visual=visual, max_new_tokens=10, stop_ids=[first[1]]) == first[:2]


def test_text_cache_grows_without_losing_tokens(monkeypatch):
    from lvx_models import steps as kv_room

    monkeypatch.setattr(kv_room, "MIN_KV_ROOM", 4)
    model, ids, _ = _setup("g2")
    long = torch.randint(0, 97, (1, 70), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    # the buffer grows several times
    steps = [model(long[:, i : i + 1], cache=cache) for i in range(70)]
    torch.testing.assert_close(torch.cat(steps, 1), model(long), rtol=1e-10, atol=1e-10)
    cache.truncate(40)
    again = model(long[:, 40:50], cache=cache)
    torch.testing.assert_close(again, model(long[:, :50])[:, 40:], rtol=1e-10, atol=1e-10)
    # a forward that dies half-way (only some layers appended) does not corrupt the cache
    ok = model.hooks.text
    model.hooks.text = None  # layer 0 appends its K/V to the cache, then calling the hook fails
    with pytest.raises(TypeError):
        model(long[:, 50:60], cache=cache)
    model.hooks.text = ok
    assert cache.length == 50
    torch.testing.assert_close(
        model(long[:, 50:60], cache=cache), model(long[:, :60])[:, 50:], rtol=1e-10, atol=1e-10
    )


def test_text_cache_keeps_an_eighth_of_room_not_a_copy(monkeypatch):
    """After a long prompt the buffer is 1/8 larger, so a question and its answer need no copy
    (doubling would keep twice the prompt for the rest of the session)."""
    from lvx_models import steps as kv_room

    monkeypatch.setattr(kv_room, "MIN_KV_ROOM", 4)
    model, _, _ = _setup("g2")
    cache = model.new_cache()
    model(torch.randint(0, 97, (1, 160)), cache=cache)
    buffers = [layer.k for layer in cache.layers]
    assert all(b.shape[1] == 180 for b in buffers)
    model(torch.randint(0, 97, (1, 20)), cache=cache, positions=torch.arange(160, 180)[None])
    assert all(layer.k is b for layer, b in zip(cache.layers, buffers)), (
        "the question fit in the room"
    )
    model(torch.randint(0, 97, (1, 1)), cache=cache, positions=torch.tensor([[180]]))
    assert all(layer.k.shape[1] == kv_room.kv_capacity(181) == 203 for layer in cache.layers)


def test_positions_beyond_training_warn_once():
    model, ids, _ = _setup("g2")
    pos = torch.arange(32760, 32760 + 16)[None]
    with pytest.warns(UserWarning, match="32768"):
        model(ids, positions=pos)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids, positions=pos)  # only once
        model(ids[:, :3])


def test_sampling():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert int(sample_next(logits)) == 1
    g = torch.Generator().manual_seed(0)
    # top_p small keeps only the best token; a wider nucleus draws its two best ones
    assert {
        int(sample_next(logits, temperature=1.0, top_p=0.1, generator=g)) for _ in range(20)
    } == {1}
    assert {
        int(sample_next(logits, temperature=1.0, top_p=0.8, generator=g)) for _ in range(50)
    } == {1, 2}
    model, ids, visual = _setup("g1")
    a = generate(model, ids, visual=visual, max_new_tokens=4, temperature=0.8, top_p=0.9, seed=5)
    b = generate(model, ids, visual=visual, max_new_tokens=4, temperature=0.8, top_p=0.9, seed=5)
    assert a == b and len(a) == 4


def test_a_failed_forward_leaves_the_conversation_where_it_was():
    """The text cache is the one count of the tokens fed: a forward that fails after every layer
    appended its K/V (here in the final norm) takes them back, so the next question is read at the
    right positions and answered as if the failure had not happened."""
    model, ids, visual = _setup("g2")
    conversation = Conversation(model, ONE_PROCESS, None)
    conversation.show_video(visual)
    conversation.prefill(ids.view(-1), whole=True)
    fed = list(conversation.fed)
    norm = model.language_model.model.norm
    model.language_model.model.norm = None  # every layer has run when calling it fails
    with pytest.raises(TypeError):
        conversation.prefill(torch.tensor([5, 6, 7]), whole=True)
    model.language_model.model.norm = norm
    assert conversation.position == ids.numel() == conversation.cache.length
    assert conversation.fed == fed and conversation.held_prefix(fed) == len(fed)
    logits, _ = conversation.prefill(torch.tensor([5, 6, 7]), whole=True)
    whole = torch.cat([ids.view(-1), torch.tensor([5, 6, 7])])
    want = model(whole.view(1, -1), visual=visual)[0, -1]
    torch.testing.assert_close(logits, want, rtol=1e-10, atol=1e-10)


def test_turn_endings_wait_for_the_next_prefill_and_saved_keys_sit_at_their_positions():
    """What ends an answer's turn is kept until the next prefill feeds it; a whole saved cache is
    taken back only with its keys at positions 0, 1, 2, ..."""
    model, ids, _ = _setup("g2")
    conversation = Conversation(model, ONE_PROCESS, None)
    conversation.prefill(ids.view(-1), whole=True)
    conversation.end_turn([7, 2])
    assert conversation.pending == [7, 2]
    conversation.prefill(torch.tensor([7, 2, 9]), whole=True)
    assert conversation.pending == []
    layers, positions = conversation.cache.layer_kv(), conversation.key_positions()
    assert positions.tolist() == [list(range(ids.numel() + 3))]
    again = Conversation(model, ONE_PROCESS, None)
    with pytest.raises(ValueError, match="positions 0, 1, 2"):
        again.restore(layers, positions + 1)
    again.restore(layers, positions, conversation.fed)
    assert again.position == conversation.position and again.fed == conversation.fed
