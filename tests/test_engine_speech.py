"""The transcript takes the subtitles' road in the engine: placed in the video prompt at its times
on 1 and 2 ranks alike, reopened from the cache, and never shown with another video."""

from __future__ import annotations

import pytest
from engine_configs import engine_config
from speech_clips import voice

from lvx_app.engine.session import RankSession
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_app.speech.tracks import place, write_audio
from scripts.gloo_ranks import run_ranks

pytest.importorskip("faster_whisper")


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    from scripts.tiny_whisper import make_tiny_whisper

    return str(make_tiny_whisper(tmp_path_factory.mktemp("speech") / "tiny-whisper"))


@pytest.fixture(scope="module")
def talking_video(short_video, tmp_path_factory):
    """The short video (10 s) with speech from 2 to 7 s."""
    out = tmp_path_factory.mktemp("talking") / "talking.mp4"
    return str(write_audio(out, place(10.0, (2.0, voice(5.0))), video=short_video))


def _loads(rank, world, checkpoint, video, other, speech_model, cache_dir):
    """The talking video loaded with speech twice, then another video without audio."""
    import torch

    from lvx_app.parallel.group import init_distributed

    torch.set_num_threads(1)
    config = engine_config(checkpoint, cache_dir, subtitles="speech", speech_model=speech_model)
    session = RankSession(config, init_distributed(cuda=False))
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return None
    engine = GroupDriver(session, channel, config)
    try:
        first = engine.load_video(video)
        block = session.video.loaded.subtitle_block
        again = engine.load_video(video)
        third = engine.load_video(other)
        block3 = session.video.loaded.subtitle_block
    finally:
        engine.close()
    cues = [(c.start, c.end, c.text) for c in first.transcript]
    return cues, first.subtitle_lines, block, again.transcript_from_cache, third.transcript, block3


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_the_transcript_is_placed_like_subtitles(
    tiny_checkpoints, tiny_whisper, talking_video, short_video, tmp_path, world
):
    args = (tiny_checkpoints["g2"], talking_video, short_video, tiny_whisper, str(tmp_path))
    cues, placed, block, reread, third, block3 = run_ranks(_loads, world, *args)[0]
    assert cues and all(1.5 <= start <= 7.5 for start, _, _ in cues)
    assert placed >= 1 and cues[0][2] in block  # in the prompt, under the subtitles' header
    assert reread  # the second load read it back
    assert third == [] and block3 == ""  # the next video shows none of it
