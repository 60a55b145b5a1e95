"""One chat of whatever lvx this Python imports, timed in one process: TTFT, decode tok/s and a
follow-up's TTFT. `bench_commits.py` runs it once per commit and repetition, each commit's tree
first on the path, and reads the one JSON line it prints.

The engine as `lvx chat --gpus 0` runs it on one CPU rank (`open_engine`: its `Conversation` and
`Generator` in this process, the answer's moments on), float32, `--threads` torch threads, the
cache off: the video is loaded (frames decoded and encoded, the video prompt prefilled), a 4-token
warm-up answer given and forgotten, then the question `--asks` times (the conversation reset before
each) and, after the last, a follow-up, each answer `--new-tokens` greedy tokens of cached
single-token decoding steps. The figures are the engine's own (`last_answer`), medians over the
asks: TTFT (the question's prefill and first token), tokens/s (the rest of the answer, its moments
included), and the follow-up's TTFT; beside them the process's CPU seconds and minor page faults
per answer, steadier than the wall clock on a shared machine.

    python -P scripts/chat_turn_timing.py --checkpoint /tmp/tiny-g1-gateproj --video v.mp4
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from pathlib import Path

QUESTION = "What happens in the video, and when does the scene change?"
FOLLOW_UP = "And what comes right after that?"


def _usage() -> tuple[float, int]:
    """(CPU seconds, minor page faults) of this process so far."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime, used.ru_minflt


def time_chat(engine, video: Path, new_tokens: int, asks: int) -> dict:
    """The figures of one loaded video's questions and follow-up (see the module docstring)."""
    summary = engine.load_video(str(video), subtitles=[], fps=1.0)
    "".join(engine.ask("warm-up?", max_new_tokens=4))
    cpu, faults = _usage()
    answers = []
    for _ in range(asks):
        engine.reset()
        "".join(engine.ask(QUESTION, max_new_tokens=new_tokens))
        answers.append(engine.last_answer)
    "".join(engine.ask(FOLLOW_UP, max_new_tokens=new_tokens))
    follow_up = engine.last_answer
    cpu_end, faults_end = _usage()
    return {
        "frames": summary.frames,
        "visual_tokens": summary.visual_tokens,
        "prompt_tokens": answers[0].prompt_tokens,
        "ttft_s": statistics.median(a.ttft_s for a in answers),
        "decode_tok_s": statistics.median(a.tokens_per_s for a in answers),
        "follow_up_ttft_s": follow_up.ttft_s,
        "new_tokens": answers[0].new_tokens,
        "answer_cpu_s": (cpu_end - cpu) / (asks + 1),
        "answer_page_faults": (faults_end - faults) / (asks + 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--video", type=Path, required=True, help="read at 1 fps")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--asks", type=int, default=3, help="times the question is asked")
    args = parser.parse_args(argv)
    import torch

    import lvx_app
    from lvx_app.config import Config
    from lvx_app.runtime.open import open_engine

    torch.set_num_threads(args.threads)
    config = Config.from_options(model=str(args.checkpoint), cache=False, gpus=0, ranks=1)
    engine = open_engine(config)
    try:
        row = time_chat(engine, args.video, args.new_tokens, args.asks)
    finally:
        engine.close()
    row["lvx_app"] = str(Path(lvx_app.__file__).resolve().parent)
    print(json.dumps(row, allow_nan=False))


if __name__ == "__main__":
    main()
