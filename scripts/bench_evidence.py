"""What an answer's evidence costs: decode tokens/s with evidence on against off, side by side on
one group of CPU gloo ranks (tiny g2 checkpoint, a synthetic video).

Made to hold on a loaded machine: the same greedy question is asked in rounds of three answers,
one with evidence and two without ("off" and "again"), in an order that turns every round (on,
off, again; off, again, on; again, on, off; ...), each after a reset, so the load falls on all
alike. Reported:
- decode tokens/s of each (median, and best: the answer least slowed by other work);
- the ratio on/off of each round: median, quartiles, extremes; and beside it the same ratio of
  the two answers without evidence (again/off), which differ by the machine's noise alone: the
  yardstick a difference must clear;
- the same ratio of the CPU time each rank spent on the two answers (question and answer, process
  time: what waiting for a core under other work does not inflate), on the rank where its median
  is largest;
- the time the evidence itself took on each rank (`EvidenceRecorder.seconds`: the recording per
  token and the shares at the answer's end) as a fraction of the same answer's decode time, on the
  rank where it is largest: numerator and denominator share one answer's load.
The speed of an answer counts its whole decode, the evidence computed at its end included. The
answers must be the same token for token (evidence only reads the queries).

    python scripts/bench_evidence.py --ranks 2 --rounds 24 --out runs/bench_evidence.json
"""

from __future__ import annotations

import argparse
import os
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
ARMS = ["on", "off", "again"]  # evidence on; off; off again (the noise between two like answers)


def _kept_recorders() -> list:
    """Every evidence recorder the engine makes from now on, in order (this process)."""
    from lvx_app.engine import turns
    from lvx_app.engine.evidence import EvidenceRecorder

    made: list = []

    class Kept(EvidenceRecorder):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(self)

    turns.EvidenceRecorder = Kept
    return made


def answer_rounds(
    rank: int, world: int, checkpoint: str, video: str, rounds: int, new_tokens: int
) -> dict:
    """One rank of the group: load the video, warm up, then `rounds` rounds of an answer with
    evidence and two without (in turning order). Returns the video's frame count and, per answer,
    its speed, this rank's CPU seconds and evidence seconds."""
    from dataclasses import replace

    from lvx_app.config import Config
    from lvx_app.engine.records import VideoRequest
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed

    config = Config.from_options(
        model=checkpoint, cache=False, gpus=0, ranks=world, subtitles="none", decode_workers=1
    )
    session = RankSession(config, init_distributed(cuda=False))
    summary = session.load_video(VideoRequest.of(video, config.video))
    "".join(session.ask("warm-up?", replace(config.generation, max_new_tokens=4)))
    made = _kept_recorders()
    answers = []
    for i in range(rounds):
        for arm in ARMS[i % 3 :] + ARMS[: i % 3]:
            on = arm == "on"
            session.reset()  # the same first turn every time
            generation = replace(config.generation, max_new_tokens=new_tokens, evidence=on)
            before, cpu = len(made), time.process_time()
            text = "".join(session.ask(QUESTION, generation))
            cpu = time.process_time() - cpu
            if len(made) - before != int(on):
                raise SystemExit(f"evidence on={on}: {len(made) - before} recorders made")
            last = session.last_answer
            answers.append(
                dict(
                    round=i,
                    arm=arm,
                    text=text,
                    new_tokens=last.new_tokens,
                    tokens_per_s=last.tokens_per_s,
                    decode_s=last.total_s - last.ttft_s,
                    cpu_s=cpu,
                    evidence_s=made[-1].seconds if on else 0.0,
                )
            )
    return dict(frames=summary.frames, answers=answers)


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q[0], q[2]


def _round_ratios(answers: list[dict], key: str, arm: str = "on") -> list[float]:
    """answer[key] of `arm` over that of "off", per round."""
    by_round = {(a["round"], a["arm"]): a[key] for a in answers}
    return [by_round[r, arm] / by_round[r, "off"] for r in sorted({a["round"] for a in answers})]


def summarize(per_rank: list[list[dict]]) -> dict:
    """The figures of every rank's answers (the same answers in the same order on each rank):
    speeds as rank 0 measured them (on over off, and again over off: the noise), the CPU ratio
    and the evidence's share of decode on the rank where each is largest."""
    answers = per_rank[0]
    texts = {arm: {a["text"] for a in answers if a["arm"] == arm} for arm in ARMS}
    if len(set().union(*texts.values())) != 1:
        raise SystemExit(f"the answers with and without evidence differ: {texts}")
    speed_on = [a["tokens_per_s"] for a in answers if a["arm"] == "on"]
    speed_off = [a["tokens_per_s"] for a in answers if a["arm"] != "on"]
    pairs = _round_ratios(answers, "tokens_per_s")
    noise = _round_ratios(answers, "tokens_per_s", "again")
    cpu = max((_round_ratios(rank, "cpu_s") for rank in per_rank), key=statistics.median)
    fractions, seconds = [], []
    for i, answer in enumerate(answers):
        if answer["arm"] == "on":
            worst = max(rank[i]["evidence_s"] / rank[i]["decode_s"] for rank in per_rank)
            fractions.append(worst)
            seconds.append(max(rank[i]["evidence_s"] for rank in per_rank))
    low, high = _quartiles(pairs)
    cpu_low, cpu_high = _quartiles(cpu)
    noise_low, noise_high = _quartiles(noise)
    return {
        "rounds": len(pairs),
        "new_tokens": answers[0]["new_tokens"],
        "tok_s_off": statistics.median(speed_off),
        "tok_s_on": statistics.median(speed_on),
        "best_tok_s_off": max(speed_off),
        "best_tok_s_on": max(speed_on),
        "best_on_over_off": max(speed_on) / max(speed_off),
        "pair_ratio_median": statistics.median(pairs),
        "pair_ratio_p25": low,
        "pair_ratio_p75": high,
        "pair_ratio_min": min(pairs),
        "pair_ratio_max": max(pairs),
        "noise_ratio_median": statistics.median(noise),
        "noise_ratio_p25": noise_low,
        "noise_ratio_p75": noise_high,
        "cpu_ms_off": 1000 * statistics.median(a["cpu_s"] for a in answers if a["arm"] != "on"),
        "cpu_ms_on": 1000 * statistics.median(a["cpu_s"] for a in answers if a["arm"] == "on"),
        "cpu_ratio_median": statistics.median(cpu),
        "cpu_ratio_p25": cpu_low,
        "cpu_ratio_p75": cpu_high,
        "evidence_ms": 1000 * statistics.median(seconds),
        "evidence_of_decode": statistics.median(fractions),
        "pair_ratios": [round(r, 4) for r in pairs],
        "noise_ratios": [round(r, 4) for r in noise],
        "cpu_ratios": [round(r, 4) for r in cpu],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0, help="video length at 1 fps")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=24, help="rounds of three answers")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_evidence.json"))
    args = parser.parse_args(argv)

    from lvx_app.video.synthetic import make_video
    from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint
    from scripts.gloo_ranks import run_ranks

    rows = Rows(args.out, machine=machine(), command=command_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checkpoint = write_tiny_checkpoint(work / "tiny-g2", "g2")
        video = make_video(
            work / "video.mp4", num_frames=int(args.seconds * 4), fps=4, width=96, height=64
        )
        per_rank = run_ranks(
            answer_rounds,
            args.ranks,
            str(checkpoint),
            str(video),
            args.rounds,
            args.new_tokens,
            timeout_s=600 + 30 * args.rounds,
        )
    row = {"ranks": args.ranks, "frames": per_rank[0]["frames"]}
    row |= summarize([r["answers"] for r in per_rank])
    row["load_avg_end"] = list(os.getloadavg())
    rows.add(row)
    rows.save(answers=per_rank[0]["answers"])
    shown = [{"figure": k, "value": v} for k, v in row.items() if not isinstance(v, list)]
    show("evidence on vs off: decode tokens/s", shown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
