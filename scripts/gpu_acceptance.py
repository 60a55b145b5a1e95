"""The first run on a new GPU machine: one command that tries every CUDA path and writes one report.

    python scripts/gpu_acceptance.py [--out runs/gpu_acceptance] [--budget-min 45]

Runs, each in its own process with its own time limit, never stopping at a failure: the CUDA-marked
tests, the fake-tensor adapter tests, bench_xattn / bench_chat (10, 30, 60 min, one item each) /
bench_ingest / bench_finetune on cuda, the NCCL check of lv_xattn and decode_xattn against one
process (2+ GPUs), and `lvx demo` on the GPU (bf16, the GPU default; 2 ranks when 2 GPUs are
visible). `--only demo,nccl` runs the items whose names contain one of the words (for machines that
limit one command's time; the others are listed as skipped). It writes `acceptance.json` and
`acceptance.md` (per item: passed, failed with one line, or skipped with the reason) plus each
benchmark's own JSON, and puts bench_chat's measured TTFT, tokens/s and peak memory beside
`scripts/plan_gpu.py`'s projection. It installs nothing: missing packages (decord, PyAV, flash-attn)
are named in the report and the items that need them are skipped. Without CUDA it says so in one
line and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 1
CHAT_MINUTES = (10, 30, 60)
# import name -> how to install it; lvx depends on the first two, but GPU images often lack them
OPTIONAL = {
    "decord": "pip install "
              "decord", "av": "pip install "
                                          "av", "flash_attn": "pip install flash-attn "
                                                                          "--no-build-isolation",
}  # fmt: skip


@dataclass
class Item:
    """One check: a command run from the repository root, or skipped with `skip` as the reason."""

    name: str
    command: list[str]
    timeout_s: int
    needs: tuple[str, ...] = ()  # optional packages this item cannot run without
    min_gpus: int = 1
    skip: str | None = None


@dataclass
class Result:
    name: str
    status: str  # passed | failed | skipped
    reason: str  # one line: why it failed or was skipped; "" when it passed
    seconds: float
    command: str
    tail: str = ""  # last lines of its output, for a failure


@dataclass
class Report:
    schema: int
    started: str
    machine: dict
    budget_s: int
    missing: dict[str, str]
    results: list[Result] = field(default_factory=list)
    comparison: list[dict] = field(default_factory=list)  # measured vs projected (bench_chat)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def default_items(out: Path, gpus: int) -> list[Item]:
    """Every item, in the order they run (quick ones first, so a short budget still covers the most
    ground)."""
    return [
        Item(
            "cuda tests",
            _py("-m", "pytest", "-q", "-m", "cuda", "tests/", "-p", "no:cacheprovider"),
            600,
        ),
        Item(
            "fake-tensor adapter tests",
            _py("-m", "pytest", "-q", "tests/test_cuda_fake.py", "-p", "no:cacheprovider"),
            120,
        ),
        Item(
            "lvx demo (bf16 on GPU)",
            _py(
                "-m",
                "lvx_app.cli",
                "demo",
                "--gpus",
                str(min(gpus, 2)),
                "--workdir",
                str(out / "demo"),
            ),
            600,
            needs=("decord", "av"),
        ),
        Item(
            "nccl lv_xattn + decode_xattn",
            _py(
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={min(gpus, 8)}",
                "scripts/nccl_check.py",
            ),
            300,
            min_gpus=2,
        ),
        Item(
            "bench_xattn --device cuda",
            _py(
                "scripts/bench_xattn.py", "--device", "cuda", "--out", str(out / "bench_xattn.json")
            ),
            600,
        ),
        *(
            Item(
                f"bench_chat --mode model {m} min",
                _py(
                    "scripts/bench_chat.py",
                    "--mode",
                    "model",
                    "--device",
                    "cuda",
                    "--minutes",
                    str(m),
                    "--out",
                    str(out / f"bench_chat_{m}min.json"),
                ),
                600,
            )
            for m in CHAT_MINUTES
        ),  # one item each: the plan expects 60 min not to fit one 80 GB GPU
        Item(
            "bench_ingest --device cuda",
            _py(
                "scripts/bench_ingest.py",
                "--device",
                "cuda",
                "--out",
                str(out / "bench_ingest.json"),
            ),
            900,
            needs=("decord", "av"),
        ),
        Item(
            "bench_finetune --device cuda",
            _py(
                "scripts/bench_finetune.py",
                "--device",
                "cuda",
                "--out",
                str(out / "bench_finetune.json"),
            ),
            900,
        ),
    ]


def select(items: list[Item], only: str) -> None:
    """`--only a,b`: mark every item whose name contains none of the words as skipped."""
    words = [w.strip() for w in only.split(",") if w.strip()]
    for item in items:
        if words and not any(w in item.name for w in words):
            item.skip = f"not selected (--only {only})"


def missing_packages() -> dict[str, str]:
    """Optional packages that are not installed, with the command that installs each."""
    return {name: how for name, how in OPTIONAL.items() if importlib.util.find_spec(name) is None}


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no output")[:300]


def run_command(item: Item, timeout_s: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, combined output)."""
    try:
        proc = subprocess.run(
            item.command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
        return None, out.decode(errors="replace") if isinstance(out, bytes) else out
    except OSError as exc:
        return 1, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def run_items(
    items: list[Item],
    budget_s: float,
    gpus: int,
    missing: dict[str, str],
    runner: Callable[[Item, float], tuple[int | None, str]] = run_command,
) -> list[Result]:
    """Run every item within `budget_s` in total; a failure or timeout is recorded and the next item
    runs."""
    results, spent = [], 0.0
    for item in items:
        command = " ".join(item.command)
        lacking = [m for m in item.needs if m in missing]
        reason = item.skip or (
            f"needs {item.min_gpus}+ GPUs, {gpus} visible" if gpus < item.min_gpus else None
        )
        reason = reason or (
            f"{', '.join(lacking)} not installed ({'; '.join(missing[m] for m in lacking)})"
            if lacking
            else None
        )
        left = budget_s - spent
        reason = reason or (f"time budget spent ({budget_s / 60:.0f} min)" if left < 30 else None)
        if reason:
            results.append(Result(item.name, "skipped", reason, 0.0, command))
            continue
        t0 = time.monotonic()
        code, output = runner(item, min(item.timeout_s, left))
        seconds = time.monotonic() - t0
        spent += seconds
        if code == 0:
            results.append(Result(item.name, "passed", "", round(seconds, 1), command))
        else:
            why = (
                f"timed out after {seconds:.0f} s"
                if code is None
                else f"exit {code}: {_one_line(output)}"
            )
            tail = "\n".join(output.strip().splitlines()[-20:])
            results.append(Result(item.name, "failed", why, round(seconds, 1), command, tail))
    return results


def compare_chat(out: Path) -> list[dict]:
    """bench_chat's measured TTFT, tokens/s and peak memory beside the plan's projection for the
    same video."""
    found = [out / f"bench_chat_{m}min.json" for m in CHAT_MINUTES]
    rows_in = [
        row for path in found if path.exists() for row in json.loads(path.read_text())["rows"]
    ]
    if not rows_in:
        return []
    sys.path.insert(0, str(ROOT))
    from memory_plan import Workload, memory_plan, time_plan

    from lvx_models.mplug_owl3.config import Owl3Config

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


def markdown(report: Report) -> str:
    """The summary a person reads: machine, missing packages, one row per item, measured vs
    projected."""
    lines = [
        f"# GPU acceptance, {report.started}",
        "",
        f"Machine: {report.machine}",
        "",
        f"Time budget: {report.budget_s / 60:.0f} min",
        "",
    ]
    if report.missing:
        lines += [
            "Not installed (items needing them are skipped): "
            + "; ".join(f"{k} ({v})" for k, v in report.missing.items()),
            "",
        ]
    lines += ["| item | status | s | reason |", "|---|---|---|---|"]
    lines += [
        f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.reason.replace('|', '/')} |"
        for r in report.results
    ]
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


def write_report(report: Report, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "acceptance.json", out / "acceptance.md"
    js.write_text(json.dumps(asdict(report), indent=2))
    md.write_text(markdown(report))
    return js, md


def machine() -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_acceptance")
    parser.add_argument(
        "--budget-min", type=float, default=45.0, help="total time for all items (default 45)"
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated words: run only the items whose names contain one",
    )
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_acceptance: no CUDA device visible here, nothing to accept; run this on the GPU "
            "machine."
        )
        return 0
    gpus, missing, budget = torch.cuda.device_count(), missing_packages(), int(args.budget_min * 60)
    items = default_items(args.out.resolve(), gpus)
    select(items, args.only)
    print(
        f"gpu_acceptance: {len(items)} items on {gpus} GPU(s), time budget {budget / 60:.0f} min, "
        f"report in {args.out}"
    )
    for name, how in missing.items():
        print(f"  not installed: {name} ({how})")
    report = Report(
        SCHEMA, datetime.now(timezone.utc).isoformat(timespec="seconds"), machine(), budget, missing
    )
    report.results = run_items(items, budget, gpus, missing)
    report.comparison = compare_chat(args.out)
    js, md = write_report(report, args.out)
    for r in report.results:
        print(f"  {r.status:7s} {r.name}" + (f": {r.reason}" if r.reason else ""))
    for row in report.comparison:
        print("  measured vs projected: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()))
    print(f"wrote {js} and {md}: please send us {js.name}")
    return 0 if all(r.status != "failed" for r in report.results) else 1


if __name__ == "__main__":
    sys.exit(main())
