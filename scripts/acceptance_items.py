"""What the acceptance run runs: the first command's items, in the order of what matters most on a
short GPU rental, and the second command's, with their time limits and the files each writes.

First (`--first`, 7 minutes on one H100, its items' limits adding up to that): versions and
device; the attention kernels checked at 7B shapes on every path the engine runs (output and lse
against float64); the 60-minute chat (peak allocated and reserved memory beside the plan, time to
first token, the kv mode `auto` chose and the memory it saw); eager and CUDA-graph decoding on one
build, teacher-forced and compared at every step, with tokens/s of both; LV-XAttn's block forward
and backward at 7B shapes. Second (`--second`, 7 minutes a call, each item fitting in that, going
on with `--after`): the 10-minute chat, the compiled decode (and with CUDA graphs) beside eager on
one build, the CUDA-marked tests, Llama-3.2-Vision's kernels and memory plan at 11B shapes, the
kernels at every registered family's published cross-layer shapes (`Family.published`),
finetuning, the demo and ingest (they decode video: decord and
PyAV), and on 2+ GPUs NCCL, the group's static decode step against its eager loop (teacher-forced,
compared as the first command compares one GPU's) and the ring/gather crossover. `--rehearse` gives
the same items at small shapes on a CPU. The CPU-only adapter checks run in CI, never in GPU
time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAT_MINUTES = (10, 60)  # the video lengths of the chat: the second command's, the first's
BUDGET_S = 420  # a command's default budget (one device call): the first's limits add up to it
PROFILE_TOKENS = 8  # the longest answer a decode item's sync and launch counts profile
REHEARSAL_SCALE = 100  # a rehearsal's video is this many times shorter
INGEST_SEGMENT_S = 10  # seconds of the ingest item's test video encoded (1080p: a few seconds)
REHEARSAL_GPUS = 2  # CPU ranks standing in for GPUs (the NCCL item runs over gloo)
LVX_CLI = ("-m", "lvx_app.cli")  # how a child runs the `lvx` command (the checkout's own)


@dataclass
class Item:
    """One check: a command run from the repository root, or skipped with `skip` as the reason."""

    name: str
    command: list[str]
    timeout_s: int
    needs: tuple[str, ...] = ()  # optional packages this item cannot run without
    min_gpus: int = 1
    skip: str | None = None
    pytest: bool = False  # read pytest's summary counts from its output
    writes: tuple[str, ...] = ()  # the files it writes under --out
    key: str | None = None  # its figures' entry in the first file it writes, when it shares it
    compiler: bool = False  # needs a C compiler (torch.compile)
    if_time_left: bool = False  # runs only when its whole limit is left in the budget
    reports_machine: bool = False  # its output's last line is the machine's JSON (versions.py)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _pytest(*args: str) -> list[str]:
    return _py("-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *args)


def cuda_test_files() -> list[str]:
    """The test files that carry CUDA marks: only these are collected, so no other file's optional
    imports can stop the CUDA tests."""
    files = (ROOT / "tests").glob("test_*.py")
    return sorted(str(p.relative_to(ROOT)) for p in files if "mark.cuda" in p.read_text())


def _decode(modes: list[str], out: Path, rehearse: bool, name: str, **kw) -> Item:
    """Decoding in `modes` on one build (one process, file and limit): tok/s, syncs and launches
    per token at 10 minutes of video, beside the plan; with eager and another mode, the two
    teacher-forced and compared at every step."""
    shape = ["--device", "cpu", "--minutes", "0.1", "--new-tokens", "8"]
    args = shape if rehearse else ["--device", "cuda", "--minutes", str(CHAT_MINUTES[0])]
    command = _py("scripts/bench_decode.py", *args, "--profile-tokens", str(PROFILE_TOKENS),
                  "--modes", *modes, "--out", str(out / name))  # fmt: skip
    title = f"decode: {' vs '.join(modes)}, one build"
    return Item(title, command, kw.pop("timeout_s", 150), writes=(name,), **kw)


def _chat(out: Path, rehearse: bool, minutes: tuple[int, ...], name: str, timeout_s: int) -> Item:
    device = ["--device", "cpu" if rehearse else "cuda"]
    args = ["--shape", "small", "--new-tokens", "4"] if rehearse else []
    scale = REHEARSAL_SCALE if rehearse else 1
    lengths = [f"{m / scale:g}" for m in minutes]
    return Item(
        f"chat: TTFT, prefill and memory at {' and '.join(lengths)} min",
        _py("scripts/bench_chat_7b.py", *device, *args, "--minutes", *lengths,
            "--out", str(out / name)),
        timeout_s, writes=(name,),
    )  # fmt: skip


def first_items(out: Path, scratch: Path, rehearse: bool = False) -> list[Item]:
    """The first command's items, most important first (the module's docstring); their limits
    add up to `BUDGET_S`."""
    device = ["--device", "cpu" if rehearse else "cuda"]
    check = ["--frames", "2", "--rows", "32", "--prefix", "256"] if rehearse else []
    block = ["--frames", "16", "--iters", "1", "--warmup", "1"] if rehearse else []
    kernels = str(out / "kernels_7b.json")
    return [
        Item("versions and device", _py("scripts/versions.py"), 30, reports_machine=True),
        Item(
            "kernels at 7B shapes vs float64, every engine path (output, lse)",
            _py("scripts/check_kernels.py", *device, *check, "--out", kernels, "--out-key",
                "checks"),
            80, writes=("kernels_7b.json",), key="checks",
        ),
        _chat(out, rehearse, CHAT_MINUTES[1:], "chat_7b.json", 150),
        _decode(["eager", "cuda-graphs"], out, rehearse, "decode.json", timeout_s=110),
        Item(
            "LV-XAttn block forward and backward at 7B shapes",
            _py("scripts/bench_xattn_7b.py", *device, *block, "--out", kernels, "--out-key",
                "lv_xattn"),
            50, writes=("kernels_7b.json",), key="lv_xattn",
        ),
    ]  # fmt: skip


def _group_decode(torchrun: list[str], out: Path, rehearse: bool, gloo: str) -> Item:
    """The group's static decode step against its eager loop on every rank, one build per rank
    (`scripts/group_decode_compare.py`), its figures beside the compiled decode's."""
    shape = ["--device", "cpu", "--minutes", "0.1", "--new-tokens", "8"]
    args = shape if rehearse else ["--device", "cuda", "--minutes", str(CHAT_MINUTES[0])]
    return Item(
        f"group decode: static step vs eager, teacher-forced{gloo}",
        [*torchrun, "scripts/group_decode_compare.py", *args,
         "--out", str(out / "decode_compile.json"), "--out-key", "group"],
        170, min_gpus=2, writes=("decode_compile.json",), key="group",
    )  # fmt: skip


def _family_shapes(out: Path, device: list[str], rehearse: bool) -> Item:
    """The kernels at every registered family's published cross-layer shapes (read from the
    registry, so a family registered later is checked too)."""
    small = ["--frames", "2", "--rows", "16"] if rehearse else []
    return Item(
        "every family's published cross-layer shapes: kernels vs float64, planned memory",
        _py("scripts/check_family_shapes.py", *device, *small, "--out",
            str(out / "decode_compile.json"), "--out-key", "family_shapes"),
        120, writes=("decode_compile.json",), key="family_shapes",
    )  # fmt: skip


def second_items(out: Path, scratch: Path, gpus: int, rehearse: bool = False) -> list[Item]:
    """The second command's items: what the first leaves out; each fits `BUDGET_S`, so a run
    that its budget stopped goes on with `--after` in the next call."""
    device = ["--device", "cpu" if rehearse else "cuda"]
    finetune = ["--frames", "4", "--steps", "1"] if rehearse else []
    ingest = ["--minutes", "1", "--height", "360", "--workers", "1"] if rehearse else []
    # the test video: a short segment encoded on the CPU in seconds, stream-copied to its length
    segment = ["--segment-s", str(INGEST_SEGMENT_S)]
    ranks = ["--gpus", "0", "--ranks", "2"] if rehearse else ["--gpus", str(min(gpus, 2))]
    world = str(REHEARSAL_GPUS) if rehearse else str(min(gpus, 8))
    torchrun = _py("-m", "torch.distributed.run", f"--nproc-per-node={world}")
    calibrate = ["--rows", "8", "64", "--frames", "4", "--iters", "1"] if rehearse else device
    where = ["--calibration-file", str(out / "calibration.json")] if rehearse else []
    compile_skip = "compiling for a CPU says nothing of the GPU's" if rehearse else None
    gloo = " (gloo)" if rehearse else ""
    return [
        _chat(out, rehearse, CHAT_MINUTES[:1], "chat_7b_10min.json", 150),
        _decode(["eager", "compile", "compile+cuda-graphs"], out, rehearse, "decode_compile.json",
                timeout_s=400, compiler=True, skip=compile_skip),
        Item("cuda tests", _pytest("-m", "cuda", *cuda_test_files()), 240, pytest=True),
        Item(
            "Llama-3.2-Vision at 11B shapes: kernels vs float64, memory vs the plan",
            _py("scripts/check_mllama_11b.py", *device, *(["--small"] if rehearse else []),
                "--out", str(out / "decode_compile.json"), "--out-key", "mllama_11b"),
            180, writes=("decode_compile.json",), key="mllama_11b",
        ),
        _family_shapes(out, device, rehearse),
        Item(
            "bench_finetune",
            _py("scripts/bench_finetune.py", *device, *finetune, "--out",
                str(out / "bench_finetune.json")),
            300, writes=("bench_finetune.json",),
        ),
        Item(
            "lvx demo", _py(*LVX_CLI, "demo", *ranks, "--workdir", str(scratch / "demo")), 300,
            needs=("decord", "av"),
        ),
        Item(
            "bench_ingest",
            _py("scripts/bench_ingest.py", *device, *(ingest or ["--minutes", "10"]), *segment,
                "--video-dir", str(scratch / "videos"), "--out", str(out / "bench_ingest.json")),
            420, needs=("decord", "av"), writes=("bench_ingest.json",),
        ),
        Item(
            f"nccl lv_xattn + decode_xattn{gloo}",
            [*torchrun, "scripts/nccl_check.py", *(["--cpu"] if rehearse else [])], 180,
            min_gpus=2,
        ),
        _group_decode(torchrun, out, rehearse, gloo),
        Item(
            f"ring/gather crossover calibrated{gloo}",
            [*torchrun, "scripts/bench_schedule.py", "--calibrate", *calibrate, *where,
             "--out", str(out / "bench_schedule.json")],
            180, min_gpus=2, writes=("bench_schedule.json",),
        ),
    ]  # fmt: skip


def select(items: list[Item], only: str) -> None:
    """`--only a,b`: mark every item whose name contains none of the words as skipped."""
    words = [w.strip() for w in only.split(",") if w.strip()]
    for item in items:
        if words and not any(w in item.name for w in words):
            item.skip = f"not selected (--only {only})"
