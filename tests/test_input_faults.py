"""Hostile values and inputs hold: a tiny temperature samples, an answer never runs past the model's
context however large its bound, text that is not valid Unicode is a clean error or plain text."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from timing import scaled

import lvx_app as lvx
from lvx_app.cli.chat import run_chat
from lvx_app.config import Config, GenerationConfig
from lvx_app.engine.describe import describe_answer
from lvx_app.engine.limits import TURN_ROOM, answer_tokens
from lvx_app.engine.records import AnswerStats, EngineError
from lvx_app.engine.sampling import sample_next, sample_token
from lvx_app.runtime.engine_handle import Engine
from lvx_models.mplug_owl3.tokenizer import Owl3Tokenizer, valid_text


@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 1e-45, 5e-324])
@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_a_tiny_temperature_samples_the_best_token(temperature, top_p):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 30
    g = torch.Generator().manual_seed(0)
    chosen = sample_next(logits, temperature=temperature, top_p=top_p, generator=g)
    assert int(chosen) == int(logits.argmax())
    generation = GenerationConfig(temperature=temperature, top_p=top_p)
    assert sample_token(logits.bfloat16(), generation, 3) == int(logits.bfloat16().argmax())


def test_an_answer_takes_at_most_the_positions_left():
    assert answer_tokens(10**9, 256, 200) == 57  # the last token is never fed
    assert answer_tokens(16, 256, 200) == 16
    assert answer_tokens(10**9, 256, 256) == 1


def _small_context(checkpoint: str, tmp_path, context: int) -> str:
    small = tmp_path / "small-context"
    shutil.copytree(checkpoint, small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = context
    (small / "config.json").write_text(json.dumps(config))
    return str(small)


@pytest.mark.slow
def test_generation_never_runs_past_the_models_positions(tiny_checkpoints, short_video, tmp_path):
    options = dict(gpus=0, ranks=1, cache_dir=str(tmp_path / "cache"), subtitles="none")
    with lvx.open(tiny_checkpoints["g2"], **options) as engine:
        engine.load_video(short_video, fps=1)
        "".join(engine.ask("what happens?", max_new_tokens=TURN_ROOM + 8))
        prompt, unbounded = engine.last_answer.prompt_tokens, engine.last_answer.new_tokens
    assert unbounded > TURN_ROOM + 2, "the tiny model must answer past the small context here"
    # the smallest context the video's prompt loads in (room for a question and its answer)
    small = _small_context(tiny_checkpoints["g2"], tmp_path, prompt + TURN_ROOM)
    with lvx.open(small, **options) as engine:
        engine.load_video(short_video, fps=1)
        "".join(engine.ask("what happens?", max_new_tokens=10**9))
        stats = engine.last_answer
        assert stats.prompt_tokens == prompt and stats.new_tokens <= TURN_ROOM + 1
        assert stats.truncated and stats.context_full
        assert describe_answer(stats).endswith(
            "hit the end of the model's context (reset to go on)"
        )
        with pytest.raises(EngineError, match="past the .* tokens of the model's context") as e:
            "".join(engine.ask("and then?"))
        assert "\n" not in str(e.value)
        engine.reset()
        assert "".join(engine.ask("what happens?", max_new_tokens=3)) is not None
        assert engine.last_answer.new_tokens <= 3
        if engine.last_answer.truncated:  # the answer's own bound, not the positions, ended it
            assert not engine.last_answer.context_full
            assert describe_answer(engine.last_answer).endswith("hit --max-new-tokens")


class _Recording(Engine):
    """An engine whose ranks only record what reaches them."""

    def __init__(self) -> None:
        self.config, self.sent = Config(model="tiny"), []

    def describe(self):
        return {}

    def stream(self, command, **args):
        self.sent.append(args)
        self.last_answer = AnswerStats(prompt_tokens=1, prefill_tokens=1)
        return iter(["ok", "!"])

    def call(self, command, progress, **args):
        self.sent.append(args)


def test_text_that_is_not_valid_unicode_reaches_no_rank_as_such(tiny_checkpoints):
    assert valid_text("caf\ud800") == "caf\ufffd"
    assert valid_text("\ud83d\ude00") == "\U0001f600"  # a pair of surrogates is its character
    tokenizer = Owl3Tokenizer.from_pretrained(tiny_checkpoints["g2"])
    assert tokenizer.encode("a\ud800b") == tokenizer.encode("a\ufffdb")
    engine = _Recording()
    "".join(engine.ask("why\ud800?"))
    "".join(engine.chat([{"role": "user", "content": "x\udfff"}]))
    engine.replay([("y\ud800", [1])])
    assert engine.sent[0]["question"] == "why\ufffd?"
    assert engine.sent[1]["turns"][0]["content"] == "x\ufffd"
    assert engine.sent[2]["turns"][0][0] == "y\ufffd"


@pytest.mark.parametrize("question", [b"hi", 3, None])
def test_a_question_that_is_not_text_is_one_line(question):
    engine = _Recording()
    with pytest.raises(EngineError, match="must be text \\(str\\)") as e:
        engine.ask(question)
    assert "\n" not in str(e.value) and not engine.sent


def test_lvx_chat_reads_a_latin1_byte_from_a_pipe():
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9?\n/quit\n"), encoding="utf-8")
    engine, out = _Recording(), io.StringIO()
    from rich.console import Console

    assert run_chat(engine, video=None, console=Console(file=out), stdin=stdin) == 0
    assert engine.sent[0]["question"] == "caf\ufffd?", out.getvalue()


def _in_a_thread(call):
    result = []

    def run():
        try:
            result.append(call())
        except EngineError as exc:
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def test_one_engine_from_two_threads_says_it_is_busy():
    engine = _Recording()
    pieces = engine.ask("first?")
    assert next(pieces) == "ok"  # the first answer holds the engine until it is read or dropped
    busy = _in_a_thread(lambda: "".join(engine.ask("second?")))
    assert isinstance(busy, EngineError) and "busy" in str(busy) and "\n" not in str(busy)
    assert isinstance(_in_a_thread(engine.stats), EngineError)
    assert "".join(pieces) == "!"
    assert _in_a_thread(lambda: "".join(engine.ask("third?"))) == "ok!"
    half = engine.ask("fourth?")
    next(half)
    del half  # a stream dropped half-read gives the engine back
    assert _in_a_thread(lambda: "".join(engine.ask("fifth?"))) == "ok!"
    assert [s["question"] for s in engine.sent if "question" in s] == [
        "first?",
        "third?",
        "fourth?",
        "fifth?",
    ]


README_SCRIPT = """
import lvx_app as lvx

with lvx.open({model!r}, gpus=0, cache_dir={cache!r}, subtitles="none", max_new_tokens=4) as engine:
    engine.load_video({video!r}, fps=1)
    for piece in engine.ask("What happens?"):
        print(piece, end="")
print("\\nDONE")
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["file", "stdin"])
def test_the_readme_example_runs_as_a_plain_script(tiny_checkpoints, short_video, tmp_path, how):
    """No `if __name__ == "__main__":` guard: decode workers must not run the script again."""
    script = README_SCRIPT.format(
        model=tiny_checkpoints["g2"], cache=str(tmp_path / "cache"), video=short_video
    )
    path = tmp_path / "example.py"
    path.write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv, stdin = (
        ([sys.executable, str(path)], None) if how == "file" else ([sys.executable, "-"], script)
    )
    done = subprocess.run(
        argv,
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=scaled(600),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.count("DONE") == 1, out
    assert "damaged" not in out and "bootstrapping" not in out, out
