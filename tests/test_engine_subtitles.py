"""Subtitles in the engine: the block is part of the video prompt prefilled at load, the first
question continues it, and sharded sessions answer like one process running the token loop over the
whole prompt (1 and 2 ranks). Changing the subtitles re-prefills but never re-encodes (the feature
cache does not depend on them)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
from engine_configs import engine_config
from test_engine import PARAMS, QUESTIONS, _reference

from lvx_app.engine.records import EngineWarning
from lvx_app.engine.session import RankSession
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_app.runtime.open import open_engine
from lvx_app.subtitles import Cue
from scripts.gloo_ranks import run_ranks

CUES = [
    Cue(0.0, 2.2, "hello and welcome."),
    Cue(2.5, 4.4, "a black cat walks by"),
    Cue(6.0, 9.5, "goodbye!"),
]
OTHER = [Cue(0.0, 9.5, "something else entirely")]


def _config(checkpoint: str, cache_dir: str, **kw):
    return engine_config(checkpoint, cache_dir, max_new_tokens=PARAMS.max_new_tokens, **kw)


@contextlib.contextmanager
def _loaded(checkpoint: str, video: str, tmp_path, cues, budget: int):
    """One process's engine with `video` loaded with `cues` under a subtitle budget of `budget`
    tokens: yields (engine, the load's summary, the engine's warning lines)."""
    engine = open_engine(_config(checkpoint, str(tmp_path), subtitle_tokens=budget))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = engine.load_video(video, subtitles=cues)
        said = [str(w.message) for w in caught if issubclass(w.category, EngineWarning)]
        yield engine, summary, said
    finally:
        engine.close()


def _conversation(rank: int, world: int, checkpoint: str, video: str, cache_dir: str):
    """Two turns with subtitles, then the same video with other subtitles (from the feature cache)
    and one turn."""
    from lvx_app.parallel.group import init_distributed

    config = _config(checkpoint, cache_dir)
    session = RankSession(config, init_distributed(cuda=False))
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return None
    engine = GroupDriver(session, channel, config)
    first = engine.load_video(video, subtitles=CUES)
    loaded = session.video.loaded
    prefix = session.processor.decode(loaded.prefix_ids, skip_special_tokens=False)
    answers = ["".join(engine.ask(q)) for q in QUESTIONS]
    block = loaded.subtitle_block
    again = engine.load_video(video, subtitles=OTHER)
    answers.append("".join(engine.ask(QUESTIONS[0])))
    block2 = session.video.loaded.subtitle_block
    out = (answers, first.subtitle_lines, first.timestamps, prefix, block, again.from_cache, block2)
    engine.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_subtitles_in_the_prefilled_prompt_answer_like_one_process(
    tiny_checkpoints, short_video, tmp_path, world
):
    checkpoint = tiny_checkpoints["g2"]
    expected = _reference(checkpoint, short_video, CUES)
    answers, placed, timestamps, prefix, block, from_cache, block2 = run_ranks(
        _conversation, world, checkpoint, short_video, str(tmp_path / "cache")
    )[0]
    assert (
        block == "This video's subtitles are listed below:\nhello and welcome.\na black cat walks "
        "by\ngoodbye!"
    )
    assert placed == 3 and prefix.endswith(block + "\n"), (
        "the block is prefilled at load, after the video"
    )
    assert answers[:2] == expected
    assert from_cache and block2.endswith("something else entirely") and block2 != block
    assert answers[2] == _reference(checkpoint, short_video, OTHER)[0], (
        "other subtitles: the prompt is re-prefilled"
    )


def test_budget_drops_lines_with_a_warning(tiny_checkpoints, short_video, tmp_path):
    many = [
        Cue(t, t + 0.9, f"spoken line number {t} with several more words in it") for t in range(10)
    ]
    loaded = _loaded(tiny_checkpoints["g2"], short_video, tmp_path, many, 60)
    with loaded as (engine, summary, said):
        block = engine.session.video.loaded.subtitle_block
        tokens = len(engine.session.processor.encode(block))
        answer = "".join(engine.ask("what is said?"))
    assert (
        0 < summary.subtitle_lines < 10 and summary.subtitles_dropped == 10 - summary.subtitle_lines
    )
    assert tokens <= 60 and said == [
        f"{summary.subtitles_dropped} of 10 subtitle lines dropped to fit the 60-token "
        "subtitle budget; the kept lines are spread over the whole video"
    ]
    assert answer


def test_a_budget_of_zero_places_no_line_and_warns_nothing(tiny_checkpoints, short_video, tmp_path):
    """`--subtitle-tokens 0` is the user's "no subtitles": nothing placed, nothing to warn about."""
    cues = [Cue(t, t + 0.9, f"spoken line number {t}") for t in range(10)]
    with _loaded(tiny_checkpoints["g2"], short_video, tmp_path, cues, 0) as (engine, summary, said):
        block = engine.session.video.loaded.subtitle_block
    assert summary.subtitle_lines == 0 and block == "" and summary.subtitles_dropped == 10
    assert not said
