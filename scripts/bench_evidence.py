"""What an answer's evidence costs: decode tokens/s with `--evidence` on against off, side by side
in one engine (tiny g2 checkpoint, a synthetic video, CPU ranks under torchrun).

The same greedy question is asked in turns, on and off (so the machine's load falls on both alike);
the speed of an answer counts its whole decode, the evidence computed at its end included. The
median of each, their ratio and the median ratio of the neighbouring pairs are written as one row;
the answers must be the same token for token (evidence only reads the queries).

    python scripts/bench_evidence.py --ranks 2 --out runs/bench_evidence.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from scripts.harness import Rows, command_line, machine, show

QUESTION = "What happens in the video, and when does the scene change?"


def measure(engine, new_tokens: int, repeats: int) -> dict:
    """Median decode tokens/s and answer seconds with evidence on and off, asked alternately."""
    speeds: dict[bool, list[float]] = {True: [], False: []}
    seconds: dict[bool, list[float]] = {True: [], False: []}
    answers: dict[bool, set[str]] = {True: set(), False: set()}
    for i in range(repeats):
        for on in (i % 2 == 0, i % 2 == 1):  # on first, then off first: neither always leads
            engine.reset()  # the same first turn every time
            text = "".join(engine.ask(QUESTION, max_new_tokens=new_tokens, evidence=on))
            answers[on].add(text)
            speeds[on].append(engine.last_answer.tokens_per_s)
            seconds[on].append(engine.last_answer.total_s)
            assert (engine.last_answer.evidence is not None) == on
    if answers[True] != answers[False] or len(answers[True]) != 1:
        raise SystemExit(f"the answers with and without evidence differ: {answers}")
    on, off = statistics.median(speeds[True]), statistics.median(speeds[False])
    # each on answer against the off answer asked beside it: the machine's load falls on both
    pairs = [a / b for a, b in zip(speeds[True], speeds[False])]
    return {
        "tokens_per_s_on": on,
        "tokens_per_s_off": off,
        "on_over_off": on / off,
        "pair_ratio_median": statistics.median(pairs),
        "pair_ratios": [round(r, 3) for r in pairs],
        "answer_s_on": statistics.median(seconds[True]),
        "answer_s_off": statistics.median(seconds[False]),
        "new_tokens": engine.last_answer.new_tokens,
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0, help="video length at 1 fps")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_evidence.json"))
    args = parser.parse_args(argv)

    from lvx_app.config import Config
    from lvx_app.engine.api import VideoRequest
    from lvx_app.runtime.open import open_engine
    from lvx_app.video.synthetic import make_video
    from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

    rows = Rows(args.out, machine=machine(), command=command_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checkpoint = write_tiny_checkpoint(work / "tiny-g2", "g2")
        video = make_video(
            work / "video.mp4", num_frames=int(args.seconds * 4), fps=4, width=96, height=64
        )
        config = Config.from_options(
            model=str(checkpoint), cache=False, gpus=0, ranks=args.ranks, subtitles="none"
        )
        engine = open_engine(config)
        try:
            t0 = time.perf_counter()
            summary = engine.load_video(VideoRequest.of(video, config.video))
            load_s = time.perf_counter() - t0
            "".join(engine.ask("warm-up?", max_new_tokens=4))
            row = measure(engine, args.new_tokens, args.repeats)
        finally:
            engine.close()
    rows.add({"ranks": args.ranks, "frames": summary.frames, "load_s": load_s, **row})
    show("evidence on vs off", rows.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
