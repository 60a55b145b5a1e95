"""Nothing is left in the temporary folder: a worker group stopped at once (Ctrl-C) or whose rank
died takes its ranks' socket folders with it, also a group of many ranks stopped while they start,
and a page stopped with Ctrl-C its uploads; a refused upload is named by its name, not by where the
server keeps it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from engine_configs import engine_config
from test_serve import LVX
from timing import scaled

from lvx_app.engine.records import EngineError
from lvx_app.parallel.failures import RUN_DIR_ENV, pid_file
from lvx_app.parallel.run_dirs import PREFIX as RUN_PREFIX
from lvx_app.runtime.open import open_engine
from scripts.gloo_ranks import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def short_tmp(monkeypatch):
    """A temporary folder of the test's own, with a short path (a socket's path must fit)."""
    folder = Path(tempfile.mkdtemp(prefix="lvx-left-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _sockets(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("pymp-*"))


@pytest.mark.parametrize("how", ["rank killed", "stopped at once"])
def test_a_group_that_ends_badly_leaves_no_socket_folders(
    tiny_checkpoints, short_video, short_tmp, how
):
    engine = open_engine(engine_config(tiny_checkpoints["g2"], None, ranks=2, gpus=0))
    try:
        engine.load_video(short_video)  # each rank's decode workers: a forkserver's socket
        assert _sockets(short_tmp), "the ranks made no socket folder: nothing is tested"
        if how == "rank killed":  # the group a server then restarts
            os.kill(int(pid_file(engine.run_dir, 1).read_text()), signal.SIGKILL)
            with pytest.raises(EngineError):
                "".join(engine.ask("what happens?"))
        else:
            engine.abort()  # what Ctrl-C does while the group starts or works
    finally:
        engine.close()
    assert _sockets(short_tmp) == [], os.listdir(short_tmp)


def _group_processes(run_dir: Path) -> list[int]:
    """The processes started for the group in `run_dir` (torchrun, its ranks and their helpers):
    every process whose environment names that run folder."""
    mark = f"{RUN_DIR_ENV}={run_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return pids


def test_ctrl_c_while_many_ranks_start_leaves_no_rank_and_nothing_in_the_temporary_folder(
    tiny_checkpoints, short_tmp
):
    """`lvx serve` on 16 CPU ranks stopped with Ctrl-C while its ranks are still starting: no rank
    (nor torchrun, nor a rank's helper) outlives it, and no socket or `pymp-*` folder is left."""
    ranks = 16
    log = short_tmp.parent / f"{short_tmp.name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [*LVX, "serve", "--no-ui", "--port", str(free_port()), "--gpus", "0"]
    args += ["--ranks", str(ranks), "--model", tiny_checkpoints["g2"]]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*args, "--cache-dir", str(short_tmp / "cache")], stdout=out, stderr=out, env=env
        )
    started: list[int] = []
    try:
        deadline = time.monotonic() + scaled(300)
        while True:  # until a few ranks run: the group is starting, not yet ready
            runs = list(short_tmp.glob(f"{RUN_PREFIX}*"))
            started = [p for r in runs for p in r.glob("pid-rank*.txt")]
            if len(started) >= 4:
                break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        (run_dir,) = runs
        group = _group_processes(run_dir)
        text = log.read_text(errors="replace")
        assert "ready on" not in text and len(group) > len(started), text
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=scaled(120))
    text = log.read_text(errors="replace")
    log.unlink()
    assert code == 130 and "stopped" in text, text
    deadline = time.monotonic() + scaled(30)  # a killed process is reaped by its parent
    while (alive := [p for p in _group_processes(run_dir) if _running(p)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert alive == [], f"{len(alive)} of the group's {len(group)} processes outlived Ctrl-C"
    assert not run_dir.exists() and _sockets(short_tmp) == [], _sockets(short_tmp)
    sockets = [str(p) for p in short_tmp.rglob("*") if p.is_socket()]
    assert sockets == [], sockets


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_page_stopped_with_ctrl_c_leaves_no_upload_and_names_a_refused_one(
    tiny_checkpoints, short_tmp
):
    import gradio_client

    log = short_tmp.parent / f"{short_tmp.name}.log"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADIO_ANALYTICS_ENABLED="False")
    env.pop("GRADIO_TEMP_DIR", None)
    args = [*LVX, "serve", "--port", str(port), "--gpus", "0", "--model", tiny_checkpoints["g2"]]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*args, "--cache-dir", str(short_tmp / "cache")], stdout=out, stderr=out, env=env
        )
    try:
        deadline = time.monotonic() + scaled(240)
        while "ready on http://" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        junk = short_tmp / "junk.mp4"
        junk.write_bytes(b"not a video at all " * 100)
        c = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)
        status, _, _ = c.predict(gradio_client.handle_file(str(junk)), "", 1.0, 0, api_name="/load")
        junk.unlink()
        assert status.startswith("⚠️ error:") and "junk.mp4" in status, status
        assert "/junk.mp4" not in status, status  # the name, not the server's path to it
        assert [p for p in short_tmp.rglob("junk.mp4")], "the upload never reached the server"
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=scaled(120))
    text = log.read_text(errors="replace")
    log.unlink()
    assert code == 0 and "stopped by Ctrl-C" in text, text
    left = sorted(str(p.relative_to(short_tmp)) for p in short_tmp.rglob("*") if p.is_file())
    assert [p for p in left if not p.startswith("cache/")] == [], left
