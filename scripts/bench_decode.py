"""Decoding on one device: tokens/s, host syncs and launches per decoded token, for the eager
loop, CUDA graphs (`--cuda-graphs`), torch.compile (`--compile-decode`) and both, next to the plan.

The engine's own token loop (`Conversation`, `Generator`, `StaticDecode`) on a random-weight model
(7B-241101 shapes on a GPU, small ones on a CPU) with a video's random visual K/V: the video prompt
is prefilled once; each mode then answers a warm-up question (compiles, captures) and a timed one,
greedy, to `--new-tokens`. Per mode, in this order, each figure written to `--out` as it exists (a
crash in a later one keeps the earlier):

- tokens/s of the timed answer (the engine's loop: one host read per token);
- syncs per token: on a GPU, what `torch.cuda.set_sync_debug_mode("warn")` reports; on a CPU, the
  host reads of tensors (`host_reads`), what a GPU would wait for;
- launches per token: on a GPU, the kernel and graph launches the profiler sees (cudaLaunchKernel,
  cudaGraphLaunch and the like); on a CPU, the aten ops dispatched (each one kernel on a GPU);
  both counted over answers of at most `--profile-tokens` tokens;
- every attention-kernel fallback of the mode, its warm-up and capture included (a call rejected
  while a CUDA graph is captured is replayed by every later token without Python seeing it);

then, with eager and another mode on the same build, the other mode's logits against eager's with
the same tokens fed to both (teacher-forced, `scripts/decode_compare.py`): the run fails (exit 1)
when a step's logits differ past the bound derived there. The greedy answers are kept, and whether
they are equal, for information only. And the plan's projection (`memory_plan.time_plan`
tokens/s, `memory_plan.kernel_calls` attention calls per token) for the same model and video. A
mode this device cannot run (CUDA graphs on a CPU) is skipped with the reason, and a run whose
modes were all skipped says so at the top of its JSON.

    python scripts/bench_decode.py --device cuda --minutes 10 --modes eager cuda-graphs \
        --out decode.json
    python scripts/bench_decode.py --device cpu --minutes 0.1 --modes eager --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
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
from scripts.decode_compare import bound, compare, forced_logits
from scripts.harness import Rows, command_line, machine, sync
from scripts.host_reads import counting_host_reads
from scripts.memory_plan import Workload, kernel_calls, time_plan
from scripts.op_count import AtenOps
from scripts.random_model import random_model

MODES = {
    "eager": DecodeStep(),
    "cuda-graphs": DecodeStep(graphs=True),
    "compile": DecodeStep(compiled=True),
    "compile+cuda-graphs": DecodeStep(compiled=True, graphs=True),
}
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


def mode_row(conversation, logits, prefix, step: DecodeStep, tokens, device, save, profiled=8):
    """One mode: a warm-up answer (compiles, captures), a timed answer, then the slopes of syncs and
    of launches per token over answers of at most `profiled` tokens; `save(row)` after each figure.
    One kernel tally covers all of it, the warm-up and capture included. A failure of the launch
    count (the profiler) is recorded in the row; the figures before it stay."""
    generator = Generator(conversation, (), step)  # the engine's: nothing wrapped, one per session
    with kernel_tally() as tally:
        conversation.truncate(prefix)
        _answer(generator, logits, tokens)  # compiles, captures, warms up
        conversation.truncate(prefix)
        sync(device)
        t0 = time.perf_counter()
        answer = _answer(generator, logits, tokens)
        sync(device)
        seconds = time.perf_counter() - t0
        row = {"tokens_per_s": (len(answer) - 1) / seconds, "answer": answer}
        row["fallbacks"] = sorted(tally.fallbacks)
        save(row)
        short = min(tokens, profiled)
        row["syncs_per_token"] = _slope(generator, logits, prefix, short, device, _syncs)
        row["fallbacks"] = sorted(tally.fallbacks)
        save(row)
        try:
            launches = _slope(generator, logits, prefix, short, device, _launches)
            row["launches_per_token"] = launches
        except Exception as exc:  # noqa: BLE001 - the profiler failing loses only its own figure
            row["launches_error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["fallbacks"] = sorted(tally.fallbacks)
    save(row)
    return row


def compare_modes(conversation, prefix: int, rows: list[dict], dtype: torch.dtype) -> dict:
    """Every mode that ran beside eager, teacher-forced on eager's answer: its logits against
    eager's at every step (`decode_compare`), keyed by mode."""
    ran = {r["mode"]: r for r in rows if "answer" in r}
    if "eager" not in ran:
        return {}
    tokens = ran["eager"]["answer"][:-1] or ran["eager"]["answer"]
    layers = conversation.model.config.num_hidden_layers
    eager = forced_logits(conversation, prefix, tokens, None)
    out = {}
    for name in ran:
        if name != "eager":
            other = forced_logits(conversation, prefix, tokens, MODES[name])
            out[name] = compare(eager, other, bound(layers, dtype))
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


def bench(args, rows: Rows) -> None:
    """Every mode in turn, each row saved as its figures come."""
    device = torch.device(args.device)
    runnable = [m for m in args.modes if device.type == "cuda" or not MODES[m].graphs]
    for name in args.modes:
        if name not in runnable:
            rows.add({"mode": name, "skipped": "CUDA graphs need a GPU"})
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
    prefix = conversation.position
    for name in runnable:
        row = rows.add({"mode": name})

        def save(figures: dict, row=row) -> None:
            row.update(figures)
            rows.save(fallbacks=sorted({f for r in rows.rows for f in r.get("fallbacks", [])}))

        mode_row(conversation, logits, prefix, MODES[name], args.new_tokens, device, save,
                 args.profile_tokens)  # fmt: skip
        print({k: v for k, v in row.items() if k != "answer"}, flush=True)
    comparison = compare_modes(conversation, prefix, rows.rows, dtype)
    rows.save(comparison=comparison)
    for name, c in comparison.items():
        state = "ok" if c["ok"] else "FAILED"
        print(f"{name} vs eager, teacher-forced: logits differ by at most "
              f"{c['max_relative_logits_difference']:.2e} of their RMS over {c['steps']} steps "
              f"(bound {c['bound']:.2e}): {state}", flush=True)  # fmt: skip


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
    return 0 if all(c["ok"] for c in rows.extra.get("comparison", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
