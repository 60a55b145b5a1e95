"""A worker group's run folder: nothing is left in the temporary folder after a clean exit, a failed
run keeps its traces, and the folders of ended runs do not gather beyond a few."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timing import scaled

from lvx_app.parallel.run_dirs import KEEP_ENDED, PREFIX, SETTLE_S, RunDir, remove_ended


def _folder(root: Path, name: str, age_s: float) -> Path:
    folder = root / f"{PREFIX}{name}"
    folder.mkdir()
    (folder / "group.log").write_text("error: rank 1 failed: killed by SIGKILL\n")
    then = time.time() - age_s
    os.utime(folder, (then, then))
    return folder


def test_ended_runs_beyond_the_newest_are_removed_and_live_ones_kept(tmp_path):
    old = SETTLE_S + 60
    live = RunDir(tmp_path)
    live_and_old = live.path
    ended = [_folder(tmp_path, f"ended{i:02d}", old + i) for i in range(KEEP_ENDED + 4)]
    then = time.time() - 10 * old
    os.utime(live_and_old, (then, then))
    fresh = _folder(tmp_path, "fresh", 0)
    for i in range(3):  # just made by a run that has not locked it yet
        _folder(tmp_path, f"starting{i}", 1)
    other = tmp_path / "someone-elses"
    other.mkdir()

    removed = remove_ended(tmp_path)

    newest_ended = KEEP_ENDED - 4  # the 8 newest: 3 starting, the fresh one, 4 ended ones
    assert sorted(removed) == sorted(ended[newest_ended:])
    assert all(folder.exists() for folder in ended[:newest_ended])
    assert live_and_old.exists() and fresh.exists() and other.exists()
    live.close(keep=True)  # a failed run keeps its folder, and no longer holds it
    assert live_and_old.exists() and remove_ended(tmp_path) == [live_and_old]


def test_a_run_folder_is_removed_unless_kept(tmp_path):
    run = RunDir(tmp_path)
    (run.path / "pid-rank0.txt").write_text("1")
    run.close(keep=False)
    assert list(tmp_path.iterdir()) == []


def _torchrun(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(body)
    run_root = tmp_path / "tmp"
    run_root.mkdir()
    env = dict(os.environ, TMPDIR=str(run_root), OMP_NUM_THREADS="1")
    env.pop("LVX_RUN_DIR", None)
    cmd = [sys.executable, "-m", "lvx_app.parallel.torchrun", "--standalone"]
    cmd += ["--nproc-per-node=2", "--monitor-interval=0.2", str(script)]
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=scaled(120), cwd=tmp_path
    )


@pytest.mark.slow
def test_our_torchrun_leaves_nothing_after_a_clean_exit_and_keeps_a_failure(tmp_path):
    (tmp_path / "a").mkdir()
    done = _torchrun(tmp_path / "a", "print('hi')\n")
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "a" / "tmp").iterdir()) == []  # torchrun's own logs included
    (tmp_path / "b").mkdir()
    failed = _torchrun(tmp_path / "b", "import os, sys\nsys.exit(int(os.environ['RANK']) == 1)\n")
    assert failed.returncode == 1 and "rank 1 failed" in failed.stderr, failed.stderr
    (kept,) = (tmp_path / "b" / "tmp").iterdir()
    assert kept.name.startswith(PREFIX)


@pytest.mark.slow
def test_lvx_chat_on_two_ranks_leaves_nothing_in_the_temporary_folder(
    tiny_checkpoints, short_video, tmp_path
):
    run_root = tmp_path / "tmp"
    run_root.mkdir()
    env = dict(os.environ, TMPDIR=str(run_root), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lvx_app.cli", "chat", short_video]
    cmd += ["--model", tiny_checkpoints["g2"], "--gpus", "0", "--ranks", "2"]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "--max-new-tokens", "3"]
    chat = subprocess.run(
        cmd, input="what happens?\n", env=env, capture_output=True, text=True, timeout=scaled(300)
    )
    assert chat.returncode == 0 and "tokens" in chat.stdout, chat.stdout + chat.stderr
    assert sorted(p.name for p in run_root.iterdir()) == []


def test_kill_tree_kills_descendants_in_sessions_of_their_own(tmp_path):
    """As torchrun starts ranks: each in a session of its own, out of the launcher's process group;
    a grandchild too."""
    from lvx_app.parallel.lifeline import kill_tree

    pids = tmp_path / "pids"
    spawn = (
        "import subprocess, sys, time\n"
        "child = [sys.executable, '-c', "
        "'import subprocess, sys, time; "
        'p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], '
        "start_new_session=True); print(p.pid, flush=True); time.sleep(600)']\n"
        "kids = [subprocess.Popen(child, start_new_session=True, stdout=subprocess.PIPE, text=True)"
        " for _ in range(3)]\n"
        f"open({str(pids)!r}, 'w').write(' '.join("
        "[str(k.pid) for k in kids] + [k.stdout.readline().strip() for k in kids]))\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    deadline = time.monotonic() + scaled(60)
    while not (pids.exists() and len(pids.read_text().split()) == 6):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.02)
    below = [int(pid) for pid in pids.read_text().split()]
    kill_tree(launcher.pid)
    assert launcher.wait(timeout=scaled(10)) == -9
    alive = []
    for pid in below:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
            os.kill(pid, 9)
    assert alive == []
