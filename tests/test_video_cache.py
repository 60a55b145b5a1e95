"""The visual-feature cache: keys, hits and misses, corruption, atomic writes, and `lvx cache`."""

import os
import sys

import pytest
import torch
from typer.testing import CliRunner

from lvx_app.cli.cache import cache_app
from lvx_app.video.errors import VideoWarning
from lvx_app.video.feature_cache import CacheKey, FeatureCache, default_cache_dir, file_identity
from lvx_app.video.plan import build_plan


@pytest.fixture
def video(tmp_path):
    p = tmp_path / "movie.mp4"
    p.write_bytes(os.urandom(3 << 20))  # content only matters for the identity hash
    return p


def key_for(video, **kw):
    args = dict(
        fps=1.0,
        max_frames=None,
        model_id="tiny",
        model_revision="r1",
        dtype=torch.bfloat16,
        world_size=2,
        rank=0,
        image_size=32,
    )
    args.update(kw)
    return CacheKey.make(video, **args)


def save_shard(cache, key, video, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, 3, 8, generator=g).to(torch.bfloat16)
    plan = build_plan(300, 30.0, 1.0, path=str(video), warn=False)
    shard = plan.shard(key.rank, key.world_size)
    cache.save(
        key,
        feats,
        shard.indices,
        shard.timestamps,
        plan=plan,
        frame_offset=shard.start,
        video=video,
    )
    return feats, plan, shard


def test_default_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert FeatureCache().root == tmp_path / "c"
    monkeypatch.delenv("LVX_CACHE_DIR")
    assert default_cache_dir() == os.path.expanduser("~/.cache/lvx") or str(
        default_cache_dir()
    ).endswith(".cache/lvx")


def test_file_identity(video):
    a = file_identity(video)
    assert a == file_identity(video)
    data = bytearray(video.read_bytes())
    data[-10] ^= 0xFF  # a change in the last MiB
    st = video.stat()
    video.write_bytes(bytes(data))
    # same size and mtime: the tail bytes still differ
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_identity(video) != a
    b = file_identity(video)
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched
    assert file_identity(video) != b


def test_hit_and_misses(tmp_path, video):
    cache = FeatureCache(tmp_path / "cache")
    key = key_for(video)
    assert cache.load(key) is None
    feats, plan, shard = save_shard(cache, key, video)
    got = cache.load(key)
    assert (
        got is not None
        and torch.equal(got.features, feats)
        and got.features.dtype == torch.bfloat16
    )
    assert got.plan == plan and got.frame_offset == shard.start == 0
    assert got.frame_indices.tolist() == list(shard.indices)
    assert got.timestamps.tolist() == pytest.approx(shard.timestamps)
    for other in (
        dict(fps=2.0),
        dict(max_frames=100),
        dict(model_id="other"),
        dict(model_revision="r2"),
        dict(dtype=torch.float32),
        dict(world_size=4),
        dict(rank=1),
        dict(image_size=384),
    ):
        assert cache.load(key_for(video, **other)) is None, other
    assert key_for(video, rank=1).entry_id() == key.entry_id()  # ranks share an entry folder


def corrupt_byte(path, where):
    data = bytearray(path.read_bytes())
    data[where] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["data", "header", "truncate", "empty", "other_key", "a folder"])
def test_corrupt_entries_are_detected_deleted_and_never_used(tmp_path, video, damage):
    cache = FeatureCache(tmp_path / "cache")
    key = key_for(video)
    save_shard(cache, key, video)
    path = cache.shard_path(key)
    if damage == "data":
        corrupt_byte(path, path.stat().st_size - 7)  # inside the tensor bytes
    elif damage == "header":
        corrupt_byte(path, 12)
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "a folder":  # a file replaced by a folder never healed
        path.unlink()
        (path / "inside").mkdir(parents=True)
    else:  # a valid file of another key renamed into place
        other = key_for(video, fps=2.0)
        save_shard(cache, other, video)
        os.replace(cache.shard_path(other), path)
    with pytest.warns(VideoWarning, match="corrupt") as caught:
        assert cache.load(key) is None
    assert len(caught) == 1 and not path.exists()
    save_shard(cache, key, video)  # rebuilt
    assert cache.load(key) is not None


def test_writes_are_atomic(tmp_path, video, monkeypatch):
    cache = FeatureCache(tmp_path / "cache")
    key = key_for(video)
    good, _, _ = save_shard(cache, key, video, seed=1)
    cache_mod = sys.modules["lvx_app.video.feature_cache"]

    def crash(src, dst):
        raise OSError("disk died during rename")

    monkeypatch.setattr(cache_mod.os, "replace", crash)
    with pytest.raises(OSError, match="disk died"):
        save_shard(cache, key, video, seed=2)
    monkeypatch.undo()
    folder = cache.shard_path(key).parent
    # no temp file left behind
    assert [p.name for p in folder.iterdir()] == [cache.shard_path(key).name]
    got = cache.load(key)
    assert got is not None and torch.equal(got.features, good)  # the old entry is intact

    real = cache_mod.save_file

    def half_write(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(cache_mod, "save_file", half_write)
    with pytest.raises(KeyboardInterrupt):
        save_shard(cache, key, video, seed=3)
    monkeypatch.undo()
    assert len(list(folder.iterdir())) == 1
    assert torch.equal(cache.load(key).features, good)


def test_entries_remove_clear(tmp_path, video):
    cache = FeatureCache(tmp_path / "cache")
    for rank in range(2):
        save_shard(cache, key_for(video, rank=rank), video)
    other = tmp_path / "other.mp4"
    other.write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(1000))
    save_shard(cache, key_for(other, world_size=1), other)
    entries = {e.video: e for e in cache.entries()}
    e = entries[str(video)]
    assert (e.shards, e.world_size, e.frames, e.model, e.dtype) == (2, 2, 10, "tiny@r1", "bfloat16")
    assert cache.remove(str(video)) == [e.entry_id]
    assert [x.video for x in cache.entries()] == [str(other)]
    assert cache.remove(cache.entries()[0].entry_id[:6])
    assert cache.entries() == [] and cache.remove("zzzz") == []
    save_shard(cache, key_for(video), video)
    assert cache.clear() == 1 and cache.entries() == []


def test_cli(tmp_path, video):
    cache = FeatureCache(tmp_path / "cache")
    save_shard(cache, key_for(video, world_size=1), video)
    run = CliRunner().invoke
    d = ["--dir", str(cache.root)]
    out = run(cache_app, ["ls", *d])
    assert out.exit_code == 0, out.output
    assert "movie.mp4" in out.output and "tiny@r1" in out.output and "1/1" in out.output
    entry = cache.entries()[0].entry_id
    out = run(cache_app, ["rm", "nothing-here", *d])
    assert out.exit_code == 1 and "Nothing cached matches" in out.output
    out = run(cache_app, ["rm", entry[:8], *d])
    assert out.exit_code == 0 and "Removed 1 entry" in out.output
    assert "is empty" in run(cache_app, ["ls", *d]).output
    save_shard(cache, key_for(video, world_size=1), video)
    assert run(cache_app, ["clear", *d], input="n\n").exit_code == 1
    assert len(cache.entries()) == 1
    out = run(cache_app, ["clear", "--yes", *d])
    assert out.exit_code == 0 and "Removed 1 entries" in out.output and cache.entries() == []
    assert run(cache_app, ["rm", *d]).exit_code == 2
    save_shard(cache, key_for(video, world_size=1), video)
    assert "ok" in run(cache_app, ["ls", *d]).output
    os.utime(video, ns=(0, 10**9))  # the video changed since: its entry can never be hit again
    assert "video changed" in run(cache_app, ["ls", *d]).output
    out = run(cache_app, ["rm", "--stale", *d])
    assert "Removed 1 stale entry" in out.output and cache.entries() == []
