"""`Engine.chat`: a whole conversation sent again with every request (the OpenAI-compatible API)
keeps the longest prefix the cache holds and prefills only the rest, answering exactly like one
process that prefills the whole conversation from scratch."""

from __future__ import annotations

import pytest
import torch
from engine_configs import engine_config
from test_engine import PARAMS, QUESTIONS, _reference
from test_generation_cache import generate

from lvx_app.engine.conversation import Conversation
from lvx_app.engine.records import EngineError, VideoOpening
from lvx_app.runtime.open import open_engine

VIDEO = "<|video|>"


def _greedy(checkpoint: str, messages: list[dict], video: str | None = None) -> str:
    """One process, a fresh cache: the greedy answer to `messages` (a `<|video|>` in them is the
    video at 1 fps)."""
    from lvx_app.config import VideoConfig
    from lvx_app.video import Encoder, ingest
    from lvx_models.mplug_owl3.loader import load_model

    model, _, proc = load_model(checkpoint)
    visual, videos = None, []
    if video is not None:
        encoder = Encoder(model.encode_images, image_size=proc.image_size)
        shard = ingest(video, encoder, VideoConfig(fps=1.0, cache=False, decode_workers=1))
        videos = [shard.num_frames]
    prompt = proc.build_chat_prompt(messages, videos=videos)
    if video is not None:
        visual = model.prepare_visual(shard.features, torch.tensor(prompt.media_starts))
    out = generate(
        model,
        prompt.input_ids.view(1, -1),
        visual=visual,
        max_new_tokens=PARAMS.max_new_tokens,
        stop_ids=[model.config.eos_token_id],
    )
    return proc.decode(out[:-1] if out[-1] in proc.stop_ids else out)


@pytest.fixture()
def engine(tiny_checkpoints, tmp_path, monkeypatch):
    """One rank in this process; `engine.prefilled` lists the size of every prefill."""
    config = engine_config(
        tiny_checkpoints["g2"], tmp_path, max_new_tokens=PARAMS.max_new_tokens, ranks=1
    )
    engine = open_engine(config)
    engine.prefilled = []
    prefill = Conversation.prefill

    def counted(self, ids, **kw):
        engine.prefilled.append(int(ids.numel()))
        return prefill(self, ids, **kw)

    monkeypatch.setattr(Conversation, "prefill", counted)
    yield engine
    engine.close()


def test_a_follow_up_prefills_only_its_new_tokens(engine, tiny_checkpoints, short_video):
    expected = _reference(tiny_checkpoints["g2"], short_video)
    engine.load_video(short_video)
    processor = engine.session.processor
    prompt = engine.session.conversation.position
    first = [{"role": "user", "content": VIDEO + QUESTIONS[0]}]
    engine.prefilled.clear()
    answer = "".join(engine.chat(first))
    stats = engine.last_answer
    assert answer == expected[0]
    question = stats.prompt_tokens - prompt  # the first turn prefills only the question
    assert engine.prefilled == [question] and stats.prefill_tokens == question

    follow = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    # new: a truncated answer's last token (sampled, never fed), <|im_end|>, the next user turn
    turn = processor.build_followup(QUESTIONS[1], offset=0).input_ids.numel()
    new = int(stats.truncated) + 1 + turn
    engine.prefilled.clear()
    assert "".join(engine.chat(follow)) == expected[1]
    assert engine.prefilled == [new] and engine.last_answer.prefill_tokens == new
    held = stats.prompt_tokens + stats.new_tokens - 1  # the prompt and every answer token fed
    assert engine.last_answer.prompt_tokens == held + new

    # the same request again (a client's retry): only the last token is fed again for its logits
    engine.prefilled.clear()
    assert "".join(engine.chat(follow)) == expected[1]
    assert engine.prefilled == [1]

    # a client that edits the first answer: the cache is cut where the conversations part
    edited = [dict(m) for m in follow]
    edited[1]["content"] = answer + " (edited)"
    engine.prefilled.clear()
    "".join(engine.chat(edited))
    assert new < engine.prefilled[0] < engine.last_answer.prompt_tokens - question


def test_text_only_chat_beside_a_loaded_video(engine, tiny_checkpoints, short_video):
    """A conversation without the video answers as text alone, then the video's own conversation
    (reset, then ask) answers as before: its prompt is prefilled again."""
    checkpoint = tiny_checkpoints["g2"]
    text_only = [{"role": "user", "content": "hello, who are you?"}]
    assert "".join(engine.chat(text_only)) == _greedy(checkpoint, text_only)  # no video loaded
    engine.load_video(short_video)
    assert "".join(engine.chat(text_only)) == _greedy(checkpoint, text_only)
    engine.reset()
    expected = _reference(checkpoint, short_video)
    assert "".join(engine.ask(QUESTIONS[0])) == expected[0]


def test_a_system_message_and_text_before_the_video(engine, tiny_checkpoints, short_video):
    opening = VideoOpening(system="Answer briefly.", before="Here is a clip.\n")
    messages = [
        {"role": "system", "content": opening.system},
        {"role": "user", "content": opening.before + VIDEO + QUESTIONS[0]},
    ]
    reference = [
        messages[0],
        {"role": "user", "content": opening.before + VIDEO + "\n" + QUESTIONS[0]},
    ]
    expected = _greedy(tiny_checkpoints["g2"], reference, short_video)
    engine.load_video(short_video)
    with pytest.raises(EngineError, match="does not open as the video was loaded"):
        list(engine.chat(messages))
    engine.load_video(short_video, opening=opening)
    assert "".join(engine.chat(messages)) == expected
    assert engine.last_answer.prefill_tokens < engine.last_answer.prompt_tokens // 2


def test_malformed_conversations_are_one_line(engine, short_video):
    engine.load_video(short_video)
    for turns, message in (
        ([{"role": "assistant", "content": "hi"}], "last message must be the user's"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "d"},
            ],
            "two assistant messages in a row",
        ),
        ([{"role": "user", "content": VIDEO + VIDEO}], "one video per conversation"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": VIDEO},
            ],
            "first user message",
        ),
        ([{"role": "user", "content": "<|image|>"}], "image"),
    ):
        with pytest.raises(EngineError, match=message):
            list(engine.chat(turns))
    assert "".join(engine.chat([{"role": "user", "content": VIDEO + "ok?"}]))
