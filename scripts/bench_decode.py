"""Decoding on one device: tokens/s, host syncs and launches per decoded token, for the eager
loop, CUDA graphs (`--cuda-graphs`), torch.compile (`--compile-decode`) and both, next to the plan.

The engine's own token loop (`Conversation`, `Generator`, `StaticDecode`) on a random-weight model
(7B-241101 shapes on a GPU, small ones on a CPU) with a video's random visual K/V: the video prompt
is prefilled once; each mode then answers a warm-up question (compiles, captures) and a timed one,
greedy, to `--new-tokens`, each figure written to `--out` as it exists (a crash in a later one
keeps the earlier), in this order:

- per mode: tokens/s of the timed answer (the engine's loop: one host read per token), the kernels
  it ran and every attention-kernel fallback, its warm-up and capture included (a call rejected
  while a CUDA graph is captured is replayed by every later token without Python seeing it), a
  compiled step's graph breaks, and whether a static step on a GPU ran the bounded decode kernel;
- with eager and another mode on the same build (or CUDA graphs skipped on a CPU: the static step
  they capture, uncaptured), the other against eager with the same tokens fed to both
  (teacher-forced, `scripts/decode_compare.py`: bookkeeping, the first layer's K/V and output, the
  logits, against a noise floor measured in the same run);
- each mode's share of the memory roofline (`scripts/roofline.py`);
- last, per mode (the profiler may crash under a graph's replay, losing nothing before it): syncs
  per token (on a GPU what `torch.cuda.set_sync_debug_mode("warn")` reports; on a CPU the host
  reads of tensors, what a GPU would wait for) and launches per token (on a GPU the kernel and
  graph launches the profiler sees; on a CPU the aten ops dispatched), counted over answers of at
  most `--profile-tokens` tokens.

The run fails (exit 1) on a comparison that failed, any fallback or graph break, or a static step
that did not run the bounded decode kernel (`failures`). The greedy answers are kept, and whether
they are equal, for information only. And the plan's projection (`memory_plan.time_plan`
tokens/s, `memory_plan.kernel_calls` attention calls per token) for the same model and video. A
mode this device cannot run (CUDA graphs on a CPU) is skipped with the reason (`skipped_modes`),
and a run whose modes were all skipped says so at the top of its JSON.

    python scripts/bench_decode.py --device cuda --minutes 10 --modes eager cuda-graphs \
        --out decode.json
    python scripts/bench_decode.py --device cpu --minutes 0.1 --modes eager --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.config import GenerationConfig
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.generator import Generator, LoopOutcome
from lvx_app.engine.static_decode import DecodeStep
from lvx_app.parallel.group import DistInfo
from lvx_kernels.backends import kernel_tally
from scripts.decode_compare import ULP, compare, floor_hooks, forced_trace
from scripts.harness import Rows, command_line, machine, sync
from scripts.host_reads import counting_host_reads
from scripts.memory_plan import Workload, kernel_calls, time_plan
from scripts.op_count import AtenOps
from scripts.random_model import random_model
from scripts.roofline import copy_bandwidth, roofline
from scripts.roofline import line as roofline_line

MODES = {
    "eager": DecodeStep(),
    "cuda-graphs": DecodeStep(graphs=True),
    "compile": DecodeStep(compiled=True),
    "compile+cuda-graphs": DecodeStep(compiled=True, graphs=True),
}
UNCAPTURED = "static step (uncaptured)"  # the step CUDA graphs capture, run as it is (a CPU's)
STEPS = {**MODES, UNCAPTURED: DecodeStep()}  # what each compared mode runs
BOUNDED_KERNEL = "flash_varlen"  # the kernel a static step's text attention runs on a GPU
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchCooperativeKernel")


def _prompt(model, minutes: float, device: torch.device, dtype: torch.dtype):
    """A one-process conversation holding a video prompt of `minutes` at 1 fps (random features),
    and its last logits."""
    cfg = model.config
    frames = max(1, int(minutes * 60))
    starts = 18 + 5 * torch.arange(frames)
    ids = torch.randint(0, cfg.vocab_size, (int(starts[-1]) + 5 + 24,))
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device, backend=None)
    conversation = Conversation(model, info, None)
    with torch.no_grad():  # as the engine prepares a video (`engine/resident_visual_kv.py`)
        shape = (frames, cfg.vision.num_patches, cfg.hidden_size)  # made where it is used: a
        features = torch.randn(shape, device=device, dtype=dtype)  # CPU takes ~10 s for 10 min
        conversation.show_video(model.prepare_visual(features, starts))
    logits, _ = conversation.prefill(ids, whole=True)  # the engine's own inference mode
    return conversation, logits, frames


def _answer(generator: Generator, logits, tokens: int) -> list[int]:
    """One greedy answer of `tokens` tokens from the prompt's `logits`, on the mode's one generator
    (as the engine's session: its CUDA graph captured and its step compiled once, at the warm-up
    answer, and replayed by every later one)."""
    return list(generator.answer(logits, None, GenerationConfig(tokens), LoopOutcome()))


def _syncs(generator, logits, tokens, device) -> int:
    """Host syncs of one answer: CUDA's own count on a GPU, host reads of tensors on a CPU."""
    if device.type != "cuda":
        with counting_host_reads() as reads:
            _answer(generator, logits, tokens)
        return sum(reads.values())
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _answer(generator, logits, tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing" in str(w.message) for w in seen)


def _launches(generator, logits, tokens, device) -> int:
    """Kernel (and graph) launches of one answer: the profiler's on a GPU, aten ops on a CPU."""
    if device.type != "cuda":
        with AtenOps() as ops:
            _answer(generator, logits, tokens)
        return ops.count
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _answer(generator, logits, tokens)
    return sum(e.count for e in prof.key_averages() if e.key.startswith(LAUNCHES))


def _slope(generator, logits, prefix: int, tokens: int, device, count) -> float:
    """The count per token: its slope between a short and a `tokens` answer."""
    short, counts = max(2, tokens // 4), []
    for n in (short, tokens):
        generator.conversation.truncate(prefix)
        counts.append(count(generator, logits, n, device))
    return (counts[1] - counts[0]) / (tokens - short)


def graph_breaks() -> Counter:
    """torch.compile's graph breaks so far in this process, by reason."""
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


def timed_mode(conversation, logits, prefix, step: DecodeStep, tokens, device, row, save):
    """One mode's warm-up answer (compiles, captures) and timed answer into `row`: tokens/s, the
    kernels both ran (a capture's included: a graph replays what it recorded) and every fallback,
    and for a compiled step its graph breaks; `save(row)` once they exist. Returns the mode's one
    generator (the engine's: nothing wrapped, one per session)."""
    generator = Generator(conversation, (), step)
    before = graph_breaks() if step.compiled else Counter()
    with kernel_tally() as tally:
        conversation.truncate(prefix)
        _answer(generator, logits, tokens)  # compiles, captures, warms up
        conversation.truncate(prefix)
        sync(device)
        t0 = time.perf_counter()
        answer = _answer(generator, logits, tokens)
        sync(device)
        seconds = time.perf_counter() - t0
    row.update(tokens_per_s=(len(answer) - 1) / seconds, answer=answer,
               fallbacks=sorted(tally.fallbacks), kernels=dict(tally.calls))  # fmt: skip
    if step.compiled:
        row["graph_breaks"] = sorted(f"{why} ({n})" for why, n in (graph_breaks() - before).items())
    save(row)
    return generator


def bounded_kernel_missing(row: dict, step: DecodeStep, device, dtype) -> str | None:
    """Why a static step's row did not run the kernel the engine expects of it (flash's bounded
    decode, on a GPU in half precision), or None."""
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type != "cuda" or not half or not (step.graphs or step.compiled):
        return None
    if f"fwd {BOUNDED_KERNEL}" in row.get("kernels", {}):
        return None
    ran = ", ".join(sorted(row.get("kernels", {}))) or "nothing"
    return f"the static step did not run the bounded decode kernel ({BOUNDED_KERNEL}): ran {ran}"


def counted_mode(generator, logits, prefix, tokens, device, row, save, profiled=8) -> None:
    """The slopes of syncs and of launches per token over answers of at most `profiled` tokens,
    into `row`, each saved as it exists; fallbacks they see are added to the row's. A failure of
    the launch count (the profiler) is recorded in the row; the figures before it stay."""
    conversation, short = generator.conversation, min(tokens, profiled)
    with kernel_tally() as tally:
        row["syncs_per_token"] = _slope(generator, logits, prefix, short, device, _syncs)
        save(row)
        try:
            row["launches_per_token"] = _slope(generator, logits, prefix, short, device, _launches)
        except Exception as exc:  # noqa: BLE001 - the profiler failing loses only its own figure
            row["launches_error"] = f"{type(exc).__name__}: {exc}"[:300]
    row["fallbacks"] = sorted(set(row["fallbacks"]) | set(tally.fallbacks))
    conversation.truncate(prefix)
    save(row)


def mode_row(conversation, logits, prefix, step: DecodeStep, tokens, device, save, profiled=8):
    """One mode as a session runs it, on one generator: `timed_mode`, then `counted_mode`."""
    row: dict = {}
    generator = timed_mode(conversation, logits, prefix, step, tokens, device, row, save)
    counted_mode(generator, logits, prefix, tokens, device, row, save, profiled)
    return row


def compared_modes(rows: list[dict]) -> list[str]:
    """The modes compared with eager: every other mode that ran, and the static step uncaptured
    where CUDA graphs were asked for and skipped (the step the graphs capture)."""
    ran = [r["mode"] for r in rows if "answer" in r and r["mode"] != "eager"]
    skipped = any(MODES[r["mode"]].graphs for r in rows if r.get("skipped"))
    return ran + ([UNCAPTURED] if skipped and UNCAPTURED not in ran else [])


def compare_modes(conversation, prefix: int, rows: list[dict], dtype: torch.dtype) -> dict:
    """Every mode of `compared_modes`, teacher-forced on eager's answer beside eager and the
    noise floor's run (eager with its text attention on a second backend): `decode_compare`,
    keyed by mode; each comparison lists the fallbacks its runs saw."""
    ran = {r["mode"]: r for r in rows if "answer" in r}
    if "eager" not in ran:
        return {}
    tokens = ran["eager"]["answer"][:-1] or ran["eager"]["answer"]
    with kernel_tally() as tally:
        eager = forced_trace(conversation, prefix, tokens, None)
        floor = forced_trace(conversation, prefix, tokens, None, hooks=floor_hooks(conversation))
    out, seen = {}, set(tally.fallbacks)
    for name in compared_modes(rows):
        step = STEPS[name]
        with kernel_tally() as tally:
            other = forced_trace(conversation, prefix, tokens, step)
        out[name] = compare(eager, other, floor, ULP[dtype], exact_kv=not step.compiled)
        out[name]["fallbacks"] = sorted(seen | set(tally.fallbacks))
    return out


def projected(model, frames: int, tokens: int, shape: str, device) -> dict:
    """The plan's tokens/s (7B only) and attention kernel calls per decoded token."""
    work = Workload(minutes=frames / 60, ranks=1, device=device.type, answer_tokens=tokens)
    calls = kernel_calls(model.config, work, rank=0)
    layers, hyper = model.config.num_hidden_layers, len(model.config.hyper_layer_indices)
    return {
        "tokens_per_s": time_plan(model.config, work)["tokens/s"] if shape == "7b" else None,
        "attention_calls_per_token": layers * calls.decode_text + hyper * calls.decode_visual,
    }


def failures(rows: Rows) -> list[str]:
    """What fails the run: a comparison that failed, any fallback or graph break, a static step
    that did not run the kernel expected of it."""
    found = [f"{name} vs eager: {c['why']}" for name, c in rows.extra.get("comparison", {}).items()
             if not c["ok"]]  # fmt: skip
    found += [f"fallback: {f}" for f in rows.extra.get("fallbacks", [])]
    found += [f"graph break: {b}" for b in rows.extra.get("graph_breaks", [])]
    return found + [f"{r['mode']}: {r['kernel_not_taken']}" for r in rows.rows
                    if r.get("kernel_not_taken")]  # fmt: skip


def bench(args, rows: Rows) -> None:
    """Every mode's tokens/s, then the comparison with eager, the roofline share, and last the
    sync and launch counts (the profiler may crash under a graph's replay: nothing before it is
    lost); each row saved as its figures come."""
    device = torch.device(args.device)
    runnable = [m for m in args.modes if device.type == "cuda" or not MODES[m].graphs]
    for name in args.modes:
        if name not in runnable:
            rows.add({"mode": name, "skipped": "CUDA graphs need a GPU"})
    rows.save(skipped_modes={r["mode"]: r["skipped"] for r in rows.rows if r.get("skipped")})
    if not runnable:
        rows.save(skipped="every mode asked for needs a GPU")
        return
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, device, dtype)
    conversation, logits, frames = _prompt(model, args.minutes, device, dtype)
    rows.save(
        shape=args.shape, frames=frames, new_tokens=args.new_tokens,
        projected=projected(model, frames, args.new_tokens, args.shape, device),
    )  # fmt: skip
    prefix, generators = conversation.position, {}

    def save(row: dict) -> None:
        rows.save(
            fallbacks=sorted({f for r in rows.rows for f in r.get("fallbacks", [])}),
            graph_breaks=sorted({b for r in rows.rows for b in r.get("graph_breaks", [])}),
        )

    for name in runnable:
        row = rows.add({"mode": name})
        generators[name] = timed_mode(conversation, logits, prefix, MODES[name], args.new_tokens,
                                      device, row, save)  # fmt: skip
        row["kernel_not_taken"] = bounded_kernel_missing(row, MODES[name], device, dtype)
        save(row)
        print({k: v for k, v in row.items() if k != "answer"}, flush=True)
    comparison = compare_modes(conversation, prefix, rows.rows, dtype)
    rows.save(comparison=comparison)
    compared = {f for c in comparison.values() for f in c["fallbacks"]}
    rows.save(fallbacks=sorted(set(rows.extra["fallbacks"]) | compared))
    for name, c in comparison.items():
        print(f"{name} vs eager, teacher-forced over {c['steps']} steps: logits differ by at most "
              f"{c['max_relative_logits_difference']:.2e} of their RMS (noise floor "
              f"{c['noise_floor']:.2e}, bound {c['bound']:.2e}): "
              + ("ok" if c["ok"] else f"FAILED: {c['why']}"), flush=True)  # fmt: skip
    shares = roofline_rows(model, rows.rows, args.minutes, args.new_tokens, device, dtype)
    rows.save(roofline=shares)
    for name, share in shares.items():
        print(roofline_line(name, share), flush=True)
    for row in rows.rows:
        if row.get("mode") in generators:
            counted_mode(generators[row["mode"]], logits, prefix, args.new_tokens, device, row,
                         save, args.profile_tokens)  # fmt: skip


def roofline_rows(model, rows, minutes: float, tokens: int, device, dtype) -> dict:
    """Each mode's share of the memory roofline (`scripts/roofline.py`), one copy measured."""
    bandwidth = copy_bandwidth(device)
    return {r["mode"]: roofline(model.config, minutes, r["tokens_per_s"], bandwidth, tokens,
                                dtype.itemsize) for r in rows if "tokens_per_s" in r}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shape", choices=["7b", "small"], default=None, help="default: 7b on a GPU"
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="video length at 1 fps")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--profile-tokens", type=int, default=8, help="the longest answer the counts profile"
    )
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--out", type=Path, default=None, help="the JSON, written as figures come")
    args = parser.parse_args(argv)
    args.shape = args.shape or ("7b" if torch.device(args.device).type == "cuda" else "small")
    rows = Rows(args.out, command=command_line(), machine=machine(args.device), fallbacks=[])
    bench(args, rows)
    answers = {tuple(r["answer"]) for r in rows.rows if "answer" in r}
    rows.save(same_answers=len(answers) <= 1)  # for information: near-tied logits make it noise
    print("projected:", rows.extra.get("projected"), "same greedy answers:", len(answers) <= 1)
    found = failures(rows)
    rows.save(failures=found)
    for line in found:
        print(f"FAILED {line}", flush=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
