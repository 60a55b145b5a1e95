"""Every generation option a call gives `Engine.ask` or `Engine.chat` (through `lvx.open`) is
honoured, or refused in one line; never ignored. The list of checks is the config's own list of
generation fields, so a new field needs its check here.

One rank in this process, the video loaded once; greedy answers of 6 tokens by the engine's own
options."""

from __future__ import annotations

from dataclasses import fields

import pytest

import lvx_app as lvx
from lvx_app.config import GenerationConfig
from lvx_app.engine.records import EngineError
from lvx_models.mplug_owl3.processor import VIDEO

HOT = 50.0  # a temperature at which the tiny model's tokens are drawn almost evenly


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, short_video):
    options = dict(gpus=0, ranks=1, cache=False, decode_workers=1, subtitles="none")
    with lvx.open(tiny_checkpoints["g2"], max_new_tokens=6, **options) as engine:
        engine.load_video(short_video)
        yield engine


def _answer(engine, how: str, **generation) -> list[int]:
    """The token ids of one answer to the same question, asked afresh."""
    engine.reset()
    if how == "ask":
        pieces = engine.ask("What happens in the video?", **generation)
    else:
        turns = [{"role": "user", "content": VIDEO + "\nWhat happens in the video?"}]
        pieces = engine.chat(turns, **generation)
    "".join(pieces)
    return list(engine.last_answer.tokens)


# field -> (the call's value, the other overrides it is given with, what shows it was honoured:
# check(engine, the answer's tokens, the answers by the engine's options and at HOT (seed 0)))
HONOURED = {
    "max_new_tokens": (2, {}, lambda e, got, base: len(got) == 2 and len(base["greedy"]) == 6),
    "temperature": (HOT, {}, lambda e, got, base: got != base["greedy"]),
    # only the most likely token is left: the hot answer is the greedy one, not the hot one
    "top_p": (
        1e-6,
        {"temperature": HOT},
        lambda e, got, base: got == base["greedy"] != base["hot"],
    ),
    "seed": (7, {"temperature": HOT}, lambda e, got, base: got != base["hot"]),
    "evidence": (False, {}, lambda e, got, base: e.last_answer.evidence is None),
}


def test_every_generation_option_has_its_check():
    assert set(HONOURED) == {f.name for f in fields(GenerationConfig)}


@pytest.mark.parametrize("how", ["ask", "chat"])
@pytest.mark.parametrize("name", sorted(HONOURED))
def test_a_call_override_of_every_generation_option_is_honoured(engine, name, how):
    value, beside, honoured = HONOURED[name]
    assert getattr(engine.config.generation, name) != value
    base = {"greedy": _answer(engine, how)}
    assert engine.last_answer.evidence is not None  # the engine's own: evidence on
    base["hot"] = _answer(engine, how, temperature=HOT)
    got = _answer(engine, how, **beside, **{name: value})
    assert honoured(engine, got, base), (name, got, base)
    assert _answer(engine, how) == base["greedy"], "a call's override is that call's only"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"temprature": 1.0}, "unknown option 'temprature'; valid: max_new_tokens, temperature"),
        ({"top_p": 0}, "--top-p must be above 0 and at most 1"),
        ({"max_new_tokens": 0}, "--max-new-tokens must be 1 or more"),
        ({"seed": 1.5}, "--seed takes a whole number, not 1.5"),
        ({"fps": 2}, "unknown option 'fps'"),  # a video option belongs to load_video
    ],
)
def test_a_bad_generation_override_is_one_line(engine, options, message):
    for call in (lambda: engine.ask("what?", **options), lambda: engine.chat([], **options)):
        with pytest.raises(EngineError, match=message) as refused:
            "".join(call())
        assert "\n" not in str(refused.value)
    assert "".join(engine.ask("what?"))  # the engine answers the next call
