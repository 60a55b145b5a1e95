"""A cache folder that cannot be written is still read, and a full one is like it: one warning, the
load goes on; `lvx cache rm|clear` delete only what lvx wrote, and say so when they cannot delete
it."""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import pytest
from safetensors import SafetensorError
from test_engine import _lvx
from test_video_cache import key_for, save_made_from, save_shard
from test_visual_kv_cache import saving_config
from typer.testing import CliRunner

import lvx_app.cache.files as cache_files
from lvx_app.cache import CacheFolder, CacheWarning, FeatureCache, PrefixCache, VisualKVCache
from lvx_app.cache.fingerprints import MEMO_NAME, fingerprint_memo
from lvx_app.cli.cache import cache_app
from lvx_app.config import GenerationConfig
from lvx_app.engine.records import VideoRequest
from lvx_app.engine.session import RankSession
from lvx_app.parallel.group import init_distributed
from lvx_models.mplug_owl3.family import FAMILY
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint
from scripts.gloo_ranks import run_ranks

READ_ONLY = 'mount --bind -o ro "$0" "$0"'
TINY = 'mount -t tmpfs -o size=4k tmpfs "$0"'  # room for the fingerprints, not for features


@functools.cache
def _can_mount(mount: str) -> bool:
    """Whether this machine lets a test `mount` a folder in a namespace of its own."""
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        probe = ["unshare", "-rm", "sh", "-c", mount, folder]
        return subprocess.run(probe, capture_output=True).returncode == 0


def _read_only(folder: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`lvx ARGS` with `folder` read-only to it: a read-only bind mount in a namespace of its own,
    or (not root) the folder's write permission taken away for the run."""
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "lvx_app.cli", *args]
    if _can_mount(READ_ONLY):
        command = ["unshare", "-rm", "sh", "-c", READ_ONLY + ' && exec "$@"', str(folder), *command]
        return subprocess.run(command, input=stdin, capture_output=True, text=True, env=env)
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere, and this machine lets no test mount read-only")
    folders = [folder, *(p for p in folder.rglob("*") if p.is_dir())]
    for path in folders:
        path.chmod(0o555)
    try:
        return subprocess.run(command, input=stdin, capture_output=True, text=True, env=env)
    finally:
        for path in folders:
            path.chmod(0o755)


def _on_a_tiny_filesystem(folder: Path, *args: str, stdin: str) -> subprocess.CompletedProcess:
    """`lvx ARGS` with a 4 KiB file system mounted at `folder`: room for the fingerprints, not for
    a shard of features."""
    mount = ["unshare", "-rm", "sh", "-c", TINY + ' && exec "$@"', str(folder)]
    command = [*mount, sys.executable, "-m", "lvx_app.cli"]
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    return subprocess.run([*command, *args], input=stdin, capture_output=True, text=True, env=env)


def _files(folder: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_read_only_cache_serves_what_it_holds_and_computes_the_rest(
    tiny_checkpoints, short_video, tmp_path
):
    cache = tmp_path / "cache"
    chat = ["chat", short_video, "--model", tiny_checkpoints["g2"], "--gpus", "0"]
    chat += ["--cache-dir", str(cache), "--max-new-tokens", "8"]
    first = _lvx(*chat, stdin="what happens?\n/quit\n")
    assert first.returncode == 0, first.stdout + first.stderr
    before = _files(cache)
    hit = _read_only(cache, *chat, stdin="what happens?\n/quit\n")
    assert hit.returncode == 0 and "Traceback" not in hit.stdout + hit.stderr, hit.stderr
    assert "loaded from cache with its saved prompt" in hit.stdout, hit.stdout
    assert "cannot be written" not in hit.stdout + hit.stderr, "a hit needs no write"
    answer = [line for line in first.stdout.splitlines() if line.startswith("lvx ›")]
    assert answer and answer == [line for line in hit.stdout.splitlines() if "lvx ›" in line]
    miss = _read_only(cache, *chat, "--fps", "2", stdin="what happens?\n/quit\n")
    said = miss.stdout + miss.stderr
    assert miss.returncode == 0 and "Traceback" not in said, said
    assert "20 frames at 2 fps" in miss.stdout and "lvx › " in miss.stdout
    assert said.count(f"the cache folder {cache} cannot be written") == 1, said
    assert _files(cache) == before


@pytest.mark.slow
def test_rm_and_clear_on_a_read_only_cache_fail_in_one_line(tmp_path):
    video = tmp_path / "movie.mp4"
    video.write_bytes(os.urandom(3 << 20))
    store = FeatureCache(tmp_path / "cache")
    for fps in (1.0, 2.0):
        save_shard(store, key_for(video, world_size=1, fps=fps), video)
    before = _files(store.root)
    for args in (["clear", "--yes"], ["rm", str(video)], ["rm", "--stale"]):
        os.utime(video) if args[-1] == "--stale" else None  # makes both entries stale
        result = _read_only(store.root, "cache", *args, "--dir", str(store.root))
        said = result.stdout + result.stderr
        assert result.returncode == 1, (args, said)
        assert "could not delete 2 entries in" in said and "Traceback" not in said, said
        assert "Removed 2" not in said and _files(store.root) == before, args


def test_clear_and_rm_delete_only_what_lvx_wrote(tmp_path):
    video = tmp_path / "movie.mp4"
    video.write_bytes(os.urandom(3 << 20))
    store = FeatureCache(tmp_path / "cache")
    save_shard(store, key_for(video, world_size=1), video)
    save_shard(store, key_for(video, world_size=1, fps=2.0), video)
    entry = store.path(key_for(video, world_size=1)).parent
    theirs = [
        store.folder / "notes.txt",  # next to the entries
        store.folder / "photos" / "shard-00000-of-00001.safetensors",  # in another folder
        entry / "README",  # inside an entry of lvx's
        store.folder / ("0" * 20) / "shard-00000-of-00001.safetensors",  # not lvx's header
    ]
    for path in theirs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("someone else's")
    run = CliRunner().invoke
    d = ["--dir", str(store.root)]
    out = run(cache_app, ["rm", str(video), *d])
    assert out.exit_code == 0 and "Removed 2 entries" in out.output, out.output
    save_shard(store, key_for(video, world_size=1), video)
    out = run(cache_app, ["clear", "--yes", *d])
    assert out.exit_code == 0 and "Removed 1 entries" in out.output, out.output
    assert "Left 4 file(s) lvx did not write" in out.output, out.output
    assert all(path.read_text() == "someone else's" for path in theirs)
    assert store.entries()[0].entry_id == "0" * 20 and store.entries()[0].problems


# ---- a full disk
# --------------------------------------------------------------------------------------------------
KINDS = ("features", "prefixes", "visual-kv", MEMO_NAME)
FULL = re.escape("is full (No space left on device): what it holds is used")
# what safetensors raises when the disk fills under it
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def fill_the_disk(kinds: tuple[str, ...], how: str = "safetensors") -> None:
    """From now on in this process, writes of these kinds fail as on a full disk: safetensors'
    own error for tensors (`how` "safetensors"), or the OSError the flush to disk raises."""
    save_file, fsync = cache_files.save_file, cache_files.os.fsync

    def full(path: str) -> bool:
        name = Path(path).name
        return any(
            kind in (Path(path).parent.parent.name, name.split(".tmp-")[0][1:]) for kind in kinds
        )

    def failing_save_file(tensors, filename, metadata=None):
        if how == "safetensors" and full(filename):
            raise SafetensorError(SAFETENSORS_FULL)
        return save_file(tensors, filename, metadata=metadata)

    def failing_fsync(fd):
        if (how == "fsync" or MEMO_NAME in kinds) and full(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    cache_files.save_file, cache_files.os.fsync = failing_save_file, failing_fsync
    fill_the_disk.undo = lambda: (
        setattr(cache_files, "save_file", save_file) or setattr(cache_files.os, "fsync", fsync)
    )


@pytest.fixture
def full_disk():
    yield fill_the_disk
    fill_the_disk.undo()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["safetensors", "fsync"])
def test_a_full_disk_saves_nothing_says_so_once_and_leaves_no_file(
    tmp_path, full_disk, tiny_checkpoints, kind, how
):
    if kind == MEMO_NAME and how == "safetensors":
        pytest.skip("the fingerprints are JSON, not safetensors")
    root = tmp_path / "cache"
    video = tmp_path / "movie.mp4"
    video.write_bytes(os.urandom(3000))
    key = key_for(video, world_size=1)

    def save() -> bool:
        """Whether every entry of `kind` was written (the others are written all along)."""
        feature = FeatureCache(root).path(key)
        save_shard(FeatureCache(root), key, video)
        prompt, visual = save_made_from(root, key, video)
        paths = {
            "features": [feature],
            "prefixes": [PrefixCache(root).path(prompt)],
            "visual-kv": [VisualKVCache(root).path(visual)],
            MEMO_NAME: [root / MEMO_NAME],
        }
        with fingerprint_memo(root) as memo:
            FAMILY.encoder_identity(tiny_checkpoints["g2"], None, memo)
        return all(p.is_file() for p in paths[kind])

    full_disk((kind,), how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert save() is False
        assert save() is False
    said = [str(w.message) for w in caught]
    if kind == MEMO_NAME:  # only a re-hash: said by the entries that cannot be saved either
        assert said == []
    else:
        assert len(said) == 1 and re.search(FULL, said[0]), said
    assert not any(".tmp-" in p.name for p in _files(root)), _files(root)
    assert not (root / kind).exists() or kind == MEMO_NAME, "no empty entry folder is left"
    fill_the_disk.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert save() is True
    assert len(CacheFolder(root).entries()) == 3


def test_a_rank_whose_write_fails_never_removes_the_folder_another_rank_writes_into(tmp_path):
    """Two ranks write their files into one new entry folder: the first one's write fails (a full
    disk) just after the second found the folder there, so the first removes it as it leaves. The
    second still saves its file, whichever way the ranks' timing falls."""
    entry = tmp_path / "features" / ("0" * 20)
    a_writing, b_writing, a_gone = threading.Event(), threading.Event(), threading.Event()

    def write_a(tmp: Path) -> None:
        a_writing.set()
        b_writing.wait()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write_b(tmp: Path) -> None:
        b_writing.set()
        a_gone.wait()  # the folder is gone now, if the first write removed it
        tmp.write_bytes(b"rank 1's shard")

    def rank_a() -> None:
        with pytest.raises(OSError, match="No space left"):
            cache_files.atomic_write(entry / "shard-00000-of-00002.safetensors", write_a)
        a_gone.set()

    first = threading.Thread(target=rank_a)
    first.start()
    a_writing.wait()
    cache_files.atomic_write(entry / "shard-00001-of-00002.safetensors", write_b)
    first.join()
    assert _files(tmp_path) == [entry / "shard-00001-of-00002.safetensors"]


PARAMS = GenerationConfig(max_new_tokens=6)


def _loads_on_a_full_disk(rank: int, world: int, checkpoint: str, video: str, cache: str, kinds):
    """Two loads while `kinds` cannot be written (fresh sessions, one process), then two once the
    disk has room: what each load read back, its answer and its cache warnings."""
    info = init_distributed(cuda=False)
    config = saving_config(checkpoint, cache)
    runs = []
    fill_the_disk(kinds)
    for i in range(4):
        if i == 2:
            fill_the_disk.undo()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session = RankSession(config, info)
            summary = session.load_video(VideoRequest(video, config.video))
            answer = "".join(session.ask("what happens?", PARAMS))
        said = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
        read_back = (summary.from_cache, summary.prompt_from_cache, summary.visual_kv_from_cache)
        runs.append((read_back, answer, said))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "kinds",
    [("features",), ("prefixes",), ("visual-kv",), KINDS],
    ids=["features", "prompt", "visual-kv", "every-kind"],
)
def test_a_load_on_a_full_disk_succeeds_with_one_warning_and_the_next_load_works(
    tmp_path, world, kinds
):
    checkpoint = str(write_tiny_checkpoint(tmp_path / "ckpt", "g2", seed=0))
    video = str(tmp_path / "short.mp4")
    from lvx_app.video.synthetic import make_video

    make_video(video, num_frames=60, fps=10, width=64, height=48)
    runs = run_ranks(_loads_on_a_full_disk, world, checkpoint, video, str(tmp_path / "c"), kinds)
    for rank, (first, again, freed, hit) in enumerate(runs):
        answers = {first[1], again[1], freed[1], hit[1]}
        assert len(answers) == 1, "every load answers alike"
        assert len(first[2]) == (1 if rank == 0 or kinds != ("prefixes",) else 0), first[2]
        assert (
            all(re.search(FULL, line) for line in first[2]) and again[2] == [] == freed[2] == hit[2]
        )
        assert again[0] == (
            "features" not in kinds,
            not {"features", "prefixes"} & set(kinds),
            not {"features", "visual-kv"} & set(kinds),
        ), "what could be saved is read back"
        assert hit[0] == (True, True, True), "with room again, everything is saved and read back"


@pytest.mark.slow
def test_chat_on_two_ranks_with_a_full_cache_disk_answers_with_one_warning(
    tiny_checkpoints, short_video, tmp_path
):
    if not _can_mount(TINY):
        pytest.skip("this machine lets no test mount a file system")
    cache = tmp_path / "cache"
    cache.mkdir()
    chat = ["chat", short_video, "--model", tiny_checkpoints["g2"], "--gpus", "0", "--ranks", "2"]
    chat += ["--cache-dir", str(cache), "--max-new-tokens", "4"]
    for _ in range(2):  # the next run (its own process, the disk still full) works alike
        run = _on_a_tiny_filesystem(cache, *chat, stdin="what happens?\nwhy?\n/quit\n")
        said = run.stdout + run.stderr
        assert run.returncode == 0 and "Traceback" not in said and "failed" not in said, said
        assert "10 frames at 1 fps" in run.stdout and run.stdout.count("lvx › ") == 2, said
        assert len(re.findall(f"cache folder {cache} {FULL}", said)) == 1, said


def test_an_ambiguous_id_removes_nothing_and_lists_the_candidates(tmp_path):
    """Two entries whose ids start alike (their folders named so): `rm` of the shared start is one
    line naming both, nothing removed, also of another target given with it; a longer start
    removes one."""
    video = tmp_path / "movie.mp4"
    video.write_bytes(os.urandom(1 << 16))
    store = FeatureCache(tmp_path / "cache")
    for fps in (1.0, 2.0, 3.0):
        save_shard(store, key_for(video, world_size=1, fps=fps), video)
    entries = store.entries()
    names = ["ffc0a" + entries[0].entry_id[5:], "ffc0b" + entries[1].entry_id[5:]]
    for entry, name in zip(entries, names):
        entry.path.rename(entry.path.parent / name)
    other = entries[2].entry_id
    before = _files(store.root)
    d = ["--dir", str(store.root)]
    out = CliRunner().invoke(cache_app, ["rm", other, "ffc0", *d])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert "ffc0 starts 2 entry ids" in out.output and "nothing removed" in out.output
    assert names[0][:8] in out.output and names[1][:8] in out.output, out.output
    assert _files(store.root) == before
    out = CliRunner().invoke(cache_app, ["rm", "ffc0a", *d])
    assert out.exit_code == 0 and "Removed 1 entr" in out.output, out.output
    assert sorted(e.entry_id for e in store.entries()) == sorted([names[1], other])
