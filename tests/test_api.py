"""The Python API every frontend uses: `lvx_app.open(model, **options)`, then `load_video`, `ask`,
`last_answer`, `reset`, `close` (or a `with` block), in one process and on a group of ranks."""

from __future__ import annotations

import pytest
from test_engine import QUESTIONS, _reference

import lvx_app as lvx
from lvx_app.config import ConfigError
from lvx_app.engine.records import EngineError


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_open_load_ask_reset_close(tiny_checkpoints, short_video, tmp_path, ranks):
    checkpoint = tiny_checkpoints["g2"]
    expected = _reference(checkpoint, short_video)
    options = dict(gpus=0, ranks=ranks, cache_dir=str(tmp_path), decode_workers=1)
    with lvx.open(checkpoint, subtitles="none", max_new_tokens=10, **options) as engine:
        summary = engine.load_video(short_video, fps=1)
        assert summary.frames == 10 and summary.fps == 1
        assert "".join(engine.ask(QUESTIONS[0])) == expected[0]
        assert engine.last_answer.new_tokens >= 1 and engine.last_answer.ttft_s > 0
        assert "".join(engine.ask(QUESTIONS[1])) == expected[1]
        engine.reset()
        assert "".join(engine.ask(QUESTIONS[0])) == expected[0]
        engine.reset()
        short = "".join(engine.ask(QUESTIONS[0], max_new_tokens=2))
        assert engine.last_answer.new_tokens <= 2 and expected[0].startswith(short)
        with pytest.raises(EngineError, match="--top-p must be above 0 and at most 1"):
            engine.ask(QUESTIONS[0], top_p=2)
        with pytest.raises(EngineError, match="unknown option 'fsp'"):
            engine.load_video(short_video, fsp=2)
        assert engine.describe()["world size"] == ranks


def test_a_bad_option_is_one_line_before_any_model_loads():
    with pytest.raises(ConfigError, match="unknown option 'rank'; valid: .*ranks"):
        lvx.open("/nonexistent", rank=2)
    with pytest.raises(ConfigError, match="--fps must be above 0"):
        lvx.open("/nonexistent", fps=-1)
