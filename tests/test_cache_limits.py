"""The cache folder stays within what it is allowed: at most `PROMPTS_PER_FEATURES` saved prompts
per feature entry (each API client's words make a prompt of its own), the least recently used
removed first; and a folder size limit (`--cache-limit-gb`) the engine holds after each load, the
entries used least recently removed first, never those the load used."""

from __future__ import annotations

import shutil
import time
import warnings
from dataclasses import replace

from test_prefix_cache import _key, _saved, video  # noqa: F401 - the fixture

from lvx_app.cache import CacheFolder, CacheWarning, PrefixCache
from lvx_app.cache.prompts import PROMPTS_PER_FEATURES


def test_saved_prompts_of_one_video_are_capped_the_least_recently_used_going_first(
    tmp_path,
    video,  # noqa: F811 - the fixture
):
    store = PrefixCache(tmp_path)
    keys = [_key(video, prompt_hash=f"client {i}") for i in range(PROMPTS_PER_FEATURES + 4)]
    for i, key in enumerate(keys):
        store.save(key, _saved(), video=video)
        if i == 1:
            time.sleep(0.02)
        if i >= 2:
            assert store.load(keys[0]) is not None  # the first, read again: used recently
        time.sleep(0.02)
    left = {e.entry_id for e in store.entries()}
    assert len(left) == PROMPTS_PER_FEATURES, len(left)
    assert keys[0].entry_id() in left and keys[-1].entry_id() in left
    gone = {k.entry_id() for k in keys} - left
    assert gone == {k.entry_id() for k in keys[1:5]}, "the least recently used went first"


def test_a_folder_over_its_limit_loses_the_entries_used_least_recently(
    tmp_path,
    video,  # noqa: F811 - the fixture
):
    store = PrefixCache(tmp_path)
    keys = [_key(video, prompt_hash=f"prompt {i}") for i in range(4)]
    for key in keys:
        store.save(key, _saved(n=2000), video=video)
        time.sleep(0.02)
    one = max(e.bytes for e in store.entries())
    since = time.time()
    store.load(keys[0])  # used by "this load": kept
    removed = CacheFolder(tmp_path).trim(int(2.5 * one), since)
    assert len(removed.entries) == 2, [e.entry_id for e in removed.entries]
    assert {e.entry_id for e in store.entries()} == {keys[0].entry_id(), keys[3].entry_id()}


def test_the_engine_holds_the_cache_to_cache_limit_gb(tiny_checkpoints, short_video, tmp_path):
    """Two loads of one clip at two rates with a limit that holds one load's entries: after the
    second, the first's are gone, with one warning; the second's all stay."""
    from engine_configs import engine_config

    from lvx_app.engine.records import VideoRequest
    from lvx_app.runtime.open import open_engine

    probe = tmp_path / "probe"
    config = engine_config(tiny_checkpoints["g2"], probe)
    with open_engine(config) as engine:
        engine.load_video(VideoRequest(short_video, config.video))
    one_load = CacheFolder(probe).size_bytes()
    shutil.rmtree(probe)
    cache = tmp_path / "cache"
    config = engine_config(tiny_checkpoints["g2"], cache, cache_limit_gb=1.5 * one_load / 2**30)
    with open_engine(config) as engine:
        engine.load_video(VideoRequest(short_video, config.video))
        first = {e.entry_id for e in CacheFolder(cache).entries()}
        time.sleep(1.1)  # the first load's entries are older than the second's start
        faster = VideoRequest(short_video, replace(config.video, fps=2.0))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            engine.load_video(faster)
    left = {e.entry_id for e in CacheFolder(cache).entries()}
    assert first and not first & left and left, (first, left)
    assert CacheFolder(cache).size_bytes() <= 1.5 * one_load * 2  # the second load is larger
    lines = [str(w.message) for w in said if issubclass(w.category, CacheWarning)]
    assert len(lines) == 1 and "over its" in lines[0] and "--cache-limit-gb" in lines[0], lines
