"""The first run on a GPU machine: every CUDA path, in parts of under 9 minutes each, with one
report that is rewritten after every item.

    # 1: CUDA tests, adapter checks, bench_xattn, bench_chat at 10 min
    python scripts/gpu_acceptance.py --part 1 --out DIR
    # 2: bench_chat at 30 and 60 min
    python scripts/gpu_acceptance.py --part 2 --out DIR
    # 3: bench_finetune; lvx demo and bench_ingest (need decord and PyAV); NCCL and the ring/gather
    # crossover calibrated for the engine (2+ GPUs)
    python scripts/gpu_acceptance.py --part 3 --out DIR
    # 4: decoding: syncs and launches per token, tok/s eager, with CUDA graphs and compiled, next
    # to the plan
    python scripts/gpu_acceptance.py --part 4 --out DIR
    # the same harness on CPU at small shapes
    python scripts/gpu_acceptance.py --rehearse --out DIR

Point `--out` at the folder that is kept after the command: everything goes there, and nothing else
is written outside a temporary folder. `acceptance.json` and `acceptance.md` list every item
(pending, running, passed, failed with one line, skipped with the reason; the last lines of its
output, pytest's counts, and every attention-kernel fallback a benchmark recorded) and are replaced
atomically after each item, so a run killed at any point leaves a valid report of what it reached;
`acceptance.log` holds every item's whole output as it is written. Each item runs in its own process
group within its own time limit and the total `--budget-min` (default 9); an item that fails, hangs
or crashes is recorded and the next one runs. Without `--part` every item runs in turn until the
budget is spent.

The checkout need not be installed: when `lvx_models` does not import, the harness links the
checkout's packages into a temporary folder on every child's PYTHONPATH. It installs nothing: a
missing decord, PyAV or flash-attn is named in the report and the items that need it are skipped.

`--rehearse` runs the same items, parts and report on CPU at small shapes, in children that see
neither gradio, gradio_client, playwright, PyAV, decord nor flash-attn, nor an installed lvx (as on
a bare GPU image); two CPU ranks stand in for two GPUs. Without CUDA and without `--rehearse` it
says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 2
CHAT_MINUTES = {1: (10,), 2: (30, 60)}  # part -> video lengths of bench_chat --mode model
LVX_CLI = ("-m", "lvx_app.cli")  # how a child runs the `lvx` command (the checkout's own)
PACKAGES = {"lvx_app": "lvx_app", "lvx_models": "models", "lvx_ui": "ui"}  # import name -> folder
WHEELS = "bring the wheel and install it to a folder on PYTHONPATH (README, 'On a GPU machine')"
OPTIONAL = {  # import name -> what to do when it is missing
    "decord": WHEELS,
    "av": WHEELS,
    "flash_attn": "optional: the aten kernels run without it",
}
HIDDEN_IN_REHEARSAL = ("gradio", "gradio_client", "playwright", "av", "decord", "flash_attn")
REHEARSAL_GPUS = 2  # CPU ranks standing in for GPUs (the NCCL item runs over gloo)
TAIL_LINES = 40
LOG_TAIL_BYTES = 64 * 1024


@dataclass
class Item:
    """One check: a command run from the repository root, or skipped with `skip` as the reason."""

    name: str
    command: list[str]
    timeout_s: int
    part: int = 1
    needs: tuple[str, ...] = ()  # optional packages this item cannot run without
    min_gpus: int = 1
    skip: str | None = None
    pytest: bool = False  # read pytest's summary counts from its output
    writes: tuple[str, ...] = ()  # files it writes under --out (a benchmark's JSON first)


@dataclass
class Result:
    name: str
    status: str  # pending | running | passed | failed | skipped
    reason: str  # one line: why it failed or was skipped, or what a passed item should flag
    seconds: float
    command: str
    tail: str = ""  # the last lines of its output, passed or not
    counts: dict[str, int] = field(default_factory=dict)  # pytest's: passed, skipped, ...
    fallbacks: list[str] = field(default_factory=list)  # attention kernels that fell back


@dataclass
class Report:
    schema: int
    started: str
    mode: str  # "gpu" or "rehearsal"
    part: str  # "1", "2", "3" or "all"
    machine: dict
    budget_s: int
    missing: dict[str, str]
    checkout: str  # how the children import lvx
    results: list[Result] = field(default_factory=list)
    comparison: list[dict] = field(default_factory=list)  # measured vs projected (bench_chat)
    notes: list[str] = field(default_factory=list)
    updated: str = ""
    finished: bool = False  # False: the run was stopped, or is still going


class Stopped(BaseException):
    """The acceptance run itself was sent a signal (a command limit ran out)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame) -> None:
    raise Stopped(signum)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _pytest(*args: str) -> list[str]:
    return _py("-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *args)


def cuda_test_files() -> list[str]:
    """The test files that carry CUDA marks: only these are collected, so no other file's optional
    imports can stop the CUDA tests."""
    files = (ROOT / "tests").glob("test_*.py")
    return sorted(str(p.relative_to(ROOT)) for p in files if "mark.cuda" in p.read_text())


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _bench_chat(minutes: int, part: int, out: Path, rehearse: bool) -> Item:
    """bench_chat --mode model at one video length (one item each, so that one length running out of
    memory or time leaves the others' figures); the plan projects every length to fit one 80 GB GPU
    (about 57 GB at 60 minutes)."""
    name = f"bench_chat_{minutes}min.json"
    shape = ["--device", "cpu", "--shape", "small", "--minutes", f"{minutes / 100:g}"]
    shape += ["--new-tokens", "4"]
    args = shape if rehearse else ["--device", "cuda", "--minutes", str(minutes)]
    command = _py("scripts/bench_chat.py", "--mode", "model", *args, "--out", str(out / name))
    return Item(f"bench_chat --mode model {minutes} min", command, 300, part, writes=(name,))


def part_one(out: Path, rehearse: bool) -> list[Item]:
    """CUDA tests, the adapters against fake CUDA tensors and stand-ins, the kernel benchmark and a
    10-minute chat: the items that say most about the CUDA code first."""
    xattn = ["--kernels", "--device", "cpu", "--cuda-frames", "16", "--iters", "2"]
    xattn = xattn if rehearse else ["--device", "cuda"]
    return [
        Item("cuda tests", _pytest("-m", "cuda", *cuda_test_files()), 240, pytest=True),
        Item(
            "adapter checks (fake CUDA tensors, CPU stand-ins)",
            _pytest("tests/test_cuda_fake.py", "tests/test_cuda_adapters_cpu.py"),
            180,
            pytest=True,
        ),
        Item(
            "bench_xattn kernels",
            _py("scripts/bench_xattn.py", *xattn, "--out", str(out / "bench_xattn.json")),
            240,
            writes=("bench_xattn.json",),
        ),
        *(_bench_chat(m, 1, out, rehearse) for m in CHAT_MINUTES[1]),
    ]


def part_three(out: Path, scratch: Path, gpus: int, rehearse: bool) -> list[Item]:
    """Finetuning, the demo and ingest (they decode video: decord and PyAV), and NCCL."""
    device = ["--device", "cpu" if rehearse else "cuda"]
    finetune = ["--frames", "4", "--steps", "1"] if rehearse else []
    ingest = ["--minutes", "1", "--height", "360", "--workers", "1"] if rehearse else []
    ingest = ingest or ["--minutes", "10"]  # 10 of the default 60 minutes: it fits the part
    ranks = ["--gpus", "0", "--ranks", "2"] if rehearse else ["--gpus", str(min(gpus, 2))]
    nccl = str(REHEARSAL_GPUS) if rehearse else str(min(gpus, 8))
    return [
        Item(
            "bench_finetune",
            _py("scripts/bench_finetune.py", *device, *finetune)
            + ["--out", str(out / "bench_finetune.json")],
            300,
            3,
            writes=("bench_finetune.json",),
        ),
        Item(
            "lvx demo" + ("" if rehearse else " (bf16 on GPU)"),
            _py(*LVX_CLI, "demo", *ranks, "--workdir", str(scratch / "demo")),
            300,
            3,
            needs=("decord", "av"),
        ),
        Item(
            "bench_ingest",
            _py("scripts/bench_ingest.py", *device, *ingest)
            + ["--video-dir", str(scratch / "videos"), "--out", str(out / "bench_ingest.json")],
            420,
            3,
            needs=("decord", "av"),
            writes=("bench_ingest.json",),
        ),
        Item(
            "nccl lv_xattn + decode_xattn" + (" (gloo)" if rehearse else ""),
            _py("-m", "torch.distributed.run", f"--nproc-per-node={nccl}", "scripts/nccl_check.py")
            + (["--cpu"] if rehearse else []),
            180,
            3,
            min_gpus=2,
        ),
        _calibrate(out, nccl, rehearse),
    ]


def _calibrate(out: Path, ranks: str, rehearse: bool) -> Item:
    """The ring-or-gather crossover measured on this machine's GPUs (NCCL) and written to its
    calibration file, which the engine reads at start; the rehearsal writes it under --out."""
    shape = ["--rows", "8", "64", "--frames", "4", "--iters", "1"] if rehearse else []
    where = ["--calibration-file", str(out / "calibration.json")] if rehearse else []
    run = _py(
        "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "scripts/bench_schedule.py"
    )
    return Item(
        "ring/gather crossover calibrated" + (" (gloo)" if rehearse else ""),
        run
        + ([] if rehearse else ["--device", "cuda"])
        + ["--calibrate", *shape, *where, "--out", str(out / "bench_schedule.json")],
        180,
        3,
        min_gpus=2,
        writes=("bench_schedule.json",),
    )


def part_four(out: Path, rehearse: bool) -> list[Item]:
    """Decoding on one GPU: host syncs per token (`torch.cuda.set_sync_debug_mode`), launches per
    token (the profiler) and tokens/s, eager, with CUDA graphs, compiled and both, next to the
    plan's projection (bench_decode.py)."""
    shape = ["--device", "cpu", "--minutes", "0.1", "--new-tokens", "8", "--modes", "eager"]
    args = shape if rehearse else ["--device", "cuda", "--minutes", "10"]
    command = _py("scripts/bench_decode.py", *args, "--out", str(out / "bench_decode.json"))
    return [
        Item("bench_decode syncs, launches, tok/s", command, 480, 4, writes=("bench_decode.json",))
    ]


def default_items(out: Path, scratch: Path, gpus: int, rehearse: bool = False) -> list[Item]:
    """Every item of every part, in the order they run (per part: the quick ones first)."""
    return [
        *part_one(out, rehearse),
        *(_bench_chat(m, 2, out, rehearse) for m in CHAT_MINUTES[2]),
        *part_three(out, scratch, gpus, rehearse),
        *part_four(out, rehearse),
    ]


def select(items: list[Item], only: str) -> None:
    """`--only a,b`: mark every item whose name contains none of the words as skipped."""
    words = [w.strip() for w in only.split(",") if w.strip()]
    for item in items:
        if words and not any(w in item.name for w in words):
            item.skip = f"not selected (--only {only})"


def of_part(items: list[Item], part: str) -> list[Item]:
    """The items of `--part N` ("all": every item)."""
    return items if part == "all" else [i for i in items if str(i.part) == part]


# ----------------------------------------------------------------------------- the children's
# environment

BARE_IMAGE = '''"""gpu_acceptance --rehearse: this interpreter sees neither the packages a bare
GPU image lacks nor an installed lvx."""
import sys
from importlib.machinery import PathFinder

HIDDEN = {hidden!r}


def _name(dist):
    return (dist.metadata["Name"] or "").lower().replace("-", "_")


class _BareImage:
    """PathFinder, blind to the hidden packages' modules and distributions."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        found = PathFinder.find_distributions(*args, **kwargs)
        return (d for d in found if _name(d) not in HIDDEN)

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()


sys.meta_path[:] = [
    _BareImage if finder is PathFinder else finder
    for finder in sys.meta_path
    if not getattr(finder, "__module__", "").startswith("__editable__")
]
'''


def _with_path(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` with `folder` first on PYTHONPATH."""
    paths = [str(folder), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def child_env(rehearse: bool, scratch: Path) -> dict[str, str]:
    """The items' environment: unbuffered output; in a rehearsal, no CUDA and a `sitecustomize` that
    hides what a bare GPU image lacks (and the installed lvx)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not rehearse:
        return env
    bare = scratch / "bare-image"
    bare.mkdir(parents=True, exist_ok=True)
    (bare / "sitecustomize.py").write_text(BARE_IMAGE.format(hidden=HIDDEN_IN_REHEARSAL))
    return _with_path({**env, "CUDA_VISIBLE_DEVICES": ""}, bare)


def probe(env: dict[str, str]) -> dict[str, bool]:
    """Which optional packages and lvx import names a child finds (from the repository root)."""
    code = (
        "import importlib.util as u, json, sys; "
        "print(json.dumps({n: u.find_spec(n) is not None for n in sys.argv[1:]}))"
    )
    names = [*OPTIONAL, *PACKAGES]
    done = subprocess.run(
        _py("-c", code, *names), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise SystemExit(f"gpu_acceptance: {sys.executable} cannot run: {_one_line(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def importable(env: dict[str, str], scratch: Path) -> tuple[dict[str, str], str, dict]:
    """(env in which the children import lvx, how, what they find). An installed lvx is used as it
    is; otherwise the checkout's packages are linked under their import names into a folder put
    first on PYTHONPATH (and on this process's path)."""
    found = probe(env)
    if all(found[name] for name in PACKAGES):
        return env, "installed", found
    site = scratch / "site"
    site.mkdir(parents=True, exist_ok=True)
    for name, folder in PACKAGES.items():
        (site / name).symlink_to(ROOT / folder, target_is_directory=True)
    env = _with_path(env, site)
    found = probe(env)
    if not all(found[name] for name in PACKAGES):
        raise SystemExit(f"gpu_acceptance: the checkout at {ROOT} does not import from {site}")
    sys.path.insert(0, str(site))
    return env, f"not installed: the checkout's packages linked into {site}", found


# ----------------------------------------------------------------------------- running the items


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no output")[:300]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the item's whole process group (torchrun's ranks too), SIGKILL if it lingers."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def make_runner(env: dict[str, str], log: Path) -> Callable[[Item, float], tuple[int | None, str]]:
    """A runner that starts an item in its own session with its output appended to `log` as it
    comes, and returns (exit code or None on timeout, the end of that output)."""

    def run(item: Item, timeout_s: float) -> tuple[int | None, str]:
        with open(log, "ab") as sink:
            sink.write(f"\n===== {item.name}: {' '.join(item.command)}\n".encode())
            sink.flush()
            start = sink.tell()
            try:
                proc = subprocess.Popen(
                    item.command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                return 1, str(exc)
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        return code, _read_from(log, start)

    return run


def _read_from(log: Path, start: int) -> str:
    """The log from byte `start` on, at most its last LOG_TAIL_BYTES."""
    with open(log, "rb") as f:
        f.seek(max(start, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        return f.read().decode(errors="replace")


def run_command(item: Item, timeout_s: float) -> tuple[int | None, str]:
    """Run one item with this process's environment and a throw-away log."""
    with tempfile.TemporaryDirectory() as tmp:
        return make_runner({**os.environ, "PYTHONUNBUFFERED": "1"}, Path(tmp) / "log")(
            item, timeout_s
        )


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b")
_PLURAL = {"error": "errors", "warning": "warnings"}


def pytest_counts(output: str) -> dict[str, int]:
    """pytest's closing summary ("11 skipped, 77 deselected in 0.1s") as counts, plural keys."""
    for line in reversed(output.strip().splitlines()):
        found = _COUNT.findall(line)
        if found and " in " in line:
            return {_PLURAL.get(word, word): int(n) for n, word in found}
    return {}


def fallbacks_in(path: Path) -> list[str]:
    """The attention-kernel fallbacks a benchmark's JSON lists ("fallbacks"), if it wrote one."""
    try:
        return list(json.loads(path.read_text()).get("fallbacks", []))
    except (OSError, ValueError, AttributeError):
        return []


def _skip_reason(item: Item, gpus: int, missing: dict[str, str], left: float, budget_s: float):
    lacking = [m for m in item.needs if m in missing]
    if item.skip:
        return item.skip
    if gpus < item.min_gpus:
        return f"needs {item.min_gpus}+ GPUs, {gpus} visible"
    if lacking:
        hints = "; ".join(dict.fromkeys(missing[m] for m in lacking))
        return f"{', '.join(lacking)} not installed ({hints})"
    return f"time budget spent ({budget_s / 60:.0f} min)" if left < 30 else None


def _finish(item: Item, result: Result, code: int | None, output: str, out: Path | None) -> None:
    """Fill in a finished item's result from its exit code and output."""
    lines = output.strip().splitlines()
    result.tail = "\n".join(lines[-TAIL_LINES:])
    result.counts = pytest_counts(output) if item.pytest else {}
    if out is not None and item.writes:
        result.fallbacks = fallbacks_in(out / item.writes[0])
    if code == 0:
        result.status = "passed"
        n = len(result.fallbacks)
        result.reason = f"{n} attention-kernel fallback(s): {result.fallbacks[0]}" if n else ""
    else:
        result.status = "failed"
        result.reason = (
            f"timed out after {result.seconds:.0f} s"
            if code is None
            else f"exit {code}: {_one_line(output)}"
        )


def _run_one(item: Item, result: Result, runner: Callable, timeout_s: float, out: Path | None):
    """Run one item; a crash of the harness itself while running it fails only this item."""
    t0 = time.monotonic()
    try:
        code, output = runner(item, timeout_s)
    except (Stopped, KeyboardInterrupt) as exc:
        result.status, result.seconds = "failed", round(time.monotonic() - t0, 1)
        result.reason = f"stopped after {result.seconds:.0f} s: the acceptance run got {exc!r}"
        raise
    except Exception as exc:  # noqa: BLE001 - one item's crash must not stop the run
        code, output = 1, f"the harness failed running this item: {type(exc).__name__}: {exc}"
    result.seconds = round(time.monotonic() - t0, 1)
    _finish(item, result, code, output, out)


def _say(text: str) -> None:
    print(text, flush=True)


def run_items(
    items: list[Item],
    budget_s: float,
    gpus: int,
    missing: dict[str, str],
    runner: Callable[[Item, float], tuple[int | None, str]] = run_command,
    on_change: Callable[[list[Result]], None] = lambda results: None,
    out: Path | None = None,
) -> list[Result]:
    """Run every item within `budget_s` in total; a failure, timeout or crash is recorded and the
    next item runs. `on_change(results)` is called whenever a result changes (to save the report);
    `out` is where the items write their JSON."""
    results = [Result(i.name, "pending", "", 0.0, " ".join(i.command)) for i in items]
    on_change(results)
    spent = 0.0
    for n, (item, result) in enumerate(zip(items, results), 1):
        head = f"[{n}/{len(items)}] {item.name}"
        reason = _skip_reason(item, gpus, missing, budget_s - spent, budget_s)
        if reason:
            result.status, result.reason = "skipped", reason
            _say(f"{head}: skipped, {reason}")
            on_change(results)
            continue
        result.status = "running"
        on_change(results)
        _say(f"{head} ...")
        try:
            _run_one(item, result, runner, min(item.timeout_s, budget_s - spent), out)
        finally:
            spent += result.seconds
            on_change(results)
        counts = ", ".join(f"{v} {k}" for k, v in result.counts.items())
        _say(
            f"{head}: {result.status} in {result.seconds:.0f} s"
            + (f" ({counts})" if counts else "")
        )
        if result.reason:
            _say(f"    {result.reason}")
    return results


# ----------------------------------------------------------------------------- the report


def compare_chat(out: Path) -> list[dict]:
    """bench_chat's measured TTFT, tokens/s and peak memory beside the plan's projection for the
    same video (7B rows only: small-shape rows have no projection)."""
    found = sorted(out.glob("bench_chat_*min.json"), key=lambda p: int(p.stem.split("_")[-1][:-3]))
    rows_in = [
        row
        for path in found
        for row in json.loads(path.read_text())["rows"]
        if row.get("shape", "7b") == "7b"
    ]
    if not rows_in:
        return []
    sys.path.insert(0, str(ROOT))
    from lvx_models.mplug_owl3.config import Owl3Config
    from scripts.memory_plan import Workload, memory_plan, time_plan

    cfg, rows = Owl3Config(), []
    for row in rows_in:
        work = Workload(minutes=row["minutes"], answer_tokens=64)
        t = time_plan(cfg, work)
        rows.append(
            {
                "minutes": row["minutes"],
                "TTFT s measured": row["ttft_s"],
                "TTFT s projected": t["question prefill (TTFT)"]["seconds"],
                "tokens/s measured": row["tokens_per_s"],
                "tokens/s projected": t["tokens/s"],
                "peak GiB measured": row["peak_gib"],
                "peak GiB projected": memory_plan(cfg, work).peak / 2**30,
            }
        )
    return rows


def decode_note(out: Path) -> str | None:
    """bench_decode's syncs, launches and tokens/s per mode beside the plan's projection, as one
    note of the report (None when it did not run)."""
    path = out / "bench_decode.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    modes = [
        f"{r['mode']}: {r['skipped']}"
        if "skipped" in r
        else f"{r['mode']}: {r['syncs_per_token']:.2f} syncs, {r['launches_per_token']:.0f} "
        f"launches, {r['tokens_per_s']:.1f} tok/s"
        for r in data["rows"]
    ]
    plan = data["projected"]
    projected = f"{plan['attention_calls_per_token']} attention kernel calls per token"
    if plan["tokens_per_s"] is not None:
        projected += f", {plan['tokens_per_s']:.1f} tok/s"
    return (
        f"Decoding ({data['shape']}, {data['frames']} frames, per token): "
        + "; ".join(modes)
        + f". Planned: {projected}. Same answers in every mode: {data['same_answers']}."
    )


def _md_row(r: Result) -> str:
    counts = ", ".join(f"{v} {k}" for k, v in r.counts.items())
    why = "; ".join(x for x in (r.reason, counts) if x).replace("|", "/")
    return f"| {r.name} | {r.status} | {r.seconds:.0f} | {why} |"


def markdown(report: Report) -> str:
    """The summary a person reads: machine, missing packages, one row per item, every fallback,
    measured vs projected."""
    state = "finished" if report.finished else f"NOT FINISHED (last written {report.updated})"
    lines = [
        f"# GPU acceptance ({report.mode}, part {report.part}), {report.started}: {state}",
        "",
        f"Machine: {report.machine}",
        "",
        f"Time budget: {report.budget_s / 60:.0f} min. lvx: {report.checkout}.",
        "",
    ]
    if report.missing:
        missing = "; ".join(f"{k} ({v})" for k, v in report.missing.items())
        lines += [f"Not installed (items needing them are skipped): {missing}", ""]
    lines += ["| item | status | s | reason |", "|---|---|---|---|"]
    lines += [_md_row(r) for r in report.results]
    fell = [f"- {r.name}: {f}" for r in report.results for f in r.fallbacks]
    if fell:
        lines += ["", "Attention-kernel fallbacks (the figures are the fallback kernel's):", *fell]
    lines += [f"\n{note}" for note in report.notes]
    if report.comparison:
        keys = list(report.comparison[0])
        lines += [
            "",
            "Measured vs projected (`scripts/plan_gpu.py`), one GPU, resident visual K/V:",
            "",
            "| " + " | ".join(keys) + " |",
            "|" + "---|" * len(keys),
        ]
        lines += [
            "| " + " | ".join(f"{row[k]:.3g}" for k in keys) + " |" for row in report.comparison
        ]
    return "\n".join(lines) + "\n"


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` atomically: a reader (or a kill) sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(report: Report, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    report.updated = _now()
    js, md = out / "acceptance.json", out / "acceptance.md"
    _replace(js, json.dumps(asdict(report), indent=2))
    _replace(md, markdown(report))
    return js, md


def machine(rehearse: bool) -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info = {
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if rehearse:
        info["rehearsal"] = f"CPU, {REHEARSAL_GPUS} CPU ranks for GPUs, GPU image mimicked"
    return info


# ----------------------------------------------------------------------------- the command


def _saver(report: Report, out: Path) -> Callable[[list[Result]], None]:
    """Save the report with these results; a failed write is said, not fatal."""

    def save(results: list[Result]) -> None:
        report.results = results
        try:
            write_report(report, out)
        except OSError as exc:
            _say(f"gpu_acceptance: could not write the report in {out}: {exc}")

    return save


def _close(report: Report, out: Path) -> int:
    """The measured-vs-projected table, the finished report, the exit code."""
    try:
        report.comparison = compare_chat(out)
        report.notes += [n for n in (decode_note(out),) if n]
    except Exception as exc:  # noqa: BLE001 - the items' results matter more than this table
        report.notes.append(f"Measured vs projected not computed: {type(exc).__name__}: {exc}")
    report.finished = True
    js, md = write_report(report, out)
    for row in report.comparison:
        _say("  measured vs projected: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()))
    _say(f"wrote {js} and {md}: please send us the folder {out}")
    return 0 if all(r.status != "failed" for r in report.results) else 1


def accept(args: argparse.Namespace, out: Path, scratch: Path) -> int:
    """Run the selected items with the report written after each; `scratch` is temporary."""
    import torch

    env, checkout, found = importable(child_env(args.rehearse, scratch), scratch)
    missing = {name: how for name, how in OPTIONAL.items() if not found[name]}
    gpus = REHEARSAL_GPUS if args.rehearse else torch.cuda.device_count()
    items = of_part(default_items(out, scratch, gpus, args.rehearse), args.part)
    select(items, args.only)
    budget = int(args.budget_min * 60)
    mode = "rehearsal" if args.rehearse else "gpu"
    report = Report(
        SCHEMA, _now(), mode, args.part, machine(args.rehearse), budget, missing, checkout
    )
    log = out / "acceptance.log"
    log.write_bytes(b"")
    _say(
        f"gpu_acceptance ({mode}, part {args.part}): {len(items)} items, {gpus} GPU(s), time "
        f"budget {budget / 60:.0f} min, lvx {checkout}; report in {out}"
    )
    for name, how in missing.items():
        _say(f"  not installed: {name} ({how})")
    try:
        run_items(items, budget, gpus, missing, make_runner(env, log), _saver(report, out), out)
    except (Stopped, KeyboardInterrupt) as exc:
        report.notes.append(f"Stopped by {exc!r}: the items after the stopped one did not run.")
        _saver(report, out)(report.results)
        _say(f"gpu_acceptance: stopped ({exc!r}); the report in {out} lists what ran")
        return 128 + exc.signum if isinstance(exc, Stopped) else 130
    return _close(report, out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="the folder the report goes to (the kept one)"
    )
    parser.add_argument(
        "--part",
        choices=["1", "2", "3", "4", "all"],
        default="all",
        help="one preset (default: all)",
    )
    parser.add_argument(
        "--budget-min", type=float, default=9.0, help="total time for the items (default 9)"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated words: run only the items whose names hold one"
    )
    parser.add_argument(
        "--rehearse", action="store_true", help="run on CPU at small shapes, GPU image mimicked"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.rehearse and not torch.cuda.is_available():
        _say(
            "gpu_acceptance: no CUDA device visible here, nothing to accept; run this on the GPU "
            "machine (or --rehearse on CPU)."
        )
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_signal)
    scratch = Path(tempfile.mkdtemp(prefix="lvx-acceptance-"))
    try:
        return accept(args, out, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
