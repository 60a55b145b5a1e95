"""The visual-feature cache: keys, hits and misses, corruption, atomic writes, and `lvx cache`."""

import dataclasses
import errno
import os
import re
import shutil

import pytest
import torch
from cache_damage import check_a_folder_holding_files_is_left_alone
from typer.testing import CliRunner

import lvx_app.cache.files as cache_files
from lvx_app.cache import (
    CacheFolder,
    CacheWarning,
    FeatureCache,
    FeatureKey,
    PrefixCache,
    PrefixKey,
    SavedPrefix,
    VisualKVCache,
    VisualKVKey,
    file_identity,
    short_ids,
)
from lvx_app.cli.cache import cache_app
from lvx_app.defaults import default_cache_dir
from lvx_app.video.plan import PLAN_VERSION, build_plan


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
    return FeatureKey.make(video, plan_version=PLAN_VERSION, **args)


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
        plan=plan.to_dict(),
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
    assert got.plan == plan.to_dict() and got.frame_offset == shard.start == 0
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
    path = cache.path(key)
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
        os.replace(cache.path(other), path)
    with pytest.warns(CacheWarning, match="corrupt") as caught:
        assert cache.load(key) is None
    assert len(caught) == 1 and not path.exists()
    save_shard(cache, key, video)  # rebuilt
    assert cache.load(key) is not None


def test_a_folder_holding_someones_files_where_features_belong_is_left_alone(tmp_path, video):
    cache, key = FeatureCache(tmp_path / "cache"), key_for(video)

    def save():
        save_shard(cache, key, video)
        return cache.path(key) if cache.path(key).is_file() else None

    check_a_folder_holding_files_is_left_alone(cache.path(key), save, lambda: cache.load(key))


def test_writes_are_atomic(tmp_path, video, monkeypatch):
    cache = FeatureCache(tmp_path / "cache")
    key = key_for(video)
    good, _, _ = save_shard(cache, key, video, seed=1)

    def crash(src, dst):
        raise OSError(errno.EIO, "disk died during rename")

    monkeypatch.setattr(cache_files.os, "replace", crash)
    with pytest.warns(CacheWarning, match="could not save the visual features .*disk died"):
        assert save_shard(cache, key, video, seed=2)[0] is not None  # the load goes on
    monkeypatch.undo()
    folder = cache.path(key).parent
    # no temp file left behind
    assert [p.name for p in folder.iterdir()] == [cache.path(key).name]
    got = cache.load(key)
    assert got is not None and torch.equal(got.features, good)  # the old entry is intact

    real = cache_files.save_file

    def half_write(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(cache_files, "save_file", half_write)
    with pytest.raises(KeyboardInterrupt):
        save_shard(cache, key, video, seed=3)
    monkeypatch.undo()
    assert len(list(folder.iterdir())) == 1
    assert torch.equal(cache.load(key).features, good)


def test_entries_remove_clear(tmp_path, video):
    cache = FeatureCache(tmp_path / "cache")
    folder = CacheFolder(tmp_path / "cache")
    for rank in range(2):
        save_shard(cache, key_for(video, rank=rank), video)
    other = tmp_path / "other.mp4"
    other.write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(1000))
    save_shard(cache, key_for(other, world_size=1), other)
    entries = {e.video: e for e in cache.entries()}
    e = entries[str(video)]
    assert (e.shards, e.world_size, e.frames, e.model, e.dtype) == (2, 2, 10, "tiny@r1", "bfloat16")
    assert [x.entry_id for x in folder.remove(str(video)).entries] == [e.entry_id]
    assert [x.video for x in cache.entries()] == [str(other)]
    assert folder.remove(cache.entries()[0].entry_id[:6]).entries
    assert cache.entries() == [] and folder.remove("zzzz").entries == []
    save_shard(cache, key_for(video), video)
    assert len(folder.clear().entries) == 1 and cache.entries() == []


def test_cli(tmp_path, video):
    cache = FeatureCache(tmp_path / "cache")
    save_shard(cache, key_for(video, world_size=1), video)
    run = CliRunner().invoke
    d = ["--dir", str(cache.root)]
    out = run(cache_app, ["ls", *d])
    assert out.exit_code == 0, out.output
    assert "movie.mp4" in out.output and "tiny@r1" in out.output and "1/1 shards" in out.output
    entry = cache.entries()[0].entry_id
    out = run(cache_app, ["rm", "nothing-here", *d])
    assert out.exit_code == 2 and "error: nothing cached matches" in out.output
    out = run(cache_app, ["rm", entry[:8], *d])
    assert out.exit_code == 0 and "Removed 1 entry" in out.output
    assert "is empty" in run(cache_app, ["ls", *d]).output
    save_shard(cache, key_for(video, world_size=1), video)
    out = run(cache_app, ["clear", *d], input="n\n")
    assert out.exit_code == 1 and out.output.endswith("Nothing removed.\n"), repr(out.output)
    assert len(cache.entries()) == 1
    out = run(cache_app, ["clear", "--yes", *d])
    assert out.exit_code == 0 and "Removed 1 entries" in out.output and cache.entries() == []
    assert run(cache_app, ["rm", *d]).exit_code == 2
    save_shard(cache, key_for(video, world_size=1), video)
    assert "video changed" not in run(cache_app, ["ls", *d]).output
    os.utime(video, ns=(0, 10**9))  # the video changed since: its entry can never be hit again
    assert "video changed" in run(cache_app, ["ls", *d]).output
    out = run(cache_app, ["rm", "--stale", *d])
    assert "Removed 1 stale entry" in out.output and cache.entries() == []


# ---- `lvx cache ls | rm` over every kind of entry
# --------------------------------------------------------------------------------------------------
def save_made_from(root, key, video, tokens=40):
    """A saved prompt and this rank's visual K/V made from the feature entry of `key`."""
    prompt = PrefixKey.make(
        key, checkpoint="ck", prompt_format=2, prompt_ids=torch.arange(tokens), device="cpu"
    )
    kv = (torch.ones(1, 6, 2, 4), torch.full((1, 6, 2, 4), 2.0))
    PrefixCache(root).save(prompt, SavedPrefix([kv], torch.arange(6).view(1, -1)), video=video)
    visual = VisualKVKey.make(
        key, checkpoint="ck", media_starts=torch.arange(4) * 7, device="cpu", dtype=torch.float32
    )
    VisualKVCache(root).save(visual, {1: kv}, video=video)
    return prompt, visual


def _ls(root, columns: int) -> str:
    out = CliRunner().invoke(cache_app, ["ls", "--dir", str(root)], env={"COLUMNS": str(columns)})
    assert out.exit_code == 0, out.output
    return out.output


def _shown_ids(text: str) -> list[str]:
    return re.findall(r"^  ([0-9a-f]+)  ", text, flags=re.MULTILINE)


def test_ls_fits_the_columns_and_every_id_shown_can_be_pasted_into_rm(tmp_path):
    video = tmp_path / "a-lecture-on-long-video-question-answering.mp4"
    video.write_bytes(os.urandom(3000))
    cache = FeatureCache(tmp_path / "cache")
    model = "/models/mPLUG-Owl3-7B-241101"
    key = key_for(video, world_size=1, model_id=model, model_revision="")
    save_shard(cache, key, video)
    save_shard(cache, key_for(video, world_size=1, fps=2.0, max_frames=64), video)
    save_made_from(cache.root, key, video)
    text = _ls(cache.root, 80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "…" not in text and "mPLUG-Owl3-7B-241101" in text and video.name in text, text
    assert "max-frames=64" in text, text
    assert max(len(line) for line in _ls(cache.root, 160).splitlines()) > 80, "COLUMNS honoured"
    shown = _shown_ids(text)
    entries = CacheFolder(cache.root).entries()
    assert len(shown) == len(entries) == 4
    for short in shown:
        assert (
            len(short) >= 4
            and len({e.entry_id for e in entries if e.entry_id.startswith(short)}) == 1
        )
    for short in reversed(shown):  # what is listed under a features id first: each is one entry
        out = CliRunner().invoke(cache_app, ["rm", short, "--dir", str(cache.root)])
        assert out.exit_code == 0 and "Removed 1 entry" in out.output, out.output
    assert CacheFolder(cache.root).entries() == []


def test_the_ids_shown_are_8_characters_or_as_many_as_tell_them_apart():
    ids = ["0123456789abcdef0123", "0123456789abffff0000", "fedcba98765432100000"]
    assert short_ids(ids + ids[:1]) == {
        ids[0]: "0123456789abc",
        ids[1]: "0123456789abf",
        ids[2]: "fedcba98",
    }


def test_rm_of_a_features_id_removes_what_is_listed_under_it(tmp_path, video):
    root = tmp_path / "cache"
    ones, twos = key_for(video, world_size=1), key_for(video, world_size=1, fps=2.0)
    for key in (ones, twos):
        save_shard(FeatureCache(root), key, video)
        save_made_from(root, key, video, tokens=40 if key is ones else 50)
    text = _ls(root, 80)
    rows = re.findall(r"^  ([0-9a-f]+)  (└ )?(features|prompt|visual K/V)", text, re.MULTILINE)
    assert [(under, kind) for _, under, kind in rows] == [
        ("", "features"),
        ("└ ", "prompt"),
        ("└ ", "visual K/V"),
    ] * 2, text
    short = _shown_ids(text)[0]
    assert ones.entry_id().startswith(short)
    out = CliRunner().invoke(cache_app, ["rm", short, "--dir", str(root)])
    assert out.exit_code == 0, out.output
    assert f"Removed 3 entries for {short} (features, prompt, visual K/V)." in out.output
    left = CacheFolder(root).entries()
    assert sorted(e.kind for e in left) == ["features", "prompt", "visual K/V"]
    assert all(e.entry_id == twos.entry_id() or e.made_from == twos.entry_id() for e in left)
    shutil.rmtree(root / "features" / twos.entry_id())  # what was made from them is of no use
    assert "no features" in _ls(root, 80)
    out = CliRunner().invoke(cache_app, ["rm", "--stale", "--dir", str(root)])
    assert "Removed 2 stale entries" in out.output and CacheFolder(root).entries() == []


def test_entries_of_an_older_format_are_stale(tmp_path, video, monkeypatch):
    cache = FeatureCache(tmp_path / "cache")
    monkeypatch.setattr(FeatureCache, "version", 1)
    save_shard(cache, dataclasses.replace(key_for(video, world_size=1), format_version=1), video)
    monkeypatch.undo()
    save_shard(cache, key_for(video, world_size=1), video)
    assert "old format" in _ls(cache.root, 80)
    out = CliRunner().invoke(cache_app, ["rm", "--stale", "--dir", str(cache.root)])
    assert "Removed 1 stale entry" in out.output
    assert [e.version for e in cache.entries()] == [FeatureCache.version]


def test_files_of_the_previous_release_stay_readable_and_list_under_their_features(tmp_path):
    """The format is unchanged: the same ids name the same files (these ids are the previous
    release's for this video and these keys), and a load reads what it wrote."""
    video = tmp_path / "movie.mp4"
    video.write_bytes(bytes(range(256)) * 40)
    os.utime(video, ns=(10**18, 10**18))
    key = key_for(video, world_size=1, encoder="enc")
    prompt, visual = save_made_from(tmp_path / "cache", key, video)
    assert key.file_id == "d47a961d3560f48ef160c05ba66e205f"
    assert key.entry_id() == "ea635982e6dd5e91fee4"
    assert (prompt.entry_id(), visual.entry_id()) == (
        "b9ffe4a032090c286ba3",
        "0c78e0d78b1a50008b4a",
    )
    save_shard(FeatureCache(tmp_path / "cache"), key, video)
    text = _ls(tmp_path / "cache", 80)
    assert _shown_ids(text) == ["ea635982", "b9ffe4a0", "0c78e0d7"] and "└ prompt" in text


@pytest.mark.slow
def test_a_piped_no_to_cache_clear_ends_its_line(tmp_path, video):
    """`echo n | lvx cache clear`: the answer is not echoed, so the question's line is ended before
    "Nothing removed." (exit 1: nothing was done)."""
    import subprocess
    import sys

    cache = FeatureCache(tmp_path / "cache")
    save_shard(cache, key_for(video, world_size=1), video)
    args = [sys.executable, "-m", "lvx_app.cli", "cache", "clear", "--dir", str(cache.root)]
    out = subprocess.run(args, input="n\n", capture_output=True, text=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.endswith("[y/N]: \nNothing removed.\n"), repr(out.stdout)
    assert len(cache.entries()) == 1


def test_every_video_option_that_changes_the_frames_is_in_the_feature_key():
    """A video option that changes what a load makes (its `key` metadata) and that the video layer
    reads (decode, plan, ingest, encode) is in `FeatureKey`, or two loads that differ in it would
    share cached features. The others (subtitles, kv mode) never reach the frames."""
    import ast
    from pathlib import Path

    from lvx_app.config import VideoConfig

    key_fields = {f.name for f in dataclasses.fields(VideoConfig) if f.metadata.get("key")}
    read = set()
    for path in (Path(__file__).resolve().parents[1] / "lvx_app" / "video").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in key_fields:
                read.add(node.attr)
    assert {"fps", "max_frames"} <= read
    assert read <= {f.name for f in dataclasses.fields(FeatureKey)}, read
