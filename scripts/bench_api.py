"""Time to first token of a first question and of its follow-up through the OpenAI-compatible API
(`lvx serve --no-ui`, the official `openai` client, streaming, the whole conversation sent with
every request), next to the same questions through the engine `lvx chat` drives (`Engine.ask` in
this process, the conversation held between turns).

Tiny random-weight checkpoint, a synthetic video, CPU ranks. Each repeat starts a new conversation
about the loaded video (a question of its own), then asks one follow-up. TTFT is measured by the
caller: from the request (or `ask`) to the first piece of text.

    OMP_NUM_THREADS=1 python scripts/bench_api.py --ranks 2 --minutes 10 --repeats 5
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


from scripts.harness import command_line, machine, show, write_json
from scripts.serve_process import start_serve

QUESTION = "({}) What happens in the video, and when does the scene change?"  # ({}): a new one
FOLLOW_UP = "And what happens right after that?"


def _first_piece(pieces, t0: float) -> tuple[float, str]:
    """(seconds from `t0` to the first non-empty piece, the whole text)."""
    ttft, text = None, ""
    for piece in pieces:
        if piece and ttft is None:
            ttft = time.perf_counter() - t0
        text += piece
    return ttft if ttft is not None else time.perf_counter() - t0, text


def bench_api(checkpoint: Path, video: Path, ranks: int, tokens: int, repeats: int) -> list[dict]:
    import openai

    folder = video.parent
    server, port = start_serve(checkpoint, ranks, folder, folder / "cache", folder / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)

        def ask(messages: list[dict]) -> tuple[float, str, tuple[int, int]]:
            t0 = time.perf_counter()
            stream = client.chat.completions.create(
                model="m",
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=tokens,
            )
            chunks = []
            ttft, text = _first_piece(_texts(stream, chunks), t0)
            usage = chunks[-1].usage
            cached = usage.prompt_tokens_details.cached_tokens
            return ttft, text, (usage.prompt_tokens - cached, usage.prompt_tokens)

        url = {"type": "video_url", "video_url": {"url": f"file://{video}"}}
        ask([{"role": "user", "content": [url, {"type": "text", "text": "warm-up"}]}])  # loads
        rows = []
        for r in range(repeats):
            first = [
                {"role": "user", "content": [url, {"type": "text", "text": QUESTION.format(r)}]}
            ]
            ttft_q, answer, prefill_q = ask(first)
            follow = first + [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": FOLLOW_UP},
            ]
            ttft_f, _, prefill_f = ask(follow)
            rows.append(dict(question=(ttft_q, prefill_q), follow_up=(ttft_f, prefill_f)))
        return rows
    finally:
        server.terminate()
        server.wait(timeout=60)


def _texts(stream, chunks: list):
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            yield choice.delta.content or ""


def bench_engine(checkpoint: Path, video: Path, ranks: int, tokens: int, repeats: int) -> list:
    import lvx_app as lvx

    cache = str(video.parent / "cache")
    with lvx.open(
        str(checkpoint), gpus=0, ranks=ranks, cache_dir=cache, subtitles="none"
    ) as engine:
        engine.load_video(str(video))
        "".join(engine.ask("warm-up", max_new_tokens=tokens))
        rows = []
        for r in range(repeats):
            engine.reset()
            t0 = time.perf_counter()
            ttft_q, _ = _first_piece(engine.ask(QUESTION.format(r), max_new_tokens=tokens), t0)
            prefill_q = _prefilled(engine.last_answer)
            t0 = time.perf_counter()
            ttft_f, _ = _first_piece(engine.ask(FOLLOW_UP, max_new_tokens=tokens), t0)
            prefill_f = _prefilled(engine.last_answer)
            rows.append(dict(question=(ttft_q, prefill_q), follow_up=(ttft_f, prefill_f)))
        return rows


def _prefilled(stats) -> tuple[int, int]:
    return stats.prefill_tokens, stats.prompt_tokens


def summarize(name: str, rows: list[dict]) -> list[dict]:
    out = []
    for turn in ("question", "follow_up"):
        ttfts = [row[turn][0] for row in rows]
        out.append(
            {
                "through": name,
                "turn": turn.replace("_", "-"),
                "ttft_ms": 1000 * statistics.median(ttfts),
                "ttft_ms_all": [round(1000 * t, 2) for t in ttfts],
                "prefilled_tokens": statistics.median(row[turn][1][0] for row in rows),
                "prompt_tokens": statistics.median(row[turn][1][1] for row in rows),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=10.0, help="video length, 1 fps")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from lvx_app.video.synthetic import make_video
    from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        work = Path(tmp)
        checkpoint = write_tiny_checkpoint(work / "tiny-g2", "g2")
        video = work / "videos" / "video.mp4"
        video.parent.mkdir()
        make_video(video, num_frames=int(args.minutes * 60 * 2), fps=2, width=96, height=64)
        shape = (checkpoint, video, args.ranks, args.new_tokens, args.repeats)
        rows = summarize("OpenAI API (lvx serve --no-ui)", bench_api(*shape))
        rows += summarize("lvx chat's engine (Engine.ask)", bench_engine(*shape))
    shown = [
        {
            "through": row["through"],
            "turn": row["turn"],
            "TTFT ms (median)": f"{row['ttft_ms']:.1f}",
            "prefilled of prompt tokens": f"{row['prefilled_tokens']:g} of "
            f"{row['prompt_tokens']:g}",
        }
        for row in rows
    ]
    show("time to first token", shown)
    if args.out is not None:
        report = {"command": command_line(), "args": vars(args), "machine": machine(), "rows": rows}
        write_json(args.out, report)


if __name__ == "__main__":
    main()
