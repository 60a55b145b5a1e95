"""Two commits of lvx side by side on this machine, in one run: TTFT, decode tokens/s and a
follow-up's TTFT at each frame count, medians of interleaved repetitions and their ratio.

The check before any change to the model, the kernels, the engine or the attention is merged: run
it against the commit the change starts from. Each commit's tracked files are extracted into a
temporary folder (`git archive`; nothing in the repository changes), with its own links for the
import names (`lvx_models` -> models/, `lvx_ui` -> ui/, as `scripts/checkout.py` makes them), and
every measurement is a fresh Python process with only that tree on its path
(`scripts/chat_turn_timing.py`: the engine on one CPU rank, its `Conversation` and `Generator`,
float32, a question and a follow-up), on a tiny mPLUG-Owl3 checkpoint in the 240728 layout
(input-dependent gate) and a synthetic video of each frame count at 1 fps, both written once here.
Repetition r runs A then B at every frame count, the next B then A, so a change in the machine's
load falls on both; a run's load average is kept beside its figures.

The ratio is B's speed over A's (tokens/s B / A; seconds, CPU seconds and page faults A / B): above
1, B is faster. Beside the wall clock each run gives the CPU seconds and minor page faults per
answer, steadier than the wall on a shared machine.

    python scripts/bench_commits.py 0c26e35 HEAD --frames 600 1800 --repeats 5 \\
        --out runs/bench_commits.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from scripts.checkout import ROOT, link_folder
from scripts.harness import Rows, command_line, machine, markdown

WORKER = Path(__file__).resolve().with_name("chat_turn_timing.py")
# (figure, higher is faster): the ratio is B/A for a speed, A/B for a time
FIGURES = {
    "ttft_s": False,
    "decode_tok_s": True,
    "follow_up_ttft_s": False,
    "answer_cpu_s": False,
    "answer_page_faults": False,
}


def extract(commit: str, where: Path) -> tuple[str, Path]:
    """(the commit's full id, a folder holding its tree and a `links/` folder of import names)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    tree = where / sha[:12]
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        link_folder(tree / "links", tree)
    return sha, tree


def run_once(tree: Path, checkpoint: Path, video: Path, args) -> dict:
    """One measurement in a fresh Python whose only lvx is the one in `tree`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "links"), str(tree)])
    command = [sys.executable, "-P", str(WORKER), "--checkpoint", str(checkpoint),
               "--video", str(video), "--threads", str(args.threads),
               "--new-tokens", str(args.new_tokens), "--asks", str(args.asks)]  # fmt: skip
    load = os.getloadavg()[0]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-2000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(row.pop("lvx_app")) != (tree / "lvx_app").resolve():
        raise SystemExit(f"the run in {tree} imported another lvx_app")
    return {**row, "load_avg": load}


def summary(runs: list[dict], labels: tuple[str, str], frames: list[int]) -> list[dict]:
    """Per frame count and figure: each commit's median and B's speed over A's."""
    rows = []
    for n in frames:
        for figure, higher_is_faster in FIGURES.items():
            a, b = (
                statistics.median(
                    r[figure] for r in runs if r["video_frames"] == n and r["commit"] == c
                )
                for c in labels
            )
            ratio = b / a if higher_is_faster else a / b
            rows.append({"frames": n, "figure": figure, "A": a, "B": b, "B/A speed": ratio})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("a", help="the commit measured against (A)")
    parser.add_argument("b", help="the commit measured (B)")
    parser.add_argument("--frames", type=int, nargs="+", default=[600, 1800])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each commit per frames")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--asks", type=int, default=3, help="questions per run (medians)")
    parser.add_argument("--out", type=Path, help="write every run and the summary as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    from lvx_app.video.synthetic import make_video
    from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

    where = Path(tempfile.mkdtemp(prefix="lvx-bench-commits-"))
    try:
        (a, tree_a), (b, tree_b) = extract(args.a, where), extract(args.b, where)
        checkpoint = write_tiny_checkpoint(where / "tiny-g1-gateproj", "g1-gateproj")
        videos = {n: where / f"video_{n}.mp4" for n in args.frames}
        for n, video in videos.items():
            make_video(video, num_frames=n, fps=1, width=96, height=64)
        labels = (f"A {a[:9]}", f"B {b[:9]}")
        rows = Rows(args.out, command=command_line(), machine=machine(), a=a, b=b)
        pairs = list(zip(labels, (tree_a, tree_b)))
        for r in range(args.repeats):
            for n in args.frames:
                for label, tree in pairs if r % 2 == 0 else pairs[::-1]:
                    run = run_once(tree, checkpoint, videos[n], args)
                    rows.add({"commit": label, "repeat": r, "video_frames": n, **run})
                    print(json.dumps(rows.rows[-1], allow_nan=False), flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    table = summary(rows.rows, labels, args.frames)
    rows.save(summary=table)
    print(f"A = {a}, B = {b}; medians of {args.repeats} interleaved runs\n{markdown(table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
