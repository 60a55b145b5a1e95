"""How fast lvx cleans up after a fault, on 2 CPU ranks with a tiny checkpoint and a synthetic
video.

* `kill -9` of `lvx finetune`'s launcher: seconds until every rank is gone.
* `kill -9` of rank 1 during finetuning: seconds until the run has exited with its one line.
* Ctrl-C while `lvx chat` starts its ranks: seconds until it has exited, and until every rank is
  gone.

    python scripts/bench_faults.py --repeats 3 --out runs/bench_faults.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.parallel.failures import pid_file
from lvx_app.video.synthetic import make_video
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint
from scripts.harness import Rows, command_line, machine, show

FINETUNE = (
    "import typer, sys\nfrom lvx_app.cli.finetune import finetune_command\napp = typer.Typer()\n"
    "app.command()(finetune_command)\napp(sys.argv[1:])\n"
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _until(what, timeout_s: float = 240.0) -> float:
    t0 = time.monotonic()
    while not what():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError
        time.sleep(0.02)
    return time.monotonic() - t0


def _pids(run_dirs: list[Path]) -> list[int]:
    files = [pid_file(d, r) for d in run_dirs for r in (0, 1)]
    return [int(f.read_text()) for f in files if f.exists() and f.read_text()]


@contextlib.contextmanager
def _ended(proc: subprocess.Popen):
    """The measured command is killed on the way out, however the measurement ended (a timeout
    left a finetuning run training in the background): its ranks die with their launcher."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _finetune(root: Path, model: str, video: str, victim: str) -> float:
    run = Path(tempfile.mkdtemp(dir=root))
    data = run / "train.jsonl"
    data.write_text(
        json.dumps(
            {"video": os.path.basename(video), "question": "What?", "answer": "A square."},
            allow_nan=False,
        )
        + "\n"
    )
    log = run / "stdout.txt"
    args = [
        "--data",
        str(data),
        "--video-dir",
        os.path.dirname(video),
        "--model",
        model,
        "--out",
        str(run / "out"),
        "--gpus",
        "0",
        "--ranks",
        "2",
        "--steps",
        "100000",
        "--lora",
        "4",
        "--save-every",
        "0",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", FINETUNE, *args],
        stdout=open(log, "w"),
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1", LVX_RUN_DIR=str(run)),
        start_new_session=True,
    )
    with _ended(proc):
        _until(lambda: "step 1/" in log.read_text())
        pids = _pids([run])
        os.kill(proc.pid if victim == "launcher" else pids[1], signal.SIGKILL)
        return _until(
            lambda: not any(map(_alive, pids)) if victim == "launcher" else proc.poll() is not None
        )


def _chat_ctrl_c(root: Path, model: str, video: str) -> tuple[float, float]:
    tmp = Path(tempfile.mkdtemp(dir=root))
    proc = subprocess.Popen(
        [
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
            "2",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1"),
        start_new_session=True,
    )
    with _ended(proc):
        _until(lambda: len(_pids(list(tmp.glob("lvx-run-*")))) == 2)
        pids = _pids(list(tmp.glob("lvx-run-*")))
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        exited = time.monotonic() - t0
        _until(lambda: not any(map(_alive, pids)))
        return exited, time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    args = parser.parse_args()
    rows = Rows(args.out, command=command_line(), machine=machine())
    with tempfile.TemporaryDirectory(prefix="lvx-bench-faults-") as folder:
        root = Path(folder)
        model = str(write_tiny_checkpoint(root / "tiny-g1", "g1"))
        video = str(make_video(root / "short.mp4", num_frames=100, fps=10, width=96, height=64))
        for repeat in range(args.repeats):
            exited, gone = _chat_ctrl_c(root, model, video)
            rows.add(
                {
                    "repeat": repeat + 1,
                    "launcher kill -9 -> ranks gone s": _finetune(root, model, video, "launcher"),
                    "rank 1 kill -9 -> run exited s": _finetune(root, model, video, "rank"),
                    "chat Ctrl-C -> exited s": exited,
                    "chat Ctrl-C -> ranks gone s": gone,
                }
            )
    show("seconds until lvx has cleaned up after a fault (2 CPU ranks)", rows.rows)


if __name__ == "__main__":
    main()
