"""The decode step on buffers that stay put (`StaticDecode`, what `--cuda-graphs` captures and
`--compile-decode` compiles) answers token for token as the eager loop, leaves the same text cache,
and reads nothing on the host inside the step: only the next id, once per token."""

from __future__ import annotations

import pytest
import torch
from engine_configs import engine_config
from host_syncs import counting_host_reads
from test_decode_agreement import RidingStandIn
from test_engine import QUESTIONS
from test_generation_cache import ONE_PROCESS, _setup

from lvx_app.config import GenerationConfig, ModelConfig
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.generator import Generator, LoopOutcome
from lvx_app.engine.static_decode import DecodeStep, StaticDecode, decode_step
from scripts.gloo_ranks import run_ranks

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


def test_cuda_graphs_need_a_gpu_and_on_a_group_nccl(monkeypatch):
    """A group's step holds collectives: a CUDA graph captures them on NCCL 2.9.6 or newer, never
    on gloo; each refusal is one line, and decoding runs without graphs."""
    import lvx_app.engine.static_decode as static_decode

    asked = ModelConfig(cuda_graphs=True, compile_decode=True)
    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match="--cuda-graphs needs a GPU"):
        assert decode_step(asked, torch.device("cpu"), 1) == DecodeStep(compiled=True)
    with pytest.warns(UserWarning) as seen:
        assert decode_step(asked, cuda, 2, "gloo") == DecodeStep()
    said = [str(w.message) for w in seen]
    assert "--cuda-graphs on several ranks need NCCL (this group runs gloo)" in said[0]
    assert "--compile-decode needs one" in said[1] and all("\n" not in line for line in said)
    monkeypatch.setattr(static_decode, "nccl_version", lambda: (2, 21, 5))
    with pytest.warns(UserWarning, match="--compile-decode needs one process"):
        assert decode_step(asked, cuda, 8, "nccl") == DecodeStep(graphs=True)
    monkeypatch.setattr(static_decode, "nccl_version", lambda: (2, 9, 5))
    with pytest.warns(UserWarning, match="need NCCL 2.9.6 or newer"):
        assert decode_step(ModelConfig(cuda_graphs=True), cuda, 2, "nccl") == DecodeStep()
    assert decode_step(asked, cuda, 1) == DecodeStep(True, True)
    assert decode_step(ModelConfig(), cuda, 1) == DecodeStep()


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
    from lvx_models import steps as kv_room

    monkeypatch.setattr(kv_room, "MIN_KV_ROOM", 8)
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


def _riding_answer(model, ids, visual, step: DecodeStep, stop_ids=(), stop_at=None, **kw):
    """(tokens, outcome, text cache) of one greedy answer whose tokens ride on the visual combine
    (a group's loop, in one process)."""
    riding = RidingStandIn(model, kw.pop("disagree_at", None))  # the conversation's hooks
    conversation = Conversation(model, ONE_PROCESS, riding)
    conversation.show_video(visual)
    logits, _ = conversation.prefill(ids.view(-1), whole=True)
    generator = Generator(conversation, stop_ids, step)
    generator.leader = kw.pop("leader", True)
    calls = [0]

    def should_stop() -> bool:
        calls[0] += 1
        return stop_at is not None and calls[0] > stop_at

    outcome = LoopOutcome()
    tokens = list(generator.answer(logits, None, GenerationConfig(8), outcome, should_stop))
    assert generator.rides
    return tokens, vars(outcome) | {"first_token_at": 0}, _cache(conversation)


RIDING_CASES = {
    "truncated": {},
    "stop token": {"stop_ids": "the fourth token"},
    "interrupted": {"stop_at": 4},
    "disagreeing": {"disagree_at": 2, "leader": False},
    "disagreeing leader": {"disagree_at": 3},
}


def _riding_cases(rank: int, world: int) -> list:
    """Every riding case eager and on the static step (its capture stood in, counted), in a world
    of one: the explicit agreement of a truncated answer's last token is a real broadcast."""
    from types import SimpleNamespace

    import lvx_app.engine.static_decode as static_decode

    captures: list[int] = []
    static_decode._on_side_stream = lambda fn: fn()
    static_decode._capture = lambda fn: captures.append(1) or SimpleNamespace(replay=fn)
    model, ids, visual = _setup("g2")
    plain = _riding_answer(model, ids, visual, DecodeStep())[0]
    out = []
    for case, kw in RIDING_CASES.items():
        kw = {k: [plain[3]] if v == "the fourth token" else v for k, v in kw.items()}
        want = _riding_answer(model, ids, visual, DecodeStep(), **kw)
        before = len(captures)
        got = _riding_answer(model, ids, visual, DecodeStep(graphs=True), **kw)
        same_cache = len(got[2]) == len(want[2]) and all(
            a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-12)
            for a, b in zip(got[2], want[2])
        )
        out.append((case, got[:2], want[:2], same_cache, len(captures) - before))
    return out


def test_a_groups_riding_loop_on_the_static_step_is_the_eager_ones():
    """On a group the static step carries the fed token and the stop flag on its first visual
    combine (from a device buffer, so a captured step replays it): the answer, how it ended and the
    text cache are the eager riding loop's, a rank put back on rank 0's token included."""
    for case, got, want, same_cache, captures in run_ranks(_riding_cases, 1)[0]:
        assert got == want, case
        assert same_cache, case
        assert captures == (1 if len(got[0]) > 3 else 0), case


def _group_conversation(rank: int, world: int, checkpoint: str, video: str, graphs: bool):
    """A question and a follow-up on `world` gloo ranks; with `graphs`, every rank's greedy answers
    on the static step (its CUDA graph capture stood in and counted: gloo is refused for real)."""
    from types import SimpleNamespace

    import lvx_app.engine.session as session_module
    import lvx_app.engine.static_decode as static_decode
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed
    from lvx_app.runtime.control import ControlChannel
    from lvx_app.runtime.driver import GroupDriver, worker_loop

    captures: list[int] = []
    if graphs:
        session_module.decode_step = lambda *args, **kw: DecodeStep(graphs=True)
        static_decode._on_side_stream = lambda fn: fn()
        static_decode._capture = lambda fn: captures.append(1) or SimpleNamespace(replay=fn)
    config = engine_config(checkpoint)
    session = RankSession(config, init_distributed(cuda=False))
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return len(captures)
    engine = GroupDriver(session, channel, config)
    engine.load_video(video)
    answers, combine = [], []
    for question in QUESTIONS:
        answers.append("".join(engine.ask(question, max_new_tokens=10)))
        static = session.generator.static
        if static is not None:  # the buffers its captured combine reads, and the session's
            own = static.hooks.visual.__self__.buffers.kept.values()
            combine.append(
                (
                    sorted(t.data_ptr() for pair in own for t in pair),
                    session.attn.buffers is static.hooks.visual.__self__.buffers,
                )
            )
    engine.close()
    return answers, len(captures), combine


@pytest.mark.slow
def test_a_group_answers_on_the_static_step_as_one_eager_process(tiny_checkpoints, short_video):
    """Two gloo ranks decoding on the static step (the token riding on its visual combine) answer
    a question and its follow-up as one eager process does, each rank capturing once."""
    checkpoint = tiny_checkpoints["g2"]
    want, _, _ = run_ranks(_group_conversation, 1, checkpoint, short_video, False)[0]
    (got, leader, combine), worker = run_ranks(
        _group_conversation, 2, checkpoint, short_video, True
    )
    assert got == want
    assert leader == worker == 1
    # the step's combine keeps its own buffers, whatever sizes the questions' combines take
    (own, shared), (own_again, _) = combine
    assert len(own) == 4 and own == own_again and not shared
