"""The decode step on buffers that stay put (`StaticDecode`, what `--cuda-graphs` captures and
`--compile-decode` compiles) answers token for token as the eager loop, leaves the same text cache,
and reads nothing on the host inside the step: only the next id, once per token."""

from __future__ import annotations

import pytest
import torch
from host_syncs import counting_host_reads
from test_generation_cache import ONE_PROCESS, _setup

from lvx_app.config import GenerationConfig, ModelConfig
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.generator import Generator, LoopOutcome
from lvx_app.engine.static_decode import DecodeStep, StaticDecode, decode_step

TOKENS = 9


def _conversation(model, ids, visual) -> tuple[Conversation, torch.Tensor]:
    conversation = Conversation(model, ONE_PROCESS, None)
    conversation.show_video(visual)
    logits, _ = conversation.prefill(ids.view(-1), whole=True)
    return conversation, logits


def _started(conversation: Conversation, tokens: int) -> StaticDecode:
    step = StaticDecode(conversation, DecodeStep())
    step.start(tokens)
    return step


def _cache(conversation: Conversation) -> list[torch.Tensor]:
    return [t[:, : layer.length] for layer in conversation.cache.layers for t in (layer.k, layer.v)]


@pytest.mark.parametrize("generation", ["g1", "g2"])
def test_the_static_step_answers_and_caches_as_the_eager_loop(generation):
    model, ids, visual = _setup(generation)
    eager, logits = _conversation(model, ids, visual)
    want = list(Generator(eager, ()).answer(logits, None, GenerationConfig(TOKENS), LoopOutcome()))
    static, logits = _conversation(model, ids, visual)
    step = _started(static, TOKENS)
    got = [int(logits.argmax())]
    for _ in range(TOKENS - 1):
        got.append(step.next_token(got[-1]))
    assert got == want
    assert static.position == eager.position and static.cache.length == eager.cache.length
    for a, b in zip(_cache(static), _cache(eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_static_step_leaves_the_tokens_held_known():
    """A follow-up question keeps the conversation only when the cache's tokens are known."""
    model, ids, visual = _setup("g2")
    eager, logits = _conversation(model, ids, visual)
    want = list(Generator(eager, ()).answer(logits, None, GenerationConfig(4), LoopOutcome()))
    static, logits = _conversation(model, ids, visual)
    step = _started(static, 4)
    token = int(logits.argmax())
    for _ in range(3):
        token = step.next_token(token)
    assert static.fed == eager.fed and token == want[-1]
    assert static.held_prefix(eager.fed) == eager.position


def test_the_static_step_reads_nothing_on_the_host():
    model, ids, visual = _setup("g2")
    conversation, logits = _conversation(model, ids, visual)
    step = _started(conversation, 4)
    step.token.fill_(int(logits.argmax()))
    with counting_host_reads() as reads:
        step.step()
    assert not reads, dict(reads)


@pytest.mark.slow
def test_the_generator_runs_a_greedy_answer_on_the_static_step(monkeypatch):
    """With a decode step asked for, a greedy answer goes through `StaticDecode` (compiled here on
    torch.compile's eager backend: the wiring, not the compiler), a sampled one does not."""
    model, ids, visual = _setup("g2")
    made = []
    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn: made.append(fn) or real_compile(fn, backend="eager")
    )
    compiled = DecodeStep(compiled=True)
    for temperature, runs in ((0.0, 1), (0.7, 0)):
        generation = GenerationConfig(TOKENS, temperature=temperature, seed=3)
        answers = []
        for step in (DecodeStep(), compiled):
            conversation, logits = _conversation(model, ids, visual)
            generator = Generator(conversation, (), step)
            answers.append(list(generator.answer(logits, None, generation, LoopOutcome())))
        assert answers[0] == answers[1] and len(made) == runs
        made.clear()


def test_cuda_graphs_need_one_process_on_a_gpu():
    asked = ModelConfig(cuda_graphs=True, compile_decode=True)
    with pytest.warns(UserWarning, match="--cuda-graphs needs one process on a GPU"):
        assert decode_step(asked, torch.device("cpu"), 1) == DecodeStep(compiled=True)
    with pytest.warns(UserWarning) as seen:
        assert decode_step(asked, torch.device("cuda"), 2) == DecodeStep()
    said = " ".join(str(w.message) for w in seen)
    assert "--cuda-graphs needs one process" in said and "--compile-decode needs one" in said
    assert decode_step(asked, torch.device("cuda"), 1) == DecodeStep(True, True)
    assert decode_step(ModelConfig(), torch.device("cuda"), 1) == DecodeStep()


@pytest.mark.parametrize("static", [False, True])
def test_every_decode_output_is_made_in_inference_mode(monkeypatch, static):
    """The engine's own answer loop, eager and on the static step (its CUDA graph capture stood in
    on CPU), runs every forward in inference mode: no output carries autograd's `grad_fn`."""
    from types import SimpleNamespace

    import lvx_app.engine.static_decode as static_decode

    monkeypatch.setattr(static_decode, "_on_side_stream", lambda fn: fn())
    monkeypatch.setattr(static_decode, "_capture", lambda fn: SimpleNamespace(replay=fn))
    model, ids, visual = _setup("g2")
    assert any(p.requires_grad for p in model.parameters())  # grad would be recorded otherwise
    seen = []

    def record(module, args, output):
        seen.append((torch.is_inference_mode_enabled(), output.grad_fn, output.is_inference()))

    handle = model.language_model.register_forward_hook(record)
    try:
        conversation, logits = _conversation(model, ids, visual)
        generator = Generator(conversation, (), DecodeStep(graphs=static))
        answer = list(generator.answer(logits, None, GenerationConfig(TOKENS), LoopOutcome()))
    finally:
        handle.remove()
    assert len(answer) == TOKENS and len(seen) >= TOKENS  # the prefill's and every step's
    assert logits.grad_fn is None and logits.is_inference()
    assert all(s == (True, None, True) for s in seen), seen


def _stand_in_graphs(monkeypatch) -> list[int]:
    """CUDA graph capture stood in on CPU: warm-ups run eagerly, a "capture" is counted and its
    replay runs the step eagerly. Returns the list each capture appends to."""
    from types import SimpleNamespace

    import lvx_app.engine.static_decode as static_decode

    captures: list[int] = []
    monkeypatch.setattr(static_decode, "_on_side_stream", lambda fn: fn())
    monkeypatch.setattr(
        static_decode, "_capture", lambda fn: captures.append(1) or SimpleNamespace(replay=fn)
    )
    return captures


def _play(model, visuals, script, step: DecodeStep, captures: list[int]):
    """Run a session's turns on one `Generator` (`script`: ("ask", ids, tokens) prefills ids and
    answers greedily, ("truncate", n), ("video", i) shows visuals[i], ("clear",)); returns every
    answer and the number of captures after each."""
    conversation = Conversation(model, ONE_PROCESS, None)
    conversation.show_video(visuals[0])
    generator = Generator(conversation, (), step)
    answers, counts = [], []
    for action, *args in script:
        if action == "ask":
            ids, tokens = args
            logits, _ = conversation.prefill(ids.view(-1), whole=True)
            outcome = LoopOutcome()
            answers.append(list(generator.answer(logits, None, GenerationConfig(tokens), outcome)))
            counts.append(len(captures))
        elif action == "truncate":
            conversation.truncate(*args)
        elif action == "video":
            conversation.show_video(visuals[args[0]])
        else:
            conversation.clear()
    return answers, counts


def _questions(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ids[0, 3:6], ids[0, 9:10]


def test_cuda_graphs_capture_once_over_two_answers_and_a_follow_up(monkeypatch):
    """A session's answers reuse one capture: the first question's, a follow-up's, and another
    question on the same video after the conversation went back to its prompt; each answer is the
    eager loop's."""
    captures = _stand_in_graphs(monkeypatch)
    model, ids, visual = _setup("g2")
    follow_up, other = _questions(ids)
    script = [
        ("ask", ids, TOKENS),
        ("ask", follow_up, TOKENS),
        ("truncate", ids.numel()),
        ("ask", other, TOKENS),
    ]
    want, _ = _play(model, [visual], script, DecodeStep(), [])
    got, counts = _play(model, [visual], script, DecodeStep(graphs=True), captures)
    assert got == want
    assert counts == [1, 1, 1]


def test_a_new_video_a_grown_cache_or_a_cleared_conversation_capture_again(monkeypatch):
    """What the captured step reads by address changed: it is captured again (a follow-up that
    fits in the room reserved past an answer still reuses it), and the answers stay the eager
    loop's."""
    import lvx_app.engine.static_decode as static_decode
    from lvx_models.mplug_owl3 import qwen2

    monkeypatch.setattr(qwen2, "MIN_KV_ROOM", 8)
    monkeypatch.setattr(static_decode, "FOLLOW_UP_ROOM", 6)
    captures = _stand_in_graphs(monkeypatch)
    model, ids, visual = _setup("g2")
    _, _, other_video = _setup("g2", n_frames=2)
    follow_up, other = _questions(ids)
    script = [
        ("ask", ids, TOKENS),  # the cache grows for the answer: captured
        ("ask", follow_up, 4),  # fits in the room reserved past it: reused
        ("ask", other, TOKENS),  # does not fit: the cache grows, captured again
        ("video", 1),
        ("ask", follow_up, 4),  # another video: captured again
        ("clear",),
        ("ask", ids, 4),  # a new cache: captured again
    ]
    visuals = [visual, other_video]
    want, _ = _play(model, visuals, script, DecodeStep(), [])
    got, counts = _play(model, visuals, script, DecodeStep(graphs=True), captures)
    assert got == want
    assert counts == [1, 1, 2, 3, 4]
