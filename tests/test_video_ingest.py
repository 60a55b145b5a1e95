"""`ingest()`: features of the right frames, cache reuse, 2 gloo ranks == 1 rank, and every bad
input."""

import sys
import warnings
from fractions import Fraction

import pytest
import torch
from timing import scaled
from videos import (
    IndexEncoder,
    index_from_features,
    make_not_a_video,
    make_truncated,
    make_video,
    make_zero_length,
)

from lvx_app.cache import CacheWarning
from lvx_app.config import ConfigError, VideoConfig
from lvx_app.video import (
    CorruptVideoError,
    DecodePool,
    Encoder,
    FeatureCache,
    IngestTuning,
    NotAVideoError,
    PlanTooLargeError,
    VideoNotFoundError,
    VideoWarning,
    ingest,
)
from scripts.gloo_ranks import RankFailed, run_ranks

S = 32  # image size: tiny, the index blocks survive the resize


@pytest.fixture(scope="module")
def vids(tmp_path_factory):
    d = tmp_path_factory.mktemp("ingest")
    return {
        "a": make_video(d / "a.mp4", 120, 30, 64, 64),
        "ntsc": make_video(
            d / "ntsc.mp4", 300, Fraction(30000, 1001), 160, 96
        ),  # 10 s at 29.97 fps
    }


@pytest.fixture(scope="module")
def pool():
    with DecodePool(2, threads=1, image_size=S) as p:
        yield p


def run(path, pool, **kw):
    """ingest() with the test's encoder and pool; `kw` names VideoConfig, Encoder, IngestTuning and
    ingest's own arguments alike."""
    video = {k: kw.pop(k) for k in ("fps", "max_frames", "cache_dir") if k in kw}
    video["cache"] = kw.pop("cache", "cache_dir" in video)
    encoder = Encoder(IndexEncoder(), image_size=S, model_id=kw.pop("model_id", "unknown"))
    tuning = {k: kw.pop(k) for k in ("over_max", "memory_budget_bytes") if k in kw}
    tuning["chunk_frames"] = kw.pop("chunk_frames", 3)
    kw.setdefault("progress", False)
    return ingest(
        path,
        encoder,
        VideoConfig(**video),
        device="cpu",
        pool=pool,
        tuning=IngestTuning(**tuning),
        **kw,
    )


def test_features_belong_to_the_planned_frames(vids, pool):
    events = []
    shard = run(vids["ntsc"], pool, fps=2.0, progress=events.append)
    plan = shard.plan
    assert shard.features.shape == (len(plan), 4, 16) and shard.features.dtype == torch.float32
    assert index_from_features(shard.features) == shard.frame_indices.tolist() == list(plan.indices)
    assert (
        plan.indices[:4] == (0, 15, 30, 45) and plan.indices[-2:] == (285, 299) and len(plan) == 21
    )
    assert shard.timestamps.tolist() == pytest.approx(
        [i * 1001 / 30000 for i in plan.indices], abs=1e-4
    )
    assert shard.labels()[:4] == ["0:00", "0:00", "0:01", "0:01"]
    assert (shard.rank, shard.world_size, shard.frame_offset, shard.from_cache) == (0, 1, 0, False)
    assert shard.positions.tolist() == list(range(21))
    done = [e.done for e in events if e.stage == "ingest"]
    assert (
        done == sorted(done)
        and done[-1] == 21
        and events[-1].stage == "done"
        and events[-1].total == 21
    )


def test_second_ingest_comes_from_the_cache_without_decoding(vids, pool, tmp_path, monkeypatch):
    first = run(vids["a"], pool, fps=5.0, cache_dir=tmp_path, model_id="tiny", dtype=torch.bfloat16)
    assert not first.from_cache and first.features.dtype == torch.bfloat16

    def no_decoding(*a, **k):
        raise AssertionError("a cache hit must not decode")

    monkeypatch.setattr(pool, "plan", no_decoding)
    again = run(vids["a"], pool, fps=5.0, cache_dir=tmp_path, model_id="tiny", dtype=torch.bfloat16)
    assert again.from_cache and torch.equal(again.features, first.features)
    assert again.plan == first.plan and torch.equal(again.frame_indices, first.frame_indices)
    monkeypatch.undo()
    other = run(
        vids["a"], pool, fps=5.0, cache_dir=tmp_path, model_id="another-model", dtype=torch.bfloat16
    )
    assert not other.from_cache


def test_corrupt_cache_entry_is_rebuilt(vids, pool, tmp_path):
    first = run(vids["a"], pool, fps=3.0, cache_dir=tmp_path)
    (f,) = list((tmp_path / "features").rglob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.warns(CacheWarning, match="was corrupt .*re-encoding the frames"):
        again = run(vids["a"], pool, fps=3.0, cache_dir=tmp_path)
    assert not again.from_cache and torch.equal(again.features, first.features)
    assert run(vids["a"], pool, fps=3.0, cache_dir=tmp_path).from_cache


def _rank_ingest(rank, world, path, cache_dir, fps, max_frames):
    events = []
    shard = ingest(
        path,
        Encoder(IndexEncoder(), image_size=S),
        VideoConfig(fps=fps, max_frames=max_frames, cache_dir=cache_dir, decode_workers=1),
        device="cpu",
        tuning=IngestTuning(decode_threads=1, chunk_frames=2),
        progress=events.append,
    )
    # numpy, not tensors: run_ranks' queue would share tensors through fds that vanish when the rank
    # exits
    return (
        shard.features.numpy(),
        shard.frame_indices.tolist(),
        shard.frame_offset,
        shard.from_cache,
        shard.plan,
        [(e.stage, e.done, e.total) for e in events],
    )


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_rank(vids, pool, tmp_path):
    single = run(vids["ntsc"], pool, fps=1.5)
    out = run_ranks(_rank_ingest, 2, str(vids["ntsc"]), str(tmp_path), 1.5, None)
    feats = torch.cat([torch.from_numpy(o[0]) for o in out])
    assert index_from_features(feats) == list(single.plan.indices)
    # equal up to the matmul's batch-size rounding
    torch.testing.assert_close(feats, single.features)
    assert out[0][1] + out[1][1] == list(single.plan.indices)
    assert [o[2] for o in out] == [0, len(out[0][1])] and len(out[0][1]) - len(out[1][1]) in (0, 1)
    assert all(o[4] == single.plan for o in out) and not any(o[3] for o in out)
    for o in out:  # every rank saw the global counts
        ingest_events = [e for e in o[5] if e[0] == "ingest"]
        assert ingest_events[-1][1:] == (len(single.plan), len(single.plan))
    again = run_ranks(_rank_ingest, 2, str(vids["ntsc"]), str(tmp_path), 1.5, None)
    assert all(o[3] for o in again) and torch.equal(
        torch.cat([torch.from_numpy(o[0]) for o in again]), feats
    )
    # fewer frames than ranks: rank 1 owns nothing but still has (0, T, H) features
    tiny = run_ranks(_rank_ingest, 2, str(vids["ntsc"]), str(tmp_path), 1.0, 1)
    assert tiny[0][0].shape == (1, 4, 16) and tiny[1][0].shape == (0, 4, 16) and tiny[1][2] == 1


def _rank_ingest_bad_on_one(rank, world, good, bad):
    return ingest(
        bad if rank == 1 else good,
        Encoder(IndexEncoder(), image_size=S),
        VideoConfig(fps=1.0, cache=False, decode_workers=1),
        device="cpu",
        progress=False,
    ).num_frames


@pytest.mark.slow
def test_an_error_on_one_rank_is_raised_on_every_rank(vids, tmp_path):
    with pytest.raises(RankFailed) as e:
        run_ranks(
            _rank_ingest_bad_on_one,
            2,
            str(vids["a"]),
            str(tmp_path / "missing.mp4"),
            timeout_s=scaled(60),
        )
    # rank 0 re-raises rank 1's error, no hang
    assert "VideoNotFoundError: Video not found" in str(e.value)


def test_bad_inputs(vids, pool, tmp_path):
    with pytest.raises(VideoNotFoundError, match="Video not found"):
        run(tmp_path / "missing.mp4", pool)
    with pytest.raises(NotAVideoError, match="not a video"):
        run(make_not_a_video(tmp_path / "notes.txt"), pool)
    with pytest.raises(NotAVideoError, match="is not a video decord can read"):
        run(make_not_a_video(tmp_path / "fake.mp4"), pool)
    with pytest.raises(CorruptVideoError, match="empty"):
        run(make_zero_length(tmp_path / "zero.mp4"), pool)
    with pytest.raises(CorruptVideoError, match="truncated or damaged"):
        run(make_truncated(vids["ntsc"], tmp_path / "cut.mp4", 0.6), pool)
    for fps in (0, -2.0, float("nan")):  # checked once, where the options are made
        with pytest.raises(ConfigError, match="--fps must be above 0"):
            run(vids["a"], pool, fps=fps)


def test_fps_above_the_videos_is_clamped(vids, pool):
    with pytest.warns(VideoWarning, match="above the video's own 30 fps; using 30"):
        shard = run(vids["a"], pool, fps=120.0, chunk_frames=40)
    assert shard.plan.fps == 30.0 and shard.frame_indices.tolist() == list(range(120))
    assert index_from_features(shard.features) == list(range(120))


def test_max_frames_thins_or_refuses(vids, pool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VideoWarning)
        shard = run(vids["a"], pool, fps=10.0, max_frames=8)
    assert shard.plan.thinned and len(shard.plan) == 8
    assert index_from_features(shard.features) == list(shard.plan.indices)
    with pytest.raises(
        PlanTooLargeError, match=r"gives 40 frames, more than --max-frames 8; use --fps 2"
    ):
        run(vids["a"], pool, fps=10.0, max_frames=8, over_max="error")


def test_memory_budget_error_says_what_fits(vids, pool):
    per_frame = 4 * 16 * 4  # T * H * float32
    fits = r"41 frames at 4 fps .* 11 frames fit per rank \(11 in all\); use --fps 1 or --gpus 4"
    with pytest.raises(PlanTooLargeError, match=fits):
        run(vids["ntsc"], pool, fps=4.0, memory_budget_bytes=11 * per_frame)
    assert run(vids["ntsc"], pool, fps=1.0, memory_budget_bytes=11 * per_frame).num_frames == 11


def test_cache_folder_from_environment(vids, pool, tmp_path, monkeypatch):
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "envcache"))
    run(vids["a"], pool, fps=1.0, cache=True)
    assert len(FeatureCache().entries()) == 1


def test_rich_progress_renders(vids, pool, capsys):
    ingest_mod = sys.modules["lvx_app.video.ingest"]
    bar = ingest_mod.RichProgress("Ingesting a.mp4")
    shard = run(vids["a"], pool, fps=2.0, progress=bar)
    assert shard.num_frames == 8 and bar.task is not None
    assert "Ingesting a.mp4" in capsys.readouterr().err
