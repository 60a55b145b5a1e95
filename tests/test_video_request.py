"""One request per load: every video option a call gives `Engine.load_video` (through `lvx.open`)
reaches the ranks in its `VideoRequest` and is honoured, or is refused in one line; never ignored.

The engine here runs in this process on one rank (`engine.session` is its rank); the last test
sends the same request to a group of two ranks over the frontend link."""

from __future__ import annotations

import shutil
from dataclasses import fields
from pathlib import Path

import pytest

import lvx_app as lvx
import lvx_app.engine.video_context as video_context
from lvx_app.config import VideoConfig, load_key
from lvx_app.engine.records import EngineError, VideoRequest
from lvx_app.subtitles import Cue

ENGLISH = "1\n00:00:00,000 --> 00:00:09,500\nthe café is open\n"
FRENCH = "1\n00:00:00,000 --> 00:00:09,500\nle chat dort\n"


@pytest.fixture(scope="module")
def clip(short_video, tmp_path_factory) -> Path:
    """The short video with two subtitle files beside it: English (cp1252, detected) and French."""
    folder = tmp_path_factory.mktemp("clip")
    clip = Path(shutil.copy(short_video, folder / "clip.mp4"))
    (folder / "clip.en.srt").write_bytes(ENGLISH.encode("cp1252"))
    (folder / "clip.fr.srt").write_text(FRENCH)
    return clip


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tmp_path_factory):
    """One rank in this process; the options every call overrides: subtitles auto, the cache on in
    its own folder."""
    cache = tmp_path_factory.mktemp("engine-cache")
    options = dict(gpus=0, ranks=1, cache_dir=str(cache), decode_workers=1, max_new_tokens=4)
    with lvx.open(tiny_checkpoints["g2"], subtitles="auto", **options) as engine:
        engine.cache = cache
        yield engine


def _block(engine) -> str:
    return engine.session.video.loaded.subtitle_block


def _entries(folder: Path, kind: str) -> list[Path]:
    return [p for p in (folder / kind).rglob("*") if p.is_file()]


# field -> (the call's value, what shows it was honoured: check(engine, summary, tmp_path))
HONOURED = {
    "fps": (2.0, lambda e, s, t: s.frames == 20 and s.fps == 2.0),
    "max_frames": (4, lambda e, s, t: s.frames == 4),
    "num_frames": (3, lambda e, s, t: s.frames == 3 and s.timestamps[0] == 0.0),
    "subtitles": ("none", lambda e, s, t: s.subtitle_lines == 0 and _block(e) == ""),
    "subtitle_lang": (
        "fr",
        lambda e, s, t: s.subtitle_source == "clip.fr.srt" and "le chat dort" in _block(e),
    ),
    "subtitle_encoding": ("cp1251", lambda e, s, t: "cafй" in _block(e)),
    "subtitle_tokens": (0, lambda e, s, t: s.subtitle_lines == 0 and s.subtitles_dropped == 1),
    "kv_mode": ("recompute", lambda e, s, t: e.stats()["kv mode"] == "recompute"),
    "cache": (False, lambda e, s, t: not s.from_cache and not s.prompt_from_cache),
    "cache_dir": (
        "OTHER",
        lambda e, s, t: _entries(t / "other", "features") and _entries(t / "other", "prefixes"),
    ),
    # the limit rank 0 holds the folder to after the load (tests/test_cache_limits.py: what goes)
    "cache_limit_gb": (50.0, lambda e, s, t: _rank_video(e).cache_limit_gb == 50.0),
    "decode_timeout_s": (7.5, lambda e, s, t: e.ingested[-1].decode_timeout_s == 7.5),
    "decode_workers": (2, lambda e, s, t: e.ingested[-1].decode_workers == 2),
    # the K/V saved (or read back, when an earlier load saved them) by the call's rule
    "save_visual_kv": ("always", lambda e, s, t: e.session.video.loaded.visual_kv.mode == "always"),
    # what the ranks' transcription reads (this clip has subtitles, so none is made here;
    # tests/test_speech.py shows a transcript keyed on both)
    "speech_model": ("base", lambda e, s, t: _rank_video(e).speech_model == "base"),
    "speech_language": ("de", lambda e, s, t: _rank_video(e).speech_language == "de"),
    # the frames a token attends to: the latest one only (a window of one on the visual inputs)
    "media_attention": ("latest-frame", lambda e, s, t: e.session.video.loaded.visual.window == 1),
}


def _rank_video(engine) -> VideoConfig:
    """The video options the rank loaded with."""
    return engine.session.video.loaded.request.video


def test_every_video_option_has_its_check():
    assert set(HONOURED) == {f.name for f in fields(VideoConfig)}


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_a_call_override_of_every_video_option_is_honoured(
    engine, clip, tmp_path, monkeypatch, name
):
    value, honoured = HONOURED[name]
    value = str(tmp_path / "other") if value == "OTHER" else value
    engine.ingested = []
    ingest = video_context.ingest

    def recording(path, encoder, video, **kw):
        engine.ingested.append(video)
        return ingest(path, encoder, video, **kw)

    monkeypatch.setattr(video_context, "ingest", recording)
    engine.load_video(clip)  # the engine's own options first: the features and prompt cached
    assert getattr(engine.session.video.loaded.request.video, name) != value
    summary = engine.load_video(clip, **{name: value})
    assert getattr(engine.session.video.loaded.request.video, name) == value
    assert honoured(engine, summary, tmp_path), (name, summary)
    assert getattr(engine.held.video, name) == value


def test_a_bad_override_is_one_line_and_keeps_the_video(engine, clip):
    engine.load_video(clip)
    held = engine.held
    for options, message in (
        ({"kv_mode": "both"}, "unknown --kv-mode 'both'"),
        ({"max_frames": "x"}, "--max-frames takes a whole number, not 'x'"),
        ({"fsp": 2}, "unknown option 'fsp'"),
    ):
        with pytest.raises(EngineError, match=message) as refused:
            engine.load_video(clip, **options)
        assert "\n" not in str(refused.value)
    assert engine.held == held and "".join(engine.ask("what happens?"))


@pytest.mark.parametrize("choice", ["auto", "none", "FILE"])
def test_subtitles_by_name_from_python(engine, clip, choice):
    """`load_video(v, subtitles="auto"|"none"|FILE)` is the option, as on the command line."""
    subtitles = clip.with_name("clip.fr.srt") if choice == "FILE" else choice  # a path too
    summary = engine.load_video(clip, subtitles=subtitles)
    lines = {"auto": "the café is open", "none": "", "FILE": "le chat dort"}[choice]
    assert summary.subtitle_lines == (1 if lines else 0) and lines in _block(engine)
    cues = [Cue(0.0, 9.5, "given cues")]
    assert engine.load_video(clip, subtitles=cues).subtitle_lines == 1
    assert (
        "given cues" in _block(engine) and engine.load_video(clip, subtitles=[]).subtitle_lines == 0
    )


def test_a_request_is_its_load(engine, clip):
    """A frontend's `VideoRequest` loads as the keyword call does; its key leaves out how."""
    request = VideoRequest.of(clip, engine.config.video, subtitles="none", kv_mode="recompute")
    summary = engine.load_video(request)
    assert engine.held is request and summary.subtitle_lines == 0
    assert engine.stats()["kv mode"] == "recompute"
    assert summary.kv_choice == {"mode": "recompute", "how": "asked"}
    assert engine.stats()["kv choice"] == "recompute (asked)"
    auto = engine.load_video(
        VideoRequest.of(clip, engine.config.video, subtitles="none", kv_mode="auto")
    )
    assert auto.kv_choice["mode"] == "cache" and "not a GPU" in auto.kv_choice["why"]
    faster = VideoRequest.of(clip, engine.config.video, subtitles="none", kv_mode="recompute")
    assert faster.key == request.key
    quicker = VideoRequest.of(
        clip, engine.config.video, subtitles="none", kv_mode="recompute", decode_timeout_s=5.0
    )
    assert quicker.key == request.key and quicker != request, "how it loads is not what it is"
    assert dict(load_key(request.video))["kv_mode"] == "recompute"
    with pytest.raises(EngineError, match="in the VideoRequest"):
        engine.load_video(request, fps=2)


def test_the_cache_turned_on_by_a_call_names_the_weights(tiny_checkpoints, clip, tmp_path):
    """An engine opened without the cache files a call's cached features under the weights it
    loaded, as one opened with it does."""
    cache = str(tmp_path / "cache")
    options = dict(gpus=0, ranks=1, decode_workers=1, subtitles="none", cache=False)
    with lvx.open(tiny_checkpoints["g2"], **options) as engine:
        assert not engine.load_video(clip).from_cache
        first = engine.load_video(clip, cache=True, cache_dir=cache)
        again = engine.load_video(clip, cache=True, cache_dir=cache)
        names = engine.session.video.names.of(engine.held.video)
    assert not first.from_cache and again.from_cache and again.prompt_from_cache
    assert names.encoder and names.checkpoint


@pytest.mark.slow
def test_overrides_reach_every_rank_of_a_group(tiny_checkpoints, clip, tmp_path):
    """Through the link to a torchrun group: kv mode, the subtitle budget and the subtitles by
    name."""
    options = dict(gpus=0, ranks=2, cache_dir=str(tmp_path), decode_workers=1, max_new_tokens=4)
    with lvx.open(tiny_checkpoints["g2"], subtitles="none", **options) as engine:
        summary = engine.load_video(clip, kv_mode="recompute", subtitles="auto")
        assert engine.stats()["kv mode"] == "recompute" and summary.subtitle_lines == 1
        assert summary.subtitle_source == "clip.en.srt"
        assert engine.load_video(clip, subtitles="auto", subtitle_tokens=0).subtitle_lines == 0
        assert engine.stats()["kv mode"] == "cache"
        assert "".join(engine.ask("what happens?"))
