"""Saved visual K/V: a reopened video reads its hyper layers' K/V back and answers token for token
like a fresh computation (1 and 2 ranks); "auto" saves them only when computing them measured
clearly slower than reading them back; another checkpoint or world size never reuses them; a damaged
file is recomputed with one warning."""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from cache_damage import (
    DAMAGES,
    check_a_folder_holding_files_is_left_alone,
    check_damage_is_discarded,
)
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import lvx_app.engine.resident_visual_kv as visual_kv
from lvx_app.cache import CacheWarning, FeatureKey, VisualKVCache, VisualKVKey
from lvx_app.cli.cache import cache_app
from lvx_app.config import Config, ConfigError, GenerationConfig
from lvx_app.engine.records import VideoRequest
from lvx_app.engine.resident_visual_kv import should_save
from lvx_app.engine.session import RankSession
from lvx_app.parallel.group import init_distributed
from scripts.gloo_ranks import run_ranks

PARAMS = GenerationConfig(max_new_tokens=8)
QUESTION = "what happens in the video?"


def _open_and_ask(session: RankSession, video: str) -> dict:
    summary = session.load_video(VideoRequest(video, session.config.video))
    visual = {
        layer: [float(k.double().sum()), float(v.double().sum())]
        for layer, (k, v) in session.conversation.visual.kv.items()
    }
    text = [
        [float(k.double().sum()), float(v.double().sum())]
        for k, v in session.conversation.cache.layer_kv()
    ]
    answer = "".join(session.ask(QUESTION, PARAMS))
    return {
        "read back": summary.visual_kv_from_cache,
        "prompt read back": summary.prompt_from_cache,
        "saved": session.video.loaded.visual_kv.saved,
        "tokens": [answer, session.last_answer.new_tokens],
        "visual": visual,
        "text": text,
    }


def saving_config(checkpoint: str, cache_dir: str) -> Config:
    """Resident visual K/V, saved at every first open."""
    return Config.from_options(
        model=checkpoint,
        cache_dir=cache_dir,
        decode_workers=1,
        kv_mode="cache",
        save_visual_kv="always",
    )


def _three_opens(rank: int, world: int, checkpoint: str, video: str, cache_dir: str, corrupt: bool):
    """First open (saves the K/V), reopen (reads them and the prompt back), then without the saved
    prompt (its prefill runs on the read-back K/V; optionally with rank 0's K/V file damaged); fresh
    sessions."""
    info = init_distributed(cuda=False)
    config = saving_config(checkpoint, cache_dir)
    runs = []
    for i in range(3):
        if i == 2 and rank == 0:
            shutil.rmtree(Path(cache_dir, "prefixes"))
            if corrupt:
                shard = next(Path(cache_dir, "visual-kv").rglob("shard-00000-*.safetensors"))
                data = bytearray(shard.read_bytes())
                data[-5] ^= 0xFF  # inside the tensor data: the checksum catches it
                shard.write_bytes(bytes(data))
        if i == 2 and world > 1:
            torch.distributed.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = _open_and_ask(RankSession(config, info), video)
        run["warnings"] = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
        runs.append(run)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_reopen_reads_the_visual_kv_back_and_answers_the_same(
    tiny_checkpoints, short_video, tmp_path, world
):
    runs = run_ranks(
        _three_opens, world, tiny_checkpoints["g2"], short_video, str(tmp_path / "cache"), False
    )
    for first, again, third in runs:
        assert (first["read back"], again["read back"], third["read back"]) == (False, True, True)
        assert (again["prompt read back"], third["prompt read back"]) == (True, False)
        assert first["saved"] and not again["saved"]
        for run in (again, third):
            assert run["tokens"] == first["tokens"], "the answer must be the same token for token"
            assert run["visual"] == first["visual"] and run["text"] == first["text"]
        assert third["warnings"] == []
    saved = sorted(p.name for p in (tmp_path / "cache" / "visual-kv").rglob("*.safetensors"))
    assert saved == [f"shard-{r:05d}-of-{world:05d}.safetensors" for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_corrupt_saved_visual_kv_is_recomputed_with_one_warning(
    tiny_checkpoints, short_video, tmp_path, world
):
    runs = run_ranks(
        _three_opens, world, tiny_checkpoints["g2"], short_video, str(tmp_path / "cache"), True
    )
    first, _, third = runs[0]
    assert third["read back"] is False and third["saved"], "recomputed and saved again"
    assert (
        third["tokens"] == first["tokens"]
        and third["visual"] == first["visual"]
        and third["text"] == first["text"]
    )
    assert len(third["warnings"]) == 1, third["warnings"]
    assert "saved visual K/V" in third["warnings"][0] and "was corrupt" in third["warnings"][0]
    assert "recomputing them from the features" in third["warnings"][0]
    for rank_runs in runs[1:]:
        assert rank_runs[2]["read back"] is False, (
            "every rank computes when one rank's saved K/V are damaged"
        )
        assert rank_runs[2]["warnings"] == []
    assert VisualKVCache(tmp_path / "cache").entries()[0].problems == [], "re-saved intact"


# ---- the decision
# --------------------------------------------------------------------------------------------------
def test_should_save_compares_the_measured_compute_with_the_read_estimate():
    assert should_save("auto", 2.1, 10**9, bytes_per_s=1e9, margin=2.0)
    assert not should_save("auto", 1.9, 10**9, bytes_per_s=1e9, margin=2.0)
    assert not should_save("auto", 0.02, 2.7e9, bytes_per_s=1e9, margin=2.0), (
        "a GPU's projection: never save"
    )
    assert should_save("auto", 10.7, 854 * 2**20, bytes_per_s=1e9, margin=2.0), (
        "the CPU benchmark: save"
    )
    assert should_save("always", 0.0, 10**12) and not should_save("never", 100.0, 1)
    with pytest.raises(ValueError, match="use auto, always, never"):
        should_save("sometimes", 1.0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("bytes_per_s, saves", [(1e18, True), (1.0, False)])
def test_auto_saves_only_when_reading_back_is_cheaper(
    tiny_checkpoints, short_video, tmp_path, monkeypatch, bytes_per_s, saves
):
    monkeypatch.setattr(visual_kv, "VISUAL_KV_READ_BYTES_PER_S", bytes_per_s)
    config = Config.from_options(
        model=tiny_checkpoints["g2"], cache_dir=str(tmp_path), decode_workers=1, kv_mode="cache"
    )
    session = RankSession(config, init_distributed(cuda=False))
    session.load_video(VideoRequest(short_video, session.config.video))
    choice = session.video.loaded.visual_kv
    assert choice.saved is saves and choice.compute_s > 0 and choice.nbytes > 0
    assert choice.read_s == pytest.approx(choice.nbytes / bytes_per_s)
    assert (tmp_path / "visual-kv").is_dir() is saves
    line = session.summarize_stats([session.local_stats()])["visual K/V"]
    assert (
        ("saved for the next open" if saves else "not saved") in line
        and "compute" in line
        and "read" in line
    )
    again = RankSession(config, init_distributed(cuda=False))
    assert (
        again.load_video(VideoRequest(short_video, again.config.video)).visual_kv_from_cache
        is saves
    )


def test_recompute_mode_and_no_cache_save_nothing(
    tiny_checkpoints, short_video, tmp_path, monkeypatch
):
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "default"))
    for config in (
        Config.from_options(
            model=tiny_checkpoints["g2"],
            cache_dir=str(tmp_path / "c"),
            decode_workers=1,
            kv_mode="recompute",
            save_visual_kv="always",
        ),
        Config.from_options(
            model=tiny_checkpoints["g2"],
            cache=False,
            decode_workers=1,
            kv_mode="cache",
            save_visual_kv="always",
        ),
    ):
        session = RankSession(config, init_distributed(cuda=False))
        session.load_video(VideoRequest(short_video, session.config.video))
        assert not session.video.loaded.visual_kv.saved
    assert not (tmp_path / "c" / "visual-kv").exists() and not (tmp_path / "default").exists()
    with pytest.raises(ConfigError, match="unknown save_visual_kv 'maybe'"):
        Config.from_options(model=tiny_checkpoints["g2"], cache=False, save_visual_kv="maybe")


def test_changed_hyper_weights_are_not_reused(tiny_checkpoints, short_video, tmp_path):
    """Same features (the encoder is unchanged), other v_kv_proj: the K/V are computed again with
    the new weights."""
    checkpoint = shutil.copytree(tiny_checkpoints["g2"], tmp_path / "ck")
    config = Config.from_options(
        model=str(checkpoint),
        cache_dir=str(tmp_path / "cache"),
        decode_workers=1,
        kv_mode="cache",
        save_visual_kv="always",
    )
    RankSession(config, init_distributed(cuda=False)).load_video(
        VideoRequest(short_video, config.video)
    )
    weights = load_file(str(checkpoint / "model.safetensors"))
    name = next(n for n in weights if n.endswith("v_kv_proj.weight"))
    weights[name] = weights[name] * 2
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    session = RankSession(config, init_distributed(cuda=False))
    summary = session.load_video(VideoRequest(short_video, session.config.video))
    assert summary.from_cache and not summary.visual_kv_from_cache
    no_cache = dataclasses.replace(config, video=dataclasses.replace(config.video, cache=False))
    fresh = RankSession(no_cache, init_distributed(cuda=False))
    fresh.load_video(VideoRequest(short_video, fresh.config.video))
    for layer, (k, v) in fresh.conversation.visual.kv.items():
        assert torch.equal(session.conversation.visual.kv[layer][0], k) and torch.equal(
            session.conversation.visual.kv[layer][1], v
        )


# ---- the store: keys, damage, listing
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def video(tmp_path):
    path = tmp_path / "movie.mp4"
    path.write_bytes(os.urandom(3000))
    return path


def _key(video: Path, world: int = 1, rank: int = 0) -> VisualKVKey:
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
    return VisualKVKey.make(
        feature,
        checkpoint="ck",
        media_starts=torch.arange(4) * 7,
        device="cpu",
        dtype=torch.float32,
    )


def _kv(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        layer: (torch.randn(1, 6, 2, 4, generator=g), torch.randn(1, 6, 2, 4, generator=g))
        for layer in (1, 3)
    }


def test_every_key_component_invalidates(tmp_path, video):
    store, key = VisualKVCache(tmp_path), _key(video)
    store.save(key, _kv(), video=video)
    hit = store.load(key)
    assert hit is not None and all(
        torch.equal(hit[i][j], _kv()[i][j]) for i in (1, 3) for j in (0, 1)
    )
    changed = {
        "features": "other",
        "checkpoint": "ck2",
        "media_hash": "0" * 32,
        "device": "cuda",
        "dtype": "bfloat16",
        "world_size": 2,
        "rank": 1,
        "file_id": "other",
        "format_version": 0,
    }
    assert set(changed) == {f.name for f in dataclasses.fields(VisualKVKey)}, (
        "a new key field needs a case here"
    )
    for name, value in changed.items():
        store.save(key, _kv(), video=video)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert store.load(dataclasses.replace(key, **{name: value})) is None, name
    assert store.load(_key(video, world=2)) is None, "another world size is another feature entry"
    moved = VisualKVKey.make(
        FeatureKey.make(
            video,
            fps=1.0,
            max_frames=None,
            model_id="tiny",
            dtype=torch.float32,
            world_size=1,
            rank=0,
            encoder="enc",
            layout="zigzag",
            plan_version=1,
        ),
        checkpoint="ck",
        media_starts=torch.arange(4) * 7,
        device="cpu",
        dtype=torch.float32,
    )
    assert moved.features != key.features and store.load(moved) is None, (
        "another layout is another feature entry"
    )
    assert store.load(key) is not None, "misses of other entries leave this one alone"


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_files_are_deleted_and_never_used(tmp_path, video, how):
    check_damage_is_discarded(
        VisualKVCache(tmp_path),
        _key(video),
        _kv(),
        video,
        how,
        "saved visual K/V .* was corrupt .*recomputing them from the features",
    )


def test_a_folder_holding_someones_files_where_visual_kv_belong_is_left_alone(tmp_path, video):
    store, key = VisualKVCache(tmp_path), _key(video)
    check_a_folder_holding_files_is_left_alone(
        store.path(key), lambda: store.save(key, _kv(), video=video), lambda: store.load(key)
    )


def test_cache_cli_lists_and_removes_saved_visual_kv(tmp_path, video):
    store = VisualKVCache(tmp_path)
    store.save(_key(video), _kv(), video=video.resolve())
    store.save(_key(video, world=2), _kv(), video=video.resolve())
    entries = store.entries()
    assert len(entries) == 2 and sorted(e.world_size for e in entries) == [1, 2]
    d = ["--dir", str(tmp_path)]
    out = CliRunner().invoke(cache_app, ["ls", *d])
    assert out.exit_code == 0 and "visual K/V" in out.output, out.output
    assert all(e.entry_id[:8] in out.output for e in entries) and "movie.mp4" in out.output
    assert entries[0].bytes == sum(
        f.stat().st_size for f in (tmp_path / "visual-kv" / entries[0].entry_id).iterdir()
    )
    out = CliRunner().invoke(cache_app, ["rm", entries[0].entry_id[:6], *d])
    assert out.exit_code == 0 and "Removed 1 entry" in out.output and len(store.entries()) == 1
    assert "Removed 1 entry" in CliRunner().invoke(cache_app, ["rm", str(video), *d]).output
    assert store.entries() == []
    store.save(_key(video), _kv(), video=video.resolve())
    out = CliRunner().invoke(cache_app, ["clear", "--yes", *d])
    assert out.exit_code == 0 and "Removed 1 entries" in out.output and store.entries() == []


def test_the_video_line_says_the_visual_kv_were_read_back():
    from lvx_app.engine.describe import describe_video
    from lvx_app.engine.records import VideoSummary

    summary = VideoSummary("m.mp4", 10, 1.0, 10.0, 7290, True, 0.4, prompt_from_cache=True)
    assert "with its saved prompt in 0.4 s" in describe_video(summary)
    summary.visual_kv_from_cache = True
    assert "with its saved prompt and visual K/V in 0.4 s" in describe_video(summary)
