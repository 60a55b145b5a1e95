#!/usr/bin/env python
"""How every cost of a chat session grows with the video, from a minute to hours, measured.

For each length a synthetic video (a one-minute clip stream-copied back to back, so an hour is made
in a second; frames decode like a real video's) with a sidecar subtitle file of one cue per 5 s,
sampled at 1 fps through the tiny g2 checkpoint on CPU ranks. Each (minutes, ranks) row runs in a
fresh process (so peak RSS is that row's) and records:

- ingest_s: decode + encode + save of the frames (the largest rank's, the engine's own timer);
- ingest_cpu_s: CPU seconds of the first load but its prefill, over every process of the row (the
  ranks and their decode workers): on a machine shared with other work, CPU seconds keep the shape
  of the growth where wall seconds follow the load;
- cache_mb: the cache folder on disk after the first open (features, visual K/V, saved prompt);
- peak_rss_gb: the largest rank's peak resident memory after the first open;
- prompt_tokens, prefill_s, prefill_cpu_s: the video prompt's tokens and its prefill (largest
  rank; CPU: all ranks);
- load_s: the whole first `load_video` (ingest, subtitles, visual K/V, prefill);
- reopen_s, reopen_cpu_s: a second `load_video` of the same video, from the caches;
- ttft_s, tok_per_s: a 12-token question (after a warm-up question) and a 64-token answer;
- plan_7b: the same length and ranks projected for mPLUG-Owl3-7B on H100s (scripts/memory_plan.py:
  GPU part of ingest, visual K/V, prefill, TTFT, decode, peak memory; no CPU decoding).

Growth exponents (log of the ratio over log of the length ratio) between consecutive lengths are
printed and stored; linear costs give about 1, the video prompt's prefill up to 2 (every frame's
placeholder tokens attend to every earlier frame). `--repeats N` runs each row N times and keeps
each time's fastest, the least disturbed by other work on a shared machine.

    python scripts/bench_scale.py --minutes 1,10,60 --ranks 1,2 --repeats 2 --out runs/scale.json
    python scripts/bench_scale.py --minutes 180 --ranks 1,2 --out runs/scale_180.json
    # tables and the log-log plot from saved runs
    python scripts/bench_scale.py --report runs/scale.json runs/scale_180.json \\
        --plot docs/scale.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(ROOT)
    import scripts  # noqa: F401

from scripts.harness import command_line, dumps, machine, pyplot, save_figure, write_json

CLIP_SECONDS = 60
CUE_EVERY_S = 5.0
# 12 tokens with the tiny checkpoint's tokenizer (its turn adds the chat template's)
QUESTION = "What happens near the end?"
NEW_TOKENS = 64
METRICS = (
    *("ingest_s", "ingest_cpu_s", "cache_mb", "peak_rss_gb", "prefill_s", "prefill_cpu_s"),
    *("reopen_s", "reopen_cpu_s", "ttft_s", "decode_ms"),
)
# what `fastest` takes the smallest of over repeats
TIMES = (
    *("load_s", "ingest_s", "load_cpu_s", "ingest_cpu_s", "visual_kv_s", "prefill_s"),
    *("prefill_cpu_s", "reopen_s", "reopen_cpu_s", "ttft_s", "decode_ms"),
)
# the largest growth exponent each cost may show: linear (1) with a margin, the video prompt's
# prefill quadratic by design
LIMITS = {"prefill_s": 2.1, "prefill_cpu_s": 2.1}
LINEAR_LIMIT = 1.15


# ------------------------------------------------------------------ inputs


def make_clip(path: Path, fps: int, width: int, height: int) -> Path:
    """The one-minute clip every long video repeats (H.264, a keyframe every 250 frames)."""
    from lvx_app.video.synthetic import make_video

    if not path.exists():
        make_video(path, num_frames=CLIP_SECONDS * fps, fps=fps, width=width, height=height)
    return path


def write_cues(path: Path, seconds: float) -> Path:
    """A sidecar SRT with one cue per CUE_EVERY_S seconds, each a different line."""
    from lvx_app.video.synthetic import write_srt

    line = "Scene {0}: someone says line {0} of the film."
    n = int(seconds // CUE_EVERY_S)
    cues = [(i * CUE_EVERY_S, (i + 1) * CUE_EVERY_S - 1, line.format(i)) for i in range(n)]
    return write_srt(path, cues)


def make_inputs(workdir: Path, minutes: float, clip: Path) -> Path:
    """The video of `minutes` (whole minutes of the clip) and its sidecar subtitles."""
    from lvx_app.video.synthetic import concat_video

    video = workdir / f"video_{minutes:g}min.mp4"
    if not video.exists():
        concat_video(clip, video, max(1, round(minutes * 60 / CLIP_SECONDS)))
    write_cues(video.with_suffix(".srt"), minutes * 60)
    return video


# ------------------------------------------------------------------ one row, in its own process


def _rank_max(ranks: list[dict], key: str) -> float:
    """The largest rank's value of a `/stats` row entry ("0.42 GiB" strings read as numbers)."""
    values = [float(re.sub(r"[^0-9.]", "", str(r[key]))) for r in ranks if key in r]
    return max(values, default=float("nan"))


def tree_cpu_s(root: int) -> float:
    """CPU seconds of process `root` and every process below it, with the children they reaped
    (Linux /proc; decode workers hang off a forkserver, the ranks off torchrun)."""
    stats, children = {}, {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        stats[pid] = fields
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += sum(int(x) for x in stats[pid][11:15])  # utime, stime, cutime, cstime
        todo.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


def _folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def measure_row(checkpoint: str, video: str, ranks: int, cache: str) -> dict:
    """One (video, ranks) row: first open, the stats, a question and its answer, a reopen."""
    from lvx_app.config import Config
    from lvx_app.runtime.open import open_engine

    warnings.simplefilter("ignore")  # subtitle lines dropped to fit the budget: expected here
    config = Config.from_options(model=checkpoint, cache_dir=cache, gpus=0, ranks=ranks)
    load_before, me = os.getloadavg()[0], os.getpid()
    engine = open_engine(config)
    try:
        t0, cpu0 = time.perf_counter(), tree_cpu_s(me)
        summary = engine.load_video(video)
        load_s, load_cpu_s = time.perf_counter() - t0, tree_cpu_s(me) - cpu0
        stats = engine.stats()
        cache_mb = _folder_mb(Path(cache))
        "".join(engine.ask("Warm up.", max_new_tokens=2))
        engine.reset()
        prompt_tokens = stats["prompt tokens"]
        "".join(engine.ask(QUESTION, max_new_tokens=NEW_TOKENS))
        answer = engine.last_answer
        t0, cpu0 = time.perf_counter(), tree_cpu_s(me)
        again = engine.load_video(video)
        reopen_s, reopen_cpu_s = time.perf_counter() - t0, tree_cpu_s(me) - cpu0
    finally:
        engine.close()
    if not (again.from_cache and again.prompt_from_cache):
        raise SystemExit(f"the reopen of {video} did not come from the caches")
    per_rank = stats["ranks"]
    prefill_cpu_s = sum(r["video prompt prefill CPU s"] for r in per_rank)
    return {
        "frames": summary.frames,
        "subtitle_lines": summary.subtitle_lines,
        "load_s": load_s,
        "ingest_s": _rank_max(per_rank, "ingest s"),
        "load_cpu_s": load_cpu_s,
        "ingest_cpu_s": load_cpu_s - prefill_cpu_s,
        "visual_kv_s": _rank_max(per_rank, "visual K/V compute s"),
        "prefill_s": _rank_max(per_rank, "video prompt prefill s"),
        "prefill_cpu_s": prefill_cpu_s,
        "cache_mb": cache_mb,
        "peak_rss_gb": _rank_max(per_rank, "peak RSS") * 2**30 / 1e9,
        "prompt_tokens": prompt_tokens,
        "reopen_s": reopen_s,
        "reopen_cpu_s": reopen_cpu_s,
        "question_turn_tokens": answer.prompt_tokens - prompt_tokens,
        "ttft_s": answer.ttft_s,
        "new_tokens": answer.new_tokens,
        "tok_per_s": answer.tokens_per_s,
        "decode_ms": 1e3 / answer.tokens_per_s if answer.tokens_per_s else float("nan"),
        "load_avg": [load_before, os.getloadavg()[0]],
    }


def run_row(checkpoint: Path, video: Path, minutes: float, ranks: int, workdir: Path) -> dict:
    """`measure_row` in a fresh process (its peak RSS is this row's alone), plus the 7B plan."""
    cache = workdir / f"cache-{minutes:g}min-{ranks}r"
    shutil.rmtree(cache, ignore_errors=True)
    job = json.dumps([str(checkpoint), str(video), ranks, str(cache)], allow_nan=False)
    # one compute thread per rank, as torchrun gives each: rows of 1 and 2 ranks compare, and
    # other work on a shared machine does not stall the thread barriers of every small op
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "--row", job],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")]
    if done.returncode or not lines:
        raise SystemExit(f"the {minutes:g}-minute row on {ranks} rank(s) failed:\n{done.stderr}")
    shutil.rmtree(cache, ignore_errors=True)
    row = {"minutes": minutes, "ranks": ranks, **json.loads(lines[-1][4:])}
    row["plan_7b"] = plan_7b(minutes, ranks)
    return row


# ------------------------------------------------------------------ the 7B projection


def plan_7b(minutes: float, ranks: int) -> dict:
    """mPLUG-Owl3-7B-241101 at the same length on `ranks` H100s, bf16, resident visual K/V (all
    projected by scripts/memory_plan.py; CPU video decoding and communication not counted)."""
    from lvx_models.mplug_owl3.published import RELEASES
    from scripts.memory_plan import Workload, memory_plan, time_plan

    cfg, work = RELEASES["mPLUG-Owl3-7B-241101"], Workload(minutes=minutes, ranks=ranks)
    t = time_plan(cfg, work)
    ingest = t["ingest (vision tower + projector)"]["seconds"]
    kv, prefill = t["visual K/V"]["seconds"], t["video-prompt prefill"]["seconds"]
    return {
        "ingest_gpu_s": ingest,
        "visual_kv_s": kv,
        "prefill_s": prefill,
        "prefill_share_of_load": prefill / (ingest + kv + prefill),
        "ttft_s": t["question prefill (TTFT)"]["seconds"],
        "tok_per_s": t["tokens/s"],
        "peak_gb": memory_plan(cfg, work).peak / 1e9,
        "prompt_tokens": work.prompt_tokens,
    }


# ------------------------------------------------------------------ growth and report


def exponents(rows: list[dict]) -> list[dict]:
    """Per ranks and consecutive pair of lengths: log(cost ratio) / log(length ratio) of every
    metric (and of the 7B plan's prefill)."""
    out = []
    for n in sorted({r["ranks"] for r in rows}):
        mine = sorted((r for r in rows if r["ranks"] == n), key=lambda r: r["minutes"])
        for a, b in zip(mine, mine[1:]):
            span = math.log(b["minutes"] / a["minutes"])

            def growth(x: float, y: float) -> float:
                return math.log(y / x) / span if x and y and x > 0 and y > 0 else float("nan")

            item = {"ranks": n, "from_min": a["minutes"], "to_min": b["minutes"]}
            item.update({m: growth(a.get(m, math.nan), b.get(m, math.nan)) for m in METRICS})
            item["plan_7b_prefill_s"] = growth(a["plan_7b"]["prefill_s"], b["plan_7b"]["prefill_s"])
            out.append(item)
    return out


def too_fast(growth: list[dict]) -> list[str]:
    """The costs that grew faster than their law from 10 minutes on (shorter spans are dominated by
    start-up constants)."""
    return [
        f"{m} on {g['ranks']} rank(s), {g['from_min']:g}->{g['to_min']:g} min: {g[m]:.2f}"
        for g in growth
        if g["from_min"] >= 10
        for m in METRICS
        if g[m] > LIMITS.get(m, LINEAR_LIMIT)
    ]


def markdown(rows: list[dict], growth: list[dict]) -> str:
    """The rows (wall seconds, CPU seconds in brackets) and the growth exponents, Markdown."""
    head = (
        "| min | ranks | ingest s (CPU) | cache MB | peak RSS GB | prompt tokens | "
        "prefill s (CPU) | reopen s (CPU) | TTFT s | tok/s | load avg | "
        "7B plan: prefill share of load |\n" + "|---" * 12 + "|\n"
    )
    body = "".join(
        f"| {r['minutes']:g} | {r['ranks']} | {r['ingest_s']:.1f} ({r['ingest_cpu_s']:.1f}) | "
        f"{r['cache_mb']:.1f} | {r['peak_rss_gb']:.2f} | {r['prompt_tokens']:,} | "
        f"{r['prefill_s']:.2f} ({r['prefill_cpu_s']:.2f}) | "
        f"{r['reopen_s']:.2f} ({r['reopen_cpu_s']:.2f}) | {r['ttft_s']:.3f} | "
        f"{r['tok_per_s']:.0f} | {_load(r['load_avg'])} | "
        f"{r['plan_7b']['prefill_share_of_load']:.0%} |\n"
        for r in sorted(rows, key=lambda r: (r["ranks"], r["minutes"]))
    )
    names = " | ".join(m.replace("_", " ") for m in METRICS)
    exp_head = f"\n| ranks | minutes | {names} |\n" + "|---" * (len(METRICS) + 2) + "|\n"
    exp = "".join(
        f"| {g['ranks']} | {g['from_min']:g}→{g['to_min']:g} | "
        + " | ".join(f"{g[m]:.2f}" for m in METRICS)
        + " |\n"
        for g in growth
    )
    return head + body + exp_head + exp


def _load(load_avg: list) -> str:
    """The 1-minute load average(s) at the start of a row's run(s)."""
    firsts = [a[0] for a in load_avg] if isinstance(load_avg[0], list) else [load_avg[0]]
    return "/".join(f"{x:.1f}" for x in firsts)


def plot(rows: list[dict], path: Path) -> None:
    """Log-log: seconds per stage (left) and memory, cache (right) against minutes of video; one
    colour per cost, solid for one rank, dashed for two; grey guides of slope 1 and 2."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=80)
    costs = {
        left: [
            ("ingest_s", "ingest s"),
            ("prefill_s", "prefill s"),
            ("reopen_s", "reopen s"),
            ("ttft_s", "TTFT s"),
            ("decode_ms", "decode ms/token"),
        ],
        right: [("cache_mb", "cache MB"), ("peak_rss_gb", "peak RSS GB")],
    }
    for ax, keys in costs.items():
        for colour, (key, label) in enumerate(keys):
            for n, style in ((1, "-o"), (2, "--s")):
                mine = sorted((r for r in rows if r["ranks"] == n), key=lambda r: r["minutes"])
                if mine:
                    x, y = [r["minutes"] for r in mine], [r[key] for r in mine]
                    name = f"{label}, {n} rank{'s' if n > 1 else ''}"
                    ax.plot(x, y, style, color=f"C{colour}", label=name, ms=3)
        span = [min(r["minutes"] for r in rows), max(r["minutes"] for r in rows)]
        for slope in (1, 2):
            ax.plot(span, [1e-2 * (m / span[0]) ** slope for m in span], ":", color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("minutes of video (1 fps); dotted: slope 1 and 2")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("lvx, tiny g2 checkpoint, CPU ranks: cost against video length", fontsize=9)
    save_figure(fig, path)


def report(rows: list[dict], args) -> dict:
    growth = exponents(rows)
    print(markdown(rows, growth))
    fast = too_fast(growth)
    print("grew faster than their law: " + ("; ".join(fast) if fast else "none"))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return {"rows": rows, "exponents": growth, "too_fast": fast}


# positions the benchmark's checkpoint takes: 3 hours at 1 fps is a 54,018-token prompt, past the
# 32,768 a released model was trained on (lvx refuses such a video); the tiny checkpoint's random
# weights learned no positions, so its context is widened to measure how costs grow up to there
BENCH_POSITIONS = 65_536


def _room_for_three_hours(config: Path) -> None:
    fields = json.loads(config.read_text())
    fields["max_position_embeddings"] = BENCH_POSITIONS
    config.write_text(json.dumps(fields, indent=2, allow_nan=False))


def run(args) -> list[dict]:
    from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lvx-bench-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / "tiny-g2"
    if not (checkpoint / "config.json").exists():
        write_tiny_checkpoint(checkpoint, "g2")
        _room_for_three_hours(checkpoint / "config.json")
    clip = make_clip(workdir / "clip.mp4", args.clip_fps, args.width, args.height)
    rows = []
    for minutes in args.minutes:
        video = make_inputs(workdir, minutes, clip)
        for n in args.ranks:
            t0 = time.perf_counter()
            runs = [run_row(checkpoint, video, minutes, n, workdir) for _ in range(args.repeats)]
            rows.append(fastest(runs))
            print(f"{minutes:g} min, {n} rank(s): {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def fastest(runs: list[dict]) -> dict:
    """One row from repeats of it: each time the smallest (the least disturbed by other work on a
    shared machine), everything else from the first; every repeat's load average kept."""
    row = dict(runs[0])
    for key in TIMES:
        row[key] = min(r[key] for r in runs)
    row["tok_per_s"] = max(r["tok_per_s"] for r in runs)
    row["load_avg"] = [r["load_avg"] for r in runs] if len(runs) > 1 else runs[0]["load_avg"]
    row["repeats"] = len(runs)
    return row


def _numbers(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--minutes", type=_numbers, default=[1.0, 10.0, 60.0])
    p.add_argument("--ranks", type=lambda t: _numbers(t, int), default=[1, 2])
    p.add_argument("--repeats", type=int, default=1, help="runs of each row; the fastest kept")
    p.add_argument("--clip-fps", type=int, default=30, help="frame rate of the repeated clip")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--height", type=int, default=96)
    p.add_argument("--workdir", type=Path, help="keep videos and checkpoint here (default: temp)")
    p.add_argument("--out", type=Path, help="write the rows, exponents and machine as JSON")
    p.add_argument("--plot", type=Path, help="write the log-log plot (PNG) here")
    p.add_argument("--report", type=Path, nargs="+", help="report saved runs instead of running")
    p.add_argument("--row", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row:
        print("ROW " + dumps(measure_row(*json.loads(args.row))), flush=True)
        return
    if args.report:
        rows = [r for f in args.report for r in json.loads(f.read_text())["rows"]]
        machines = [json.loads(f.read_text()).get("machine") for f in args.report]
    else:
        rows, machines = run(args), [machine()]
    out = report(rows, args) | {"machine": machines[0], "command": command_line()}
    if args.out:
        print(f"wrote {write_json(args.out, out)}")


if __name__ == "__main__":
    main()
