"""A cache folder that cannot be written is still read; `lvx cache rm|clear` delete only what lvx
wrote, and say so when they cannot delete it."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_engine import _lvx
from test_video_cache import key_for, save_shard
from typer.testing import CliRunner

from lvx_app.cli.cache import cache_app
from lvx_app.video.feature_cache import FeatureCache


@functools.cache
def _can_mount_read_only() -> bool:
    """Whether this machine lets a test mount a folder read-only in its own namespace."""
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        probe = ["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0"', folder]
        return subprocess.run(probe, capture_output=True).returncode == 0


def _read_only(folder: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`lvx ARGS` with `folder` read-only to it: a read-only bind mount in a namespace of its own,
    or (not root) the folder's write permission taken away for the run."""
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "lvx_app.cli", *args]
    if _can_mount_read_only():
        mount = 'mount --bind -o ro "$0" "$0" && exec "$@"'
        command = ["unshare", "-rm", "sh", "-c", mount, str(folder), *command]
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
        store.features_dir / "notes.txt",  # next to the entries
        store.features_dir / "photos" / "shard-00000-of-00001.safetensors",  # in another folder
        entry / "README",  # inside an entry of lvx's
        store.features_dir / ("0" * 20) / "shard-00000-of-00001.safetensors",  # not lvx's header
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
