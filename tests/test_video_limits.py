"""Past the largest video a session takes, lvx says so in one line: a prompt that would run past the
positions the model was trained on is refused at load, before any frame is decoded, with the frames
that fit (that many load and answer, one more does not); running out of GPU memory while making the
visual K/V says what to try."""

from __future__ import annotations

import re

import pytest
import torch
from test_input_faults import _small_context

import lvx_app as lvx
from lvx_app.engine.limits import TURN_ROOM, frames_that_fit
from lvx_app.engine.records import EngineError
from lvx_app.engine.resident_visual_kv import VisualKVOpener


def test_frames_that_fit_leave_room_for_a_turn():
    # a prompt of 18 fixed tokens and 5 per frame, in 32,768 positions
    most = frames_that_fit(32_768, 18 + 5 * 7_000, 7_000, 5)
    assert 18 + 5 * most + TURN_ROOM <= 32_768 < 18 + 5 * (most + 1) + TURN_ROOM
    assert frames_that_fit(50, 40, 4, 5) == 0


@pytest.mark.slow
def test_a_video_past_the_models_positions_is_one_line_at_load(
    tiny_checkpoints, short_video, tmp_path
):
    small = _small_context(tiny_checkpoints["g2"], tmp_path, TURN_ROOM + 30)
    options = dict(gpus=0, ranks=1, cache_dir=str(tmp_path / "cache"), subtitles="none")
    with lvx.open(small, **options) as engine:
        with pytest.raises(EngineError, match="positions the model was trained on") as refused:
            engine.load_video(short_video, fps=1)  # 10 frames
        line = str(refused.value)
        assert "\n" not in line
        made = [p.name for p in (tmp_path / "cache").rglob("*.safetensors")]
        assert not made, f"refused before any frame is decoded or encoded: {made}"
        most = int(re.search(r"--max-frames (\d+)", line).group(1))
        assert 0 < most < 10
        with pytest.raises(EngineError, match="positions the model was trained on"):
            engine.load_video(short_video, fps=1, max_frames=most + 1)
        assert engine.load_video(short_video, fps=1, max_frames=most).frames == most
        assert "".join(engine.ask("what happens?", max_new_tokens=4)) is not None


@pytest.mark.slow
def test_running_out_of_memory_making_the_visual_kv_is_one_line(
    tiny_checkpoints, short_video, tmp_path, monkeypatch
):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(VisualKVOpener, "open", out_of_memory)
    options = dict(gpus=0, ranks=1, cache_dir=str(tmp_path / "cache"), subtitles="none")
    with lvx.open(tiny_checkpoints["g2"], **options) as engine:
        with pytest.raises(Exception, match="ran out of GPU memory while making the visual K/V"):
            engine.load_video(short_video, fps=1)
