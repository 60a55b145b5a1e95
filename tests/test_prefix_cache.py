"""The saved video prompt: a reopened video reads its prefilled prompt back and answers token for
token like a fresh prefill (1 and 2 ranks); every key component invalidates it; damaged files are
re-prefilled with one warning."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import pytest
import torch
from cache_damage import (
    DAMAGES,
    check_a_folder_holding_files_is_left_alone,
    check_damage_is_discarded,
    damage,
)
from typer.testing import CliRunner

from lvx_app.cache import CacheWarning, FeatureKey, PrefixCache, PrefixKey, SavedPrefix
from lvx_app.cache.store import stable_hash
from lvx_app.cli.cache import cache_app
from lvx_app.config import Config, GenerationConfig
from lvx_app.engine.records import VideoRequest
from lvx_app.engine.session import RankSession
from lvx_app.parallel.group import init_distributed
from lvx_models.fingerprint import checkpoint_identity
from scripts.gloo_ranks import run_ranks

PARAMS = GenerationConfig(max_new_tokens=8)
QUESTION = "what happens in the video?"


def _open_and_ask(session: RankSession, video: str) -> tuple[bool, list, list]:
    """Load the video, note the prompt's K/V, answer one question (every rank runs this in the same
    order)."""
    summary = session.load_video(VideoRequest(video, session.config.video))
    kv = [
        [float(k.double().sum()), float(v.double().sum())]
        for k, v in session.conversation.cache.layer_kv()
    ]
    positions = session.conversation.key_positions().tolist()
    answer = "".join(session.ask(QUESTION, PARAMS))
    return summary.prompt_from_cache, [answer, session.last_answer.new_tokens], kv + [positions]


def _three_opens(rank: int, world: int, checkpoint: str, video: str, cache_dir: str, corrupt: bool):
    """First open, reopen with the saved prompt, then (optionally corrupt it) and reopen again;
    fresh sessions."""
    info = init_distributed(cuda=False)
    config = Config.from_options(model=checkpoint, cache_dir=cache_dir, decode_workers=1)
    runs = []
    for i in range(3):
        if i == 2 and corrupt and rank == 0:
            shard = next(Path(cache_dir, "prefixes").rglob("prompt-of-*.safetensors"))
            data = bytearray(shard.read_bytes())
            data[-5] ^= 0xFF  # inside the tensor data: the checksum catches it
            shard.write_bytes(bytes(data))
        if i == 2 and corrupt and world > 1:
            torch.distributed.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored, tokens, kv = _open_and_ask(RankSession(config, info), video)
        lines = [
            str(w.message)
            for w in caught
            if issubclass(w.category, CacheWarning) and "prompt" in str(w.message)
        ]
        runs.append((restored, tokens, kv, lines))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_reopen_reads_the_prompt_back_and_answers_the_same(
    tiny_checkpoints, short_video, tmp_path, world
):
    runs = run_ranks(
        _three_opens, world, tiny_checkpoints["g2"], short_video, str(tmp_path / "cache"), False
    )
    for rank_runs in runs:
        (first, tok0, kv0, _), (again, tok1, kv1, _), (third, tok2, kv2, _) = rank_runs
        assert (first, again, third) == (False, True, True)
        assert tok1 == tok0 and tok2 == tok0, "the first answer must be the same token for token"
        assert kv1 == kv0 and kv2 == kv0, (
            "the restored K/V and key positions must be the prefilled ones"
        )
    saved = sorted(p.name for p in (tmp_path / "cache" / "prefixes").rglob("*.safetensors"))
    assert saved == [f"prompt-of-{world:05d}.safetensors"], (
        "one file for all ranks (each holds the same cache)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_corrupt_saved_prompt_is_prefilled_again_with_one_warning(
    tiny_checkpoints, short_video, tmp_path, world
):
    runs = run_ranks(
        _three_opens, world, tiny_checkpoints["g2"], short_video, str(tmp_path / "cache"), True
    )
    (_, tok0, kv0, _), _, (third, tok2, kv2, lines) = runs[0]
    assert third is False and tok2 == tok0 and kv2 == kv0
    assert (
        len(lines) == 1 and "was corrupt" in lines[0] and "prefilling the prompt again" in lines[0]
    )
    for rank_runs in runs[1:]:
        assert rank_runs[2][0] is False, (
            "every rank prefills when one rank's saved prompt is damaged"
        )
    saved = list((tmp_path / "cache" / "prefixes").rglob("prompt-of-*.safetensors"))
    assert len(saved) == 1 and PrefixCache(tmp_path / "cache").entries()[0].problems == [], (
        "re-saved intact"
    )


def test_no_cache_saves_no_prompt(tiny_checkpoints, short_video, tmp_path, monkeypatch):
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "default"))
    config = Config.from_options(model=tiny_checkpoints["g2"], cache=False, decode_workers=1)
    session = RankSession(config, init_distributed(cuda=False))
    assert (
        session.load_video(VideoRequest(short_video, session.config.video)).prompt_from_cache
        is False
    )
    assert not (tmp_path / "default").exists()


def test_a_changed_video_prompt_misses_the_saved_one(
    tiny_checkpoints, short_video, tmp_path, monkeypatch
):
    """The same video, checkpoint files and features, but the video prompt written another way (the
    bare frames lvx once wrote for 241014, now in its span): the old saved prompt is never read for
    the new one; it is prefilled again and answers as a fresh prefill does."""
    from lvx_models.mplug_owl3.processor import Owl3Processor

    info = init_distributed(cuda=False)
    config = Config.from_options(
        model=tiny_checkpoints["g1"], cache_dir=str(tmp_path / "cache"), decode_workers=1
    )
    from_checkpoint = Owl3Processor.from_checkpoint.__func__

    def bare_frames(cls, checkpoint):
        processor = from_checkpoint(cls, checkpoint)
        processor.rules = dataclasses.replace(processor.rules, video_span=False)
        return processor

    with monkeypatch.context() as patch:
        patch.setattr(Owl3Processor, "from_checkpoint", classmethod(bare_frames))
        old = RankSession(config, info)
        assert old.processor.rules.video_span is False
        assert _open_and_ask(old, short_video)[0] is False  # prefilled and saved
    span = RankSession(config, info)
    assert span.processor.rules.video_span is True
    restored, tokens, kv = _open_and_ask(span, short_video)
    no_cache = dataclasses.replace(config, video=dataclasses.replace(config.video, cache=False))
    fresh = _open_and_ask(RankSession(no_cache, info), short_video)
    assert restored is False and tokens == fresh[1] and kv == fresh[2]
    assert len(PrefixCache(tmp_path / "cache").entries()) == 2, "each prompt has its own entry"
    assert _open_and_ask(RankSession(config, info), short_video)[0] is True  # its own entry is read


# ---- the store: keys, damage, world size
# --------------------------------------------------------------------------------------------------
def _key(video: Path, world: int = 1, rank: int = 0, **changes) -> PrefixKey:
    feature = FeatureKey.make(
        video,
        fps=1.0,
        max_frames=None,
        model_id="tiny",
        dtype=torch.float32,
        world_size=world,
        rank=rank,
        encoder="enc",
        plan_version=1,
    )
    key = PrefixKey.make(
        feature, checkpoint="ck", prompt_format=1, prompt_ids=torch.arange(40), device="cpu"
    )
    return dataclasses.replace(key, **changes)


def _saved(n: int = 5, layers: int = 3, seed: int = 0) -> SavedPrefix:
    g = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(1, n, 2, 4, generator=g), torch.randn(1, n, 2, 4, generator=g))
        for _ in range(layers)
    ]
    return SavedPrefix(kv, torch.arange(n).view(1, -1))


@pytest.fixture
def video(tmp_path):
    path = tmp_path / "movie.mp4"
    path.write_bytes(os.urandom(3000))
    return path


def test_every_key_component_invalidates(tmp_path, video):
    store, key = PrefixCache(tmp_path), _key(video)
    store.save(key, _saved(), video=video)
    hit = store.load(key)
    assert hit is not None and all(
        torch.equal(a[0], b[0]) for a, b in zip(hit.layers, _saved().layers)
    )
    changed = {
        "features": "other",
        "checkpoint": "ck2",
        "prompt_format": 2,
        "prompt_hash": "0" * 32,
        "prompt_tokens": 41,
        "device": "cuda",
        "world_size": 2,
        "feature_entry": "other",
        "file_id": "other",
        "format_version": 0,
        "media_attention": "latest-frame",
    }
    assert set(changed) == {f.name for f in dataclasses.fields(PrefixKey)}, (
        "a new key field needs a case here"
    )
    for name, value in changed.items():
        # a key that names the same file but differs in its manifest deletes it
        store.save(key, _saved(), video=video)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert store.load(dataclasses.replace(key, **{name: value})) is None, name
    other_ids = PrefixKey.make(
        FeatureKey.make(
            video,
            fps=1.0,
            max_frames=None,
            model_id="tiny",
            dtype=torch.float32,
            world_size=1,
            rank=0,
            encoder="enc",
            plan_version=1,
        ),
        checkpoint="ck",
        prompt_format=1,
        prompt_ids=torch.arange(1, 41),
        device="cpu",
    )
    assert other_ids.prompt_hash != key.prompt_hash and store.load(other_ids) is None
    for field, value in (
        ("fps", 2.0),
        ("encoder", "enc2"),
        ("dtype", "bfloat16"),
        ("max_frames", 9),
    ):
        feature = dataclasses.replace(
            FeatureKey.make(
                video,
                fps=1.0,
                max_frames=None,
                model_id="tiny",
                dtype=torch.float32,
                world_size=1,
                rank=0,
                encoder="enc",
                plan_version=1,
            ),
            **{field: value},
        )
        moved = PrefixKey.make(
            feature, checkpoint="ck", prompt_format=1, prompt_ids=torch.arange(40), device="cpu"
        )
        assert store.load(moved) is None, field
    assert store.load(key) is not None, "misses of other entries leave this one alone"


def test_another_world_size_is_named_in_one_line(tmp_path, video):
    store = PrefixCache(tmp_path)
    store.save(_key(video), _saved(), video=video)
    with pytest.warns(
        CacheWarning, match=r"made on 1 rank\(s\), this run has 2; prefilling it again"
    ):
        assert store.load(_key(video, world=2)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load(_key(video, world=2), owner=False) is None, "only rank 0 says it"


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_files_are_deleted_and_never_used(tmp_path, video, how):
    check_damage_is_discarded(
        PrefixCache(tmp_path),
        _key(video),
        _saved(),
        video,
        how,
        "was corrupt .*prefilling the prompt again",
    )


def test_a_folder_holding_someones_files_where_a_prompt_belongs_is_left_alone(tmp_path, video):
    store, key = PrefixCache(tmp_path), _key(video)
    check_a_folder_holding_files_is_left_alone(
        store.path(key), lambda: store.save(key, _saved(), video=video), lambda: store.load(key)
    )


def test_one_file_for_all_ranks_and_only_rank_0_discards_it(tmp_path, video):
    store = PrefixCache(tmp_path)
    assert _key(video, world=2, rank=1) == _key(video, world=2, rank=0), (
        "every rank names the same file"
    )
    path = store.save(_key(video, world=2), _saved(), video=video)
    assert store.load(_key(video, world=2, rank=1), owner=False) is not None
    damage(path, "data", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load(_key(video, world=2), owner=False) is None
    assert path.exists(), "another rank leaves the damaged file to rank 0"
    with pytest.warns(CacheWarning, match="was corrupt"):
        assert store.load(_key(video, world=2)) is None
    assert not path.exists()


def test_checkpoint_identity_follows_a_rewrite(tiny_checkpoints):
    path = Path(tiny_checkpoints["g2"])
    before = checkpoint_identity(path)
    assert checkpoint_identity(path) == before
    config = path / "config.json"
    text = config.read_text()
    config.write_text(text)
    assert checkpoint_identity(path) != before, "a rewritten config changes the identity"


def test_cache_cli_lists_and_removes_saved_prompts(tmp_path, video):
    store = PrefixCache(tmp_path)
    store.save(_key(video), _saved(), video=video.resolve())
    store.save(_key(video, world=2), _saved(), video=video.resolve())
    entries = store.entries()  # one row per number of ranks, each with an id of its own
    assert [e.world_size for e in entries] == [1, 2] and len({e.entry_id for e in entries}) == 2
    d = ["--dir", str(tmp_path)]
    out = CliRunner().invoke(cache_app, ["ls", *d])
    assert out.exit_code == 0 and "prompt" in out.output, out.output
    assert all(e.entry_id[:8] in out.output for e in entries) and "movie.mp4" in out.output
    assert "1 rank" in out.output and "2 ranks" in out.output
    assert out.output.count("no features") == 2, "no features: they are never read back"
    assert sum(e.bytes for e in entries) == sum(f.stat().st_size for f in entries[0].path.iterdir())
    out = CliRunner().invoke(cache_app, ["rm", entries[1].entry_id[:8], *d])
    assert out.exit_code == 0 and "Removed 1 entry" in out.output, out.output
    (left,) = store.entries()  # the row named went, the other stays
    assert left.world_size == 1 and left.entry_id == entries[0].path.name  # alone: the folder's
    out = CliRunner().invoke(cache_app, ["rm", left.entry_id[:8], *d])
    assert out.exit_code == 0 and "Removed 1 entry" in out.output and store.entries() == []
    store.save(_key(video), _saved(), video=video.resolve())
    assert "Removed 1 entry" in CliRunner().invoke(cache_app, ["rm", str(video), *d]).output
    store.save(_key(video), _saved(), video=video.resolve())
    out = CliRunner().invoke(cache_app, ["clear", "--yes", *d])
    assert out.exit_code == 0 and "Removed 1 entries" in out.output and store.entries() == []


def test_the_video_line_says_the_prompt_was_read_back():
    from lvx_app.engine.describe import describe_video
    from lvx_app.engine.records import VideoSummary

    summary = VideoSummary("m.mp4", 10, 1.0, 10.0, 7290, True, 0.4)
    assert "loaded from cache" in describe_video(summary)
    summary.prompt_from_cache = True
    assert "loaded from cache with its saved prompt in 0.4 s" in describe_video(summary)


def test_the_media_attention_names_a_prompt_other_than_the_default_and_keeps_its_id(tmp_path):
    """A prompt prefilled under `--media-attention latest-frame` is another entry; one under the
    default keeps the id it had before the option existed (its key without the field)."""
    video = tmp_path / "v.mp4"
    video.write_bytes(b"frames")
    key = _key(video)
    latest = dataclasses.replace(key, media_attention="latest-frame")
    assert key.media_attention is None and latest.entry_id() != key.entry_id()
    fields = {f: v for f, v in dataclasses.asdict(key).items() if f != "media_attention"}
    for name in ("world_size", "feature_entry"):
        fields.pop(name)
    assert key.entry_id() == stable_hash(fields)
