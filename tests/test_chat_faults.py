"""Ctrl-C while `lvx chat` starts: exit at once and quietly (no traceback), with no rank left
behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timing import scaled

from lvx_app.parallel.failures import pid_file


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _chat(tmp_path: Path, model: str, video: str, ranks: int = 2) -> subprocess.Popen:
    """`lvx chat` on `ranks` CPU ranks in a session of its own (Ctrl-C in a terminal goes to that
    process group)."""
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "lvx_app.cli",
        "chat",
        video,
        "--model",
        model,
        "--gpus",
        "0",
        "--ranks",
        str(ranks),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_ctrl_c_as_a_terminal_sends_it,
    )


def _ctrl_c_as_a_terminal_sends_it() -> None:
    """A command started from a terminal gets Ctrl-C; one that inherits SIGINT ignored (a test run
    started in the background by a non-interactive shell) would never see it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c(proc: subprocess.Popen) -> tuple[int, str, float]:
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=scaled(60))
    return proc.returncode, out, time.monotonic() - t0


@pytest.mark.slow
def test_ctrl_c_while_torch_loads_exits_quietly(tiny_checkpoints, short_video, tmp_path):
    proc = _chat(tmp_path, tiny_checkpoints["g2"], short_video)
    time.sleep(0.5)  # the CLI is importing torch
    code, out, _ = _ctrl_c(proc)
    assert code == 130 and "Traceback" not in out and "KeyboardInterrupt" not in out, out


def _ctrl_c_once_the_ranks_run(proc: subprocess.Popen, run_root: Path) -> tuple[int, str, list]:
    """Ctrl-C as soon as both ranks have written their pids; (exit code, output, rank pids), every
    rank gone or killed before it returns."""
    pids: list[int] = []
    try:
        deadline = time.monotonic() + scaled(120)
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            pids = [
                int(p.read_text())
                for run in run_root.glob("lvx-run-*")
                for p in (pid_file(run, 0), pid_file(run, 1))
                if p.exists() and p.read_text()
            ]
            time.sleep(0.01)
        assert len(pids) == 2, "the ranks did not start"
        code, out, took = _ctrl_c(proc)
        assert took < scaled(10), took
        deadline = time.monotonic() + scaled(5)
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a rank outlived lvx chat"
        return code, out, pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_while_the_group_starts_leaves_no_rank_behind(
    tiny_checkpoints, short_video, tmp_path
):
    """A start takes a second or two after the ranks are up; on a busy machine the Ctrl-C can land
    after it, at the prompt, so such a try is repeated (no rank may outlive it either)."""
    for attempt in range(3):
        run_root = tmp_path / f"try{attempt}"
        run_root.mkdir()
        proc = _chat(run_root, tiny_checkpoints["g2"], short_video)
        code, out, _ = _ctrl_c_once_the_ranks_run(proc, run_root)
        assert "Traceback" not in out and "Aborted" not in out, out
        if "Ask about the video" not in out:  # the Ctrl-C landed while the group started
            assert code == 130, out
            return
        assert code in (0, 130), out
    pytest.fail("every Ctrl-C landed after the group had started; the start case never ran")


def _started_below(root: Path) -> list[int]:
    """The processes running with `root` on their command line (torchrun and the ranks: the cache
    folder under it is in their arguments)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            own = entry.name.isdigit() and str(root).encode() in (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if own and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("when", ["while the ranks start", "once the ranks run"])
def test_ctrl_c_on_eight_ranks_ends_the_launcher_and_every_rank(
    tiny_checkpoints, short_video, tmp_path, when
):
    """Ranks run in sessions of their own and arm their parent-death signal only once torch is
    imported: the launcher kills each of them itself, so none outlives it and none keeps the cores
    from its exit."""
    ranks = 8
    proc = _chat(tmp_path, tiny_checkpoints["g2"], short_video, ranks)
    try:
        deadline = time.monotonic() + scaled(300)
        while proc.poll() is None and time.monotonic() < deadline:
            if when == "while the ranks start" and len(_started_below(tmp_path)) > ranks // 2:
                break
            if len(list(tmp_path.glob("lvx-run-*/pid-rank*.txt"))) == ranks:
                break
            time.sleep(0.02)
        code, out, _ = _ctrl_c(proc)
        left = _started_below(tmp_path)
        assert code == 130 and "Traceback" not in out, out
        assert left == [], f"{len(left)} process(es) outlived lvx chat"
    finally:
        for pid in _started_below(tmp_path):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_group_started_from_a_passing_thread_outlives_that_thread(
    tiny_checkpoints, short_video, tmp_path
):
    """The parent-death signal follows the thread that started the launcher: a server request thread
    must not take the group with it when it ends."""
    import threading

    from lvx_app.config import Config
    from lvx_app.parallel.world import World
    from lvx_app.runtime.launcher import RemoteEngine

    box: list[RemoteEngine] = []
    config = Config.from_options(
        model=tiny_checkpoints["g2"], cache_dir=str(tmp_path / "cache"), decode_workers=1
    )
    thread = threading.Thread(target=lambda: box.append(RemoteEngine(config, World(2))))
    thread.start()
    thread.join()
    (engine,) = box
    try:
        time.sleep(1.0)  # a parent-death SIGKILL would have ended the launcher by now
        assert engine.proc.poll() is None, "the group died with the thread that started it"
        assert engine.load_video(short_video, subtitles=[]).frames == 10
    finally:
        engine.close()


def test_ctrl_c_during_a_deferred_block_is_raised_once_after_it():
    """Ctrl-C inside the block (where torch's C init would lose it or abort) runs the block to its
    end, then raises KeyboardInterrupt once; the previous handler is back afterwards; no Ctrl-C, no
    exception."""
    from lvx_app.interrupts import ctrl_c_deferred

    before = signal.getsignal(signal.SIGINT)
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a raised KeyboardInterrupt would land here
            ran.append("end of block")
    assert ran == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is before
    with ctrl_c_deferred():
        pass
