"""`lvx finetune` under faults: ranks die with their launcher, one run per --out, one line per rank
death."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import typer
from timing import scaled
from typer.testing import CliRunner

from lvx_app.cli.finetune import finetune_command
from lvx_app.config import Config, updated
from lvx_app.parallel.failures import pid_file
from lvx_app.train import outlock
from lvx_app.train.launch import STOP_GRACE_S, lock_out, release_out
from lvx_app.train.out_folder import PARTIAL
from lvx_app.train.outlock import LOCK_NAME, OutputBusy, lock_output, release_output

SCRIPT = (
    "import typer, sys\nfrom lvx_app.cli.finetune import finetune_command\napp = typer.Typer()\n"
    "app.command()(finetune_command)\napp(sys.argv[1:])\n"
)


def _data(tmp_path: Path, video: str) -> Path:
    f = tmp_path / "train.jsonl"
    f.write_text(
        json.dumps(
            {"video": os.path.basename(video), "question": "What is shown?", "answer": "A square."}
        )
        + "\n"
    )
    return f


def _args(tmp_path: Path, video: str, model: str, out: Path, steps: int = 100_000) -> list[str]:
    return [
        "--data",
        str(_data(tmp_path, video)),
        "--video-dir",
        os.path.dirname(video),
        "--model",
        model,
        "--out",
        str(out),
        "--gpus",
        "0",
        "--ranks",
        "2",
        "--steps",
        str(steps),
        "--lora",
        "4",
        "--save-every",
        "0",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie waiting for a reaper is dead


def _wait(what, timeout_s: float, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(every_s)
    return False


def _start(tmp_path: Path, args: list[str], run_dir: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A finetuning run on 2 CPU ranks, in a session of its own; returns (process, stdout file,
    stderr file)."""
    out_log, err_log = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", LVX_RUN_DIR=str(run_dir))
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, *args],
        stdout=open(out_log, "w"),
        stderr=open(err_log, "w"),
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    stepped = _wait(lambda: "step 1/" in out_log.read_text() or proc.poll() is not None, 240)
    if not stepped or proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the run and its ranks: nothing outlives the test
    assert stepped, f"no training step\n{out_log.read_text()}\n{err_log.read_text()}"
    assert proc.poll() is None, err_log.read_text()
    return proc, out_log, err_log


def _stepping(tmp_path: Path, video: str, model: str) -> tuple[Path, subprocess.Popen, Path, list]:
    """A finetuning run on 2 CPU ranks that has taken a step: (its --out, its process, its stderr
    file, its ranks' pids)."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    run_dir.mkdir()
    proc, _, err_log = _start(tmp_path, _args(tmp_path, video, model, out), run_dir)
    return out, proc, err_log, _rank_pids(run_dir)


def _rank_pids(run_dir: Path) -> list[int]:
    return [int(pid_file(run_dir, r).read_text()) for r in (0, 1)]


def _stop(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@pytest.mark.slow
def test_killed_launcher_takes_its_ranks_and_its_lock_with_it(
    tiny_checkpoints, short_video, tmp_path
):
    out, proc, _, pids = _stepping(tmp_path, short_video, tiny_checkpoints["g1"])
    try:
        # a second run on the same --out is refused in one line naming the holder, before it starts
        # a rank
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                SCRIPT,
                *_args(tmp_path, short_video, tiny_checkpoints["g1"], out),
            ],
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
        assert second.returncode == 2, second.stderr
        assert f"is in use by another lvx finetune run (pid {proc.pid})" in second.stderr, (
            second.stderr
        )
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr

        os.kill(proc.pid, signal.SIGKILL)  # the launcher only, as the OOM killer or `kill -9` would
        proc.wait()
        assert _wait(lambda: not any(_alive(p) for p in pids), 20), (
            "the ranks outlived their launcher"
        )
        # the lock went with the run: a new run may take the folder (waiting the moment torchrun's
        # agent may take to let go: its main thread exits first and the ranks' parent-death signal
        # follows that thread)
        fd = lock_output(out)
        os.close(fd)
    finally:
        _stop(proc, pids)


@pytest.mark.slow
def test_a_killed_rank_is_named_in_one_line(tiny_checkpoints, short_video, tmp_path):
    _, proc, err_log, pids = _stepping(tmp_path, short_video, tiny_checkpoints["g1"])
    try:
        os.kill(pids[1], signal.SIGKILL)
        assert proc.wait(timeout=scaled(120)) == 1
        err = err_log.read_text()
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines == [
            "error: rank 1 failed: killed by SIGKILL (out of memory, a crash, or by hand)"
        ], err
        assert _wait(lambda: not _alive(pids[0]), 20), "the surviving rank lingered"
    finally:
        _stop(proc, pids)


@pytest.mark.slow
def test_ctrl_c_ends_every_rank_even_one_that_does_not_stop(
    tiny_checkpoints, short_video, tmp_path
):
    """Ctrl-C reaches torchrun from lvx finetune (it runs in a session of its own); a rank that does
    not stop within the grace period (here: frozen with SIGSTOP) is killed with the rest, instead of
    waiting out torchrun's own 30 s."""
    out, proc, err_log, pids = _stepping(tmp_path, short_video, tiny_checkpoints["g1"])
    try:
        os.kill(pids[1], signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGINT)  # lvx finetune alone, as `kill -INT` or a terminal
        assert proc.wait(timeout=scaled(STOP_GRACE_S + 15)) == 130
        assert _wait(lambda: not any(_alive(p) for p in pids), 5), "a rank outlived the run"
        err = err_log.read_text()
        assert "interrupted: the last checkpoint" in err and "Traceback" not in err, err
        assert not (out / LOCK_NAME).exists()
    finally:
        _stop(proc, pids)


def test_a_save_killed_half_way_is_discarded_by_the_next_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / f".model.safetensors{PARTIAL}x1y2").write_bytes(b"half a model")
    (out / ".keep-me").write_text("not ours")
    config = Config(model="tiny")
    config = updated(config, train=updated(config.train, out=str(out)))
    lock = lock_out(config)
    try:
        assert sorted(p.name for p in out.iterdir()) == [".keep-me", LOCK_NAME]
    finally:
        release_out(config, lock)


def test_out_inside_model_is_refused_before_anything_is_written(tiny_checkpoints, tmp_path):
    app = typer.Typer()
    app.command()(finetune_command)
    model = Path(tiny_checkpoints["g1"])
    before = sorted(p.name for p in model.iterdir())
    data = tmp_path / "train.jsonl"
    data.write_text("")
    for out in (model, model / "finetuned", Path(os.path.relpath(model)) / "."):
        res = CliRunner().invoke(
            app, ["--data", str(data), "--model", str(model), "--out", str(out), "--gpus", "0"]
        )
        assert res.exit_code == 2, res.output
        assert (
            "is inside the --model checkpoint" in res.output
            and "choose another --out" in res.output
        ), res.output
    assert sorted(p.name for p in model.iterdir()) == before  # no lock file, no folder


def test_output_lock_names_its_holder(tmp_path):
    fd = lock_output(tmp_path / "out")
    try:
        with pytest.raises(
            OutputBusy, match=rf"in use by another lvx finetune run \(pid {os.getpid()}\)"
        ):
            lock_output(tmp_path / "out")
    finally:
        os.close(fd)
    os.close(lock_output(tmp_path / "out"))  # free again once closed
    assert (tmp_path / "out" / LOCK_NAME).exists()  # closed, not released: a killed run's file
    release_output(tmp_path / "out", lock_output(tmp_path / "out"))
    assert not (tmp_path / "out" / LOCK_NAME).exists()  # a run that ends leaves no lock file


def test_a_lock_file_removed_by_the_run_before_is_not_the_one_locked(tmp_path, monkeypatch):
    """A run opened the lock file just before the run that held it ended and removed it: it must
    lock the current file, or a third run could hold the folder at the same time."""
    out = tmp_path / "out"
    first = lock_output(out)
    stale = os.open(out / LOCK_NAME, os.O_RDWR)  # the second run's open, before the first ends
    release_output(out, first)
    opened = iter([stale])
    real_open = outlock._open_lock
    monkeypatch.setattr(outlock, "_open_lock", lambda o: next(opened, None) or real_open(o))
    second = lock_output(out)
    try:
        assert second != stale and (out / LOCK_NAME).exists()
        with pytest.raises(OutputBusy):  # a third run sees the second's lock
            lock_output(out)
    finally:
        release_output(out, second)


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_lock_whose_launcher_exited_is_waited_for_a_moment(tmp_path):
    """The launcher was killed but its torchrun agent still holds the lock: the next run waits, then
    takes it."""
    fd = lock_output(tmp_path / "out")
    os.pwrite(fd, str(_exited_pid()).encode().ljust(16), 0)
    threading.Timer(0.5, os.close, (fd,)).start()  # the agent lets go half a second later
    started = time.monotonic()
    os.close(lock_output(tmp_path / "out", holder_gone_wait_s=10))
    assert 0.4 < time.monotonic() - started < scaled(5)


def test_a_lock_whose_launcher_exited_but_never_lets_go_is_refused_after_the_wait(tmp_path):
    fd = lock_output(tmp_path / "out")
    os.pwrite(fd, str(_exited_pid()).encode().ljust(16), 0)
    try:
        started = time.monotonic()
        with pytest.raises(OutputBusy, match="in use by another lvx finetune run"):
            lock_output(tmp_path / "out", holder_gone_wait_s=0.3)
        assert 0.25 < time.monotonic() - started < scaled(3)
        started = time.monotonic()
        # a live holder: refused at once, no wait
        os.pwrite(fd, str(os.getpid()).encode().ljust(16), 0)
        with pytest.raises(OutputBusy, match=rf"\(pid {os.getpid()}\)"):
            lock_output(tmp_path / "out", holder_gone_wait_s=10)
        assert time.monotonic() - started < scaled(1)
    finally:
        os.close(fd)


def test_an_out_that_cannot_be_a_folder_is_one_line(tiny_checkpoints, short_video, tmp_path):
    app = typer.Typer()
    app.command()(finetune_command)
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    expected = {taken: "is a file, not a folder", taken / "run": "cannot be written"}
    for out, words in expected.items():
        args = _args(tmp_path, short_video, tiny_checkpoints["g1"], out)
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and words in res.output, res.output
        assert isinstance(res.exception, SystemExit), res.output
    assert taken.read_text() == "mine"


def test_a_folder_that_cannot_be_written_beside_a_writable_lock_file_is_one_line(
    tmp_path, monkeypatch
):
    """An earlier run's lock file may be writable in a folder that no longer is (its permission
    taken away; root may write anywhere, so the folder's refusal is made here)."""
    import tempfile

    from lvx_app.train.outlock import OutputUnwritable

    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    with pytest.raises(OutputUnwritable, match=r"cannot be written \(Permission denied\); choose"):
        lock_output(out)


READ_ONLY = 'mount --bind -o ro "$0" "$0" && exec "$@"'


@pytest.mark.slow
def test_a_read_only_out_is_one_line(tiny_checkpoints, short_video, tmp_path):
    """`--out` on a read-only file system (a bind mount in a namespace of its own, as the read-only
    cache test makes one): a new folder there, an empty one, one an earlier run left."""
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", READ_ONLY, str(tmp_path), "true"])
    if probe.returncode != 0:
        pytest.skip("this machine lets no test mount a folder read-only")
    folder = tmp_path / "read-only"
    (folder / "empty").mkdir(parents=True)
    (folder / "earlier").mkdir()
    (folder / "earlier" / LOCK_NAME).write_text("")
    for out in (folder / "new", folder / "empty", folder / "earlier"):
        args = _args(tmp_path, short_video, tiny_checkpoints["g1"], out, steps=1)
        command = [sys.executable, "-c", SCRIPT, *args]
        run = subprocess.run(
            ["unshare", "-rm", "sh", "-c", READ_ONLY, str(folder), *command],
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            timeout=scaled(300),
        )
        said = (run.stdout + run.stderr).strip()
        assert run.returncode == 2 and "Traceback" not in said, said
        assert said.splitlines()[-1].endswith(
            f"--out {out} cannot be written (Read-only file system); choose a folder you can write"
        ), said
