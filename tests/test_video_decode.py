"""Decoding in worker processes: the right frames come back, in parallel, and hangs/crashes are
contained."""

import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from decode_faults import AlwaysFails, AlwaysHangs, HangsInBatch
from timing import scaled
from videos import (
    make_audio_only,
    make_not_a_video,
    make_truncated,
    make_video,
    make_zero_length,
    read_index,
)

from lvx_app.video.decode import DecodePool, check_video_path, describe_range, sniff_container
from lvx_app.video.errors import (
    CorruptVideoError,
    DecodeTimeoutError,
    NotAVideoError,
    NoVideoStreamError,
    VideoNotFoundError,
)
from lvx_models.pixels import normalize


@pytest.fixture(scope="module")
def vids(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return {
        "a": make_video(d / "a.mp4", 120, 30, 64, 64),  # 4 s at 30 fps
        "ntsc": make_video(d / "ntsc.mp4", 150, Fraction(30000, 1001), 160, 96),  # 5 s at 29.97 fps
        "dir": d,
    }


@pytest.fixture(scope="module")
def raw_pool():
    with DecodePool(2, threads=1) as pool:
        yield pool


@pytest.fixture(scope="module")
def small_pool():
    with DecodePool(2, threads=1, image_size=32) as pool:
        yield pool


def decode_all(pool, path, chunks, **kw):
    got = dict(pool.decode(path, chunks, **kw))
    return np.concatenate([got[o] for o in sorted(got)]) if got else np.zeros((0,))


def test_plan_in_a_worker_uses_decords_fps_and_timestamps(raw_pool, vids):
    plan, (h, w) = raw_pool.plan(vids["ntsc"], 1.0)
    assert (h, w) == (96, 160)
    assert plan.num_video_frames == 150 and plan.video_fps == pytest.approx(30000 / 1001)
    assert plan.indices == (0, 30, 60, 90, 120, 149)  # t = 5 s is still inside the 5.005 s video
    assert plan.timestamps == pytest.approx([i * 1001 / 30000 for i in plan.indices], abs=1e-4)


@pytest.mark.parametrize("fps, chunk", [(1.0, 2), (3.0, 4), (30.0, 16), (0.3, 1)])
def test_decoded_frames_are_the_planned_ones(raw_pool, vids, fps, chunk):
    plan, _ = raw_pool.plan(vids["a"], fps)
    frames = decode_all(raw_pool, vids["a"], plan.shard(0, 1).chunks(chunk))
    assert frames.shape == (len(plan), 64, 64, 3) and frames.dtype == np.uint8
    assert [read_index(f) for f in frames] == list(plan.indices)


def test_resized_in_worker_matches_processor_transform(small_pool, raw_pool, vids):
    from lvx_models.pixels import to_pixel_values

    plan, _ = small_pool.plan(vids["ntsc"], 2.0)
    small = decode_all(small_pool, vids["ntsc"], plan.shard(0, 1).chunks(3))
    assert small.shape == (len(plan), 3, 32, 32)
    pv = normalize(torch.from_numpy(small))
    assert [read_index(f) for f in pv] == list(plan.indices)
    raw = decode_all(raw_pool, vids["ntsc"], plan.shard(0, 1).chunks(3))
    assert torch.equal(pv, to_pixel_values(raw, 32))  # the same transform, not a second one


def test_two_processes_decode_disjoint_parts(vids):
    with DecodePool(2, threads=1) as pool:
        plan, _ = pool.plan(vids["a"], 15.0)
        shard = plan.shard(1, 2)  # the second rank's half only
        frames = decode_all(pool, vids["a"], shard.chunks(5))
        assert len(set(pool.pids())) == 2
    assert [read_index(f) for f in frames] == list(shard.indices)
    assert shard.indices[0] > 0


def test_hanging_get_batch_is_killed_and_retried_frame_by_frame(vids):
    with DecodePool(1, threads=1, worker_class=HangsInBatch) as pool:
        plan, _ = pool.plan(vids["a"], 10.0)
        pid = pool.pids()[0]
        frames = decode_all(pool, vids["a"], plan.shard(0, 1).chunks(6), timeout_s=2.0)
        # the hung worker was SIGKILLed (it ignores SIGTERM) and replaced
        assert pool.pids()[0] != pid
    assert [read_index(f) for f in frames] == list(plan.indices)


def test_decode_that_keeps_hanging_names_file_and_time_range(vids):
    with DecodePool(1, threads=1, worker_class=AlwaysHangs) as pool:
        plan, _ = pool.plan(vids["a"], 10.0)
        shard = plan.shard(0, 1)
        with pytest.raises(DecodeTimeoutError) as e:
            decode_all(
                pool,
                vids["a"],
                shard.chunks(6),
                timeout_s=0.5,
                time_of=lambda o: shard.timestamps[o],
            )
    msg = str(e.value)
    assert "a.mp4 at 0:01-0:02 (frames 54-69) hung for 0.5 s" in msg
    assert "re-encode" in msg and "\n" not in msg


def test_decode_error_names_file_and_time_range(vids):
    with DecodePool(1, threads=1, worker_class=AlwaysFails) as pool:
        plan, _ = pool.plan(vids["a"], 10.0)
        shard = plan.shard(0, 1)
        with pytest.raises(
            CorruptVideoError, match=r"a\.mp4 at 0:03-0:03 \(frames 90-105\) failed"
        ):
            decode_all(pool, vids["a"], shard.chunks(6), time_of=lambda o: shard.timestamps[o])


def test_describe_range():
    assert describe_range("m.mp4", [754.2, 3723.0], [1, 2]) == "m.mp4 at 12:34-1:02:03 (frames 1-2)"


def test_bad_paths(vids, tmp_path):
    with pytest.raises(VideoNotFoundError, match="Video not found"):
        check_video_path(tmp_path / "nope.mp4")
    with pytest.raises(VideoNotFoundError, match="is a directory"):
        check_video_path(vids["dir"])
    with pytest.raises(CorruptVideoError, match="empty"):
        check_video_path(make_zero_length(tmp_path / "zero.mp4"))
    with pytest.raises(NotAVideoError, match="not a video"):
        check_video_path(make_not_a_video(tmp_path / "notes.txt"))
    assert sniff_container(vids["a"]) == "mp4/mov"


def test_unreadable_files_in_the_worker(raw_pool, vids, tmp_path):
    fake = make_not_a_video(tmp_path / "fake.mp4")  # .mp4 name, text inside
    assert check_video_path(fake) == fake.resolve()
    with pytest.raises(NotAVideoError, match="fake.mp4 is not a video"):
        raw_pool.plan(fake, 1.0)
    cut = make_truncated(vids["ntsc"], tmp_path / "cut.mp4", 0.5)
    with pytest.raises(CorruptVideoError, match="cut.mp4 cannot be opened.*truncated or damaged"):
        raw_pool.plan(cut, 1.0)
    plan, _ = raw_pool.plan(vids["a"], 1.0)  # the pool is still usable afterwards
    assert len(plan) == 4


def test_audio_only_file_says_it_has_no_video_stream(raw_pool, tmp_path):
    audio = make_audio_only(tmp_path / "talk.m4a")
    assert check_video_path(audio) == audio.resolve()  # an mp4 container: only opening it tells
    with pytest.raises(
        NoVideoStreamError,
        match=r"talk.m4a has no video stream \(audio only\?\); pass a file with video",
    ) as err:
        raw_pool.plan(audio, 1.0)
    assert "truncated" not in str(err.value) and "st_nb" not in str(err.value)


def test_a_failed_open_does_not_break_the_file_opened_before(vids, tmp_path):
    with DecodePool(1, threads=1) as pool:
        pool.plan(vids["a"], 1.0)
        with pytest.raises(NoVideoStreamError):
            pool.plan(make_audio_only(tmp_path / "talk.m4a"), 1.0)
        plan, _ = pool.plan(vids["a"], 1.0)  # the same worker opens a.mp4 again
        assert len(plan) == 4


def test_pool_is_reusable_after_an_abandoned_stream(raw_pool, vids):
    plan, _ = raw_pool.plan(vids["a"], 10.0)
    stream = raw_pool.decode(vids["a"], plan.shard(0, 1).chunks(4))
    next(stream)
    stream.close()  # the consumer gave up with requests still in flight
    frames = decode_all(raw_pool, vids["a"], plan.shard(0, 1).chunks(4))
    assert [read_index(f) for f in frames] == list(plan.indices)


@pytest.mark.slow
def test_decord_native_open_errors_do_not_reach_the_terminal(tmp_path):
    """decord's C++ logger prints '[hh:mm:ss] .../video_reader.cc:83: ERROR opening' even at QUIET;
    the user should see only our one-line error."""
    import subprocess
    import sys

    fake = make_not_a_video(tmp_path / "fake.mp4")
    script = (
        "import sys\nfrom lvx_app.video.decode import DecodePool\nfrom lvx_app.video.errors import "
        "VideoError\n"
        "with DecodePool(1) as pool:\n    try:\n        pool.plan(sys.argv[1], 1.0)\n"
        "    except VideoError as exc:\n        print(exc)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script, str(fake)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert res.returncode == 0, res.stderr
    assert "fake.mp4 is not a video decord can read" in res.stdout
    assert ".cc:" not in res.stderr and "ERROR opening" not in res.stderr, res.stderr


@pytest.mark.parametrize(
    "cores, local_ranks, workers, threads",
    [(2, 1, 2, 1), (2, 2, 1, 1), (16, 1, 8, 2), (16, 8, 2, 1), (64, 8, 8, 1), (8, 1, 8, 1)],
)
def test_decode_processes_and_their_threads_share_the_nodes_cores(
    monkeypatch, cores, local_ranks, workers, threads
):
    # every rank of the node starts its own workers: together they use the cores once
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    pool = DecodePool()
    try:
        assert (pool.num_workers, pool.threads) == (workers, threads)
        assert local_ranks * pool.num_workers * pool.threads <= cores
    finally:
        pool.close()


def test_frames_decode_under_a_temporary_folder_too_long_for_a_socket(short_video, tmp_path):
    """The forkserver's socket lives in multiprocessing's temporary folder; under a long TMPDIR
    its path would pass the 107 bytes an AF_UNIX socket may have, and the first video to open
    would fail."""
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    code = (
        "import sys\nfrom lvx_app.video.decode import DecodePool\n"
        "with DecodePool(1, threads=1, image_size=16) as pool:\n"
        "    plan, _ = pool.plan(sys.argv[1], 1.0)\n"
        "    frames = [f for _, f in pool.decode(sys.argv[1], [(0, plan.indices[:2])])]\n"
        "print(frames[0].shape)\n"
    )
    env = dict(os.environ, TMPDIR=str(deep))
    done = subprocess.run(
        [sys.executable, "-c", code, short_video], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(2, 3, 16, 16)"
    assert not list(deep.iterdir()), "nothing is left in the temporary folder"
