"""Sampling-plan maths (no video files): indices from time, thinning, sharding, budgets, bad
settings."""

from fractions import Fraction

import pytest

from lvx_app.config import ConfigError, VideoConfig
from lvx_app.parallel.shards import shard_bounds
from lvx_app.video.errors import CorruptVideoError, PlanTooLargeError, VideoWarning
from lvx_app.video.plan import (
    SamplingPlan,
    build_plan,
    check_memory,
    format_timestamp,
    num_samples,
    time_indices,
)


def plan(n, vfps, fps, max_frames=None, **kw):
    return build_plan(n, vfps, fps, max_frames, path="v.mp4", warn=False, **kw)


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0:00"),
        (0.999, "0:00"),
        (12.4, "0:12"),
        (754, "12:34"),
        (3599.9, "59:59"),
        (3600, "1:00:00"),
        (3723, "1:02:03"),
        (36000 + 61, "10:01:01"),
        (-3, "0:00"),
    ],
)
def test_format_timestamp(seconds, text):
    assert format_timestamp(seconds) == text


def test_one_fps_on_30fps():
    p = plan(300, 30.0, 1.0)
    assert p.indices == tuple(range(0, 300, 30))
    assert p.timestamps == pytest.approx([float(k) for k in range(10)])
    assert p.fps == 1.0 and not p.thinned and p.notes == ()


@pytest.mark.parametrize("fps", [0.1, 0.25, 0.4, 0.5, 1.0, 2.0, 3.0, 7.5])
@pytest.mark.parametrize(
    "n, vfps", [(900, 30.0), (451, 25.0), (1799, 29.97002997002997), (240, 24.0), (7, 30.0)]
)
def test_indices_follow_time(n, vfps, fps):
    """Sample k is the frame nearest t = k / fps, for fps well below 0.5 too (the anchor's step
    would be 0)."""
    idx = time_indices(n, vfps, fps)
    duration = n / vfps
    assert len(idx) == num_samples(n, vfps, fps) == max(1, -(-round(duration * fps * 1e6) // 10**6))
    assert idx[0] == 0 and all(b > a for a, b in zip(idx, idx[1:])) and idx[-1] <= n - 1
    for k, i in enumerate(idx):
        assert abs(i - min(k * vfps / fps, n - 1)) <= 0.5 + 1e-9


def test_29_97_fps_hour_long_does_not_drift():
    """10 hours at 29.97 fps sampled at 1 fps: every index equals the exact round(k *
    30000/1001)."""
    vfps = 30000 / 1001
    n = int(10 * 3600 * vfps)
    idx = time_indices(n, vfps, 1.0)
    exact = [int(Fraction(k * 30000, 1001) + Fraction(1, 2)) for k in range(len(idx))]
    assert idx == exact
    p = plan(n, vfps, 1.0)
    # nominal timestamps stay within half a frame of k seconds; a rounded step of 30 would be 36 s
    # off by now
    assert max(abs(t - k) for k, t in enumerate(p.timestamps)) <= 0.5 / vfps + 1e-6
    assert abs(len(idx) * 30 / vfps - len(idx)) > 30  # what `step = round(fps)` would have drifted


def test_exact_durations_do_not_add_a_sample():
    assert num_samples(300, 30.0, 1.0) == 10  # t = 10 s is the end of the video, not a frame
    assert num_samples(301, 30.0, 1.0) == 11
    assert num_samples(1, 30.0, 0.01) == 1
    assert num_samples(0, 30.0, 1.0) == 0


def test_fps_above_video_fps_is_clamped_with_a_warning():
    with pytest.warns(VideoWarning, match="above the video's own 30 fps"):
        p = build_plan(60, 30.0, 100.0, path="v.mp4")
    assert p.fps == 30.0 and p.requested_fps == 100.0
    assert p.indices == tuple(range(60))
    assert "above the video's own" in p.notes[0]


def test_fps_equal_to_video_fps_takes_every_frame():
    assert plan(45, 29.97, 29.97).indices == tuple(range(45))


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "abc", None, True])
def test_bad_fps_is_refused_by_its_one_validator(bad):
    """The plan takes the fps the config checked; the config is the one place a bad one is
    refused."""
    with pytest.raises(ConfigError, match="--fps must be above 0"):
        VideoConfig(fps=bad)


def test_empty_or_rateless_video():
    with pytest.raises(CorruptVideoError, match="no frames"):
        plan(0, 30.0, 1.0)
    with pytest.raises(CorruptVideoError, match="frame rate"):
        plan(10, 0.0, 1.0)


def test_max_frames_thins_uniformly():
    p = plan(3600 * 30, 30.0, 1.0, max_frames=128)
    assert len(p) == 128 and p.thinned
    full = time_indices(3600 * 30, 30.0, 1.0)
    gap = 3600 / 128
    # mPLUG-Owl3's uniform_sample
    assert list(p.indices) == [full[int(i * gap + gap / 2)] for i in range(128)]
    assert "exceed the cap of 128 frames (--max-frames, or a request's max_frames)" in p.notes[0]
    # under the cap: untouched
    assert plan(300, 30.0, 1.0, max_frames=128).indices == tuple(range(0, 300, 30))


def test_max_frames_error_mode_says_what_fits():
    with pytest.raises(
        PlanTooLargeError, match=r"gives 3600 frames, more than --max-frames 900; use --fps 0\.25"
    ):
        plan(3600 * 30, 30.0, 1.0, max_frames=900, over_max="error")
    with pytest.raises(PlanTooLargeError, match="at least 1"):
        plan(300, 30.0, 1.0, max_frames=0)


@pytest.mark.parametrize("total", [0, 1, 2, 3, 7, 64, 100, 3601])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_cover_every_frame_once(total, world):
    bounds = [shard_bounds(total, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no overlap, no gap
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_plan_shards_and_chunks(world):
    p = plan(3000, 29.97, 0.5)
    shards = p.shards(world)
    assert sum((list(s.indices) for s in shards), []) == list(p.indices)
    assert sum((list(s.timestamps) for s in shards), []) == list(p.timestamps)
    for s in shards:
        assert (s.rank, s.world_size) == (shards.index(s), world)
        chunks = s.chunks(7)
        assert [o for o, _ in chunks] == list(range(0, len(s), 7))
        assert sum((c for _, c in chunks), []) == list(s.indices)
    with pytest.raises(ValueError):
        p.shard(world, world)


def test_fewer_frames_than_ranks_leaves_empty_shards():
    p = plan(30, 30.0, 1.0)  # one frame
    shards = p.shards(4)
    assert [len(s) for s in shards] == [1, 0, 0, 0]
    assert shards[2].chunks(8) == []


def test_plan_is_deterministic_and_serialisable():
    a, b = plan(5000, 29.97, 1.3, max_frames=50), plan(5000, 29.97, 1.3, max_frames=50)
    assert a == b and a.digest() == b.digest()
    assert SamplingPlan.from_dict(a.to_dict()) == a
    assert plan(5000, 29.97, 1.2).digest() != a.digest()


def test_real_timestamps_are_used_when_given():
    p = build_plan(
        90, 30.0, 1.0, timestamps_fn=lambda idx: [i / 30.0 + 0.01 for i in idx], warn=False
    )
    assert p.timestamps == pytest.approx([0.01, 1.01, 2.01])


def test_memory_budget():
    check_memory(3600, 1.0, 8, 1000, 3600 * 1000 // 8)  # fits exactly
    check_memory(3600, 1.0, 1, 1000, None)  # no budget, no check
    with pytest.raises(PlanTooLargeError) as e:
        check_memory(3600, 1.0, 2, 1 << 20, 900 << 20)
    msg = str(e.value)
    assert (
        "900 frames fit per rank (1800 in all)" in msg and "--fps 0.5" in msg and "--gpus 4" in msg
    )
    assert "\n" not in msg


@pytest.mark.parametrize("n", [1, 7, 100, 301, 1800, 54_000])
@pytest.mark.parametrize("count", [1, 2, 8, 32, 200])
def test_spread_picks_the_frames_vllms_loader_picks(n, count):
    """`num_frames` means what it means in vLLM: its loader's np.linspace over the frame count
    (every frame when there are fewer), whatever the fps; the plan notes nothing."""
    import numpy as np

    vllm = list(range(n)) if n < count else np.linspace(0, n - 1, count, dtype=int).tolist()
    for fps in (0.1, 1.0, 60.0):
        plan = build_plan(n, 30.0, fps, spread=count)
        assert list(plan.indices) == vllm and plan.notes == ()
    assert len(build_plan(n, 30.0, 1.0, max_frames=4, spread=count).indices) == min(4, len(vllm))
