"""The first short GPU rental in one command: the figures that matter most first, each written to
the folder you name the moment it exists, with nothing left running afterwards.

    python3 scripts/gpu_acceptance.py --out DIR              # the first command (--first): 7 min
    python3 scripts/gpu_acceptance.py --second --out DIR2 --after DIR/acceptance.json  # 7 min again
    python3 scripts/gpu_acceptance.py --rehearse --out DIR   # the same on a CPU, small shapes

What each command runs, in order: scripts/acceptance_items.py (and docs/gpu.md). Everything goes to
`--out` (the caller's folder; nothing else is needed from the machine afterwards): the report
(`acceptance.json`, `acceptance.md`, rewritten after every change, and `acceptance.log`, every
item's whole output as it comes) and each item's figures. Each item runs in its own process group
under a guard (scripts/guard.py) within its own time limit and the whole command's `--budget-min`
(default 7; start-up and the ending of a stopped item included); an item
that fails, hangs or crashes is recorded and the next one runs. However the runner ends (SIGTERM,
SIGINT, its time limit, SIGKILL) the item running ends with it, and the report it leaves is valid.
`--second --after REPORT` runs only what REPORT (a first or a second command's) does not list as
passed, the first command's items among them first.

The checkout need not be installed (scripts/checkout.py links it for every child), and nothing
needs the network: a missing decord, PyAV or flash-attn is named in the report and the items that
need it are skipped. `--rehearse` runs the same items on CPU at small shapes, in children that see
neither gradio, gradio_client, playwright, PyAV, decord nor flash-attn, nor an installed lvx (as on
a bare GPU image); two CPU ranks stand in for two GPUs. Without CUDA and without `--rehearse` it
says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import scripts
from scripts.acceptance_items import (
    BUDGET_S,
    CHAT_MINUTES,
    REHEARSAL_GPUS,
    REHEARSAL_SCALE,
    ROOT,
    Item,
    first_items,
    second_items,
    select,
)  # fmt: skip
from scripts.acceptance_report import (
    SCHEMA,
    Report,
    Result,
    compare,
    finish,
    headlines,
    now,
    one_line,
    planned,
    write_report,
)  # fmt: skip
from scripts.checkout import PACKAGES, link_folder, with_path
from scripts.guard import PARENT_ENV
from scripts.op_signatures import mismatches
from scripts.versions import compiler

WHEELS = "bring the wheel and install it to a folder on PYTHONPATH (docs/gpu.md)"
OPTIONAL = {  # import name -> what to do when it is missing
    "decord": WHEELS,
    "av": WHEELS,
    "flash_attn": "optional: the aten kernels run without it",
}
HIDDEN_IN_REHEARSAL = ("gradio", "gradio_client", "playwright", "av", "decord", "flash_attn")
LOG_TAIL_BYTES = 64 * 1024
GUARD = str(ROOT / "scripts" / "guard.py")
GRACE_S = 15  # from SIGTERM to an item's group to SIGKILL (the guard's own grace is 10 s)


class Stopped(BaseException):
    """The acceptance run itself was sent a signal (a command limit ran out)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame) -> None:
    raise Stopped(signum)


def _say(text: str) -> None:
    print(text, flush=True)


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


def child_env(rehearse: bool, scratch: Path) -> dict[str, str]:
    """The items' environment: unbuffered output; in a rehearsal, no CUDA and a `sitecustomize` that
    hides what a bare GPU image lacks (and the installed lvx)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not rehearse:
        return env
    bare = scratch / "bare-image"
    bare.mkdir(parents=True, exist_ok=True)
    (bare / "sitecustomize.py").write_text(BARE_IMAGE.format(hidden=HIDDEN_IN_REHEARSAL))
    return with_path({**env, "CUDA_VISIBLE_DEVICES": ""}, bare)


def probe(env: dict[str, str]) -> dict[str, bool]:
    """Which optional packages and lvx import names a child finds (from outside the checkout)."""
    code = (
        "import importlib.util as u, json, sys; "
        "print(json.dumps({n: u.find_spec(n) is not None for n in sys.argv[1:]}))"
    )
    names = [*OPTIONAL, *PACKAGES]
    done = subprocess.run(
        [sys.executable, "-c", code, *names], cwd=tempfile.gettempdir(), env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"gpu_acceptance: {sys.executable} cannot run: {one_line(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def importable(env: dict[str, str], scratch: Path) -> tuple[dict[str, str], str, dict]:
    """(env in which the children import lvx, how, what they find). An installed lvx is used as it
    is; otherwise the checkout's packages are linked under their import names into a folder put
    first on the children's PYTHONPATH."""
    found = probe(env)
    if all(found[name] for name in PACKAGES):  # installed, or linked already for this runner
        return env, scripts.HOW_LVX_IMPORTS, found
    site = link_folder(scratch / "site")
    env = with_path(env, site)
    found = probe(env)
    if not all(found[name] for name in PACKAGES):
        raise SystemExit(f"gpu_acceptance: the checkout at {ROOT} does not import from {site}")
    return env, f"not installed: the checkout's packages linked into {site}", found


# ----------------------------------------------------------------------------- running the items


def end_group(proc: subprocess.Popen) -> None:
    """End an item: SIGTERM to its whole process group (the guard then ends the rest), SIGKILL to
    whatever is left once the guard exits or GRACE_S has passed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def make_runner(env: dict[str, str], log: Path) -> Callable[[Item, float], tuple[int | None, str]]:
    """A runner that starts an item under the guard in a session of its own, with its output
    appended to `log` as it comes, and returns (exit code or None on timeout, the end of that
    output). Its group is ended when it exits, times out or the runner is stopped."""

    guarded = {**env, PARENT_ENV: str(os.getpid())}

    def run(item: Item, timeout_s: float) -> tuple[int | None, str]:
        with open(log, "ab") as sink:
            sink.write(f"\n===== {item.name}: {' '.join(item.command)}\n".encode())
            sink.flush()
            start = sink.tell()
            try:
                proc = subprocess.Popen(
                    [sys.executable, GUARD, *item.command], cwd=ROOT, env=guarded, stdout=sink,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                return 1, str(exc)
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                end_group(proc)  # also what a finished item left behind
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
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return make_runner(env, Path(tmp) / "log")(item, timeout_s)


def skip_reason(item: Item, gpus: int, missing: dict[str, str], left: float, budget_s: float):
    """Why `item` does not run now, or None."""
    lacking = [m for m in item.needs if m in missing]
    if item.skip:
        return item.skip
    if gpus < item.min_gpus:
        return f"needs {item.min_gpus}+ GPUs, {gpus} visible"
    if lacking:
        hints = "; ".join(dict.fromkeys(missing[m] for m in lacking))
        return f"{', '.join(lacking)} not installed ({hints})"
    if item.compiler and compiler() is None:
        return "no C compiler for torch.compile (cc, gcc, clang or $CC)"
    if item.if_time_left and left < item.timeout_s:
        return f"its {item.timeout_s} s limit is more than the {left:.0f} s left"
    return f"time budget spent ({budget_s / 60:.0f} min)" if left < 30 else None


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
    finish(item, result, code, output, out)


def run_items(
    items: list[Item],
    budget_s: float,
    gpus: int,
    missing: dict[str, str],
    runner: Callable[[Item, float], tuple[int | None, str]] = run_command,
    on_change: Callable[[list[Result]], None] = lambda results: None,
    out: Path | None = None,
) -> list[Result]:
    """Run every item within `budget_s` in total, the time an item's group may take to end after its
    limit (GRACE_S) included; a failure, timeout or crash is recorded and the next item runs.
    `on_change(results)` is called whenever a result changes (to save the report); `out` is where
    the items write their files."""
    results = [Result(i.name, "pending", "", 0.0, " ".join(i.command)) for i in items]
    on_change(results)
    spent = 0.0
    for n, (item, result) in enumerate(zip(items, results), 1):
        head = f"[{n}/{len(items)}] {item.name}"
        left = budget_s - spent - GRACE_S  # what an item may run for, its ending not counted
        reason = skip_reason(item, gpus, missing, left, budget_s)
        if reason:
            result.status, result.reason = "skipped", reason
            _say(f"{head}: skipped, {reason}")
            on_change(results)
            continue
        result.status = "running"
        on_change(results)
        _say(f"{head} ...")
        try:
            _run_one(item, result, runner, min(item.timeout_s, left), out)
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


# ----------------------------------------------------------------------------- the command


def _saver(report: Report, out: Path, planned_rows: list[dict]) -> Callable[[list[Result]], None]:
    """Save the report with these results, the machine the versions item printed and every
    figure measured so far beside the plan; a failed write is said, not fatal."""

    def save(results: list[Result]) -> None:
        report.results = results
        for r in results:
            report.machine |= r.figures
        report.comparison = compare(out, planned_rows)
        report.headlines = headlines(results, out)
        try:
            write_report(report, out)
        except OSError as exc:
            _say(f"gpu_acceptance: could not write the report in {out}: {exc}")

    return save


def _close(report: Report, out: Path, save: Callable) -> int:
    """The finished report and the exit code."""
    report.finished = True
    save(report.results)
    for row in report.comparison:
        if row["measured"] is not None:
            _say(f"  {row['figure']} at {row['minutes']:g} min: measured {row['measured']:.3g}, "
                 f"planned {row['planned']:.3g}")  # fmt: skip
    _say(f"wrote {out / 'acceptance.json'} and {out / 'acceptance.md'}: the folder {out} is all")
    return 0 if all(r.status != "failed" for r in report.results) else 1


def _earlier(report: Path) -> tuple[set[str], set[str]]:
    """(the items REPORT lists, those it lists as passed); a report that cannot be read is one
    line."""
    try:
        results = json.loads(report.read_text())["results"]
        return {r["name"] for r in results}, {r["name"] for r in results if r["status"] == "passed"}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        line = f"gpu_acceptance: error: --after {report}: not an acceptance.json ({exc!r})"
        print(line, file=sys.stderr)
        raise SystemExit(2) from None  # a mistake in the command, as argparse's own


def items_for(args, out: Path, scratch: Path, gpus: int) -> list[Item]:
    """The command's items. `--second --after REPORT` (the report of a first or second command)
    runs what REPORT did not pass: the first command's items it lists, then the second's, so a
    second command stopped by its budget goes on where it stopped."""
    first = first_items(out, scratch, args.rehearse)
    if not args.second:
        return first
    items = second_items(out, scratch, gpus, args.rehearse)
    if args.after is not None:
        listed, done = _earlier(args.after)
        names = {i.name for i in items}
        again = [i for i in first if i.name in listed and i.name not in done | names]
        items = again + [i for i in items if i.name not in done]
    return items


def accept(args: argparse.Namespace, out: Path, scratch: Path, started: float) -> int:
    """Run the command's items with the report written after each change, all of it within the
    budget counted from `started` (time.monotonic()); `scratch` is temporary."""
    import torch

    env, checkout, found = importable(child_env(args.rehearse, scratch), scratch)
    missing = {name: how for name, how in OPTIONAL.items() if not found[name]}
    gpus = REHEARSAL_GPUS if args.rehearse else torch.cuda.device_count()
    items = items_for(args, out, scratch, gpus)
    select(items, args.only)
    budget, mode = int(args.budget_min * 60), "rehearsal" if args.rehearse else "gpu"
    run = "second" if args.second else "first"
    machine = {"rehearsal": f"CPU, {REHEARSAL_GPUS} CPU ranks for GPUs, GPU image mimicked"}
    report = Report(SCHEMA, now(), mode, run, machine if args.rehearse else {}, budget, missing,
                    checkout)  # fmt: skip
    scale = REHEARSAL_SCALE if args.rehearse else 1
    rows = planned("small" if args.rehearse else "7b", [m / scale for m in CHAT_MINUTES],
                   CHAT_MINUTES[0] / scale)  # fmt: skip
    report.signatures = mismatches()  # the ops the kernels call, against this torch
    if not report.signatures:
        report.notes.append(f"Every aten attention op lvx calls fits torch {torch.__version__}.")
    save = _saver(report, out, rows)
    log = out / "acceptance.log"
    log.write_bytes(b"")
    _say(f"gpu_acceptance ({mode}, {run} command): {len(items)} items, {gpus} GPU(s), time budget "
         f"{budget / 60:.0f} min, lvx {checkout}; everything goes to {out}")  # fmt: skip
    for name, how in missing.items():
        _say(f"  not installed: {name} ({how})")
    for line in report.signatures:
        _say(f"  op signature: {line}")
    try:
        left = budget - (time.monotonic() - started)  # this start-up is the budget's too
        run_items(items, left, gpus, missing, make_runner(env, log), save, out)
    except (Stopped, KeyboardInterrupt) as exc:
        return _stopped(report, exc, out, save)
    return _close(report, out, save)


def _stopped(report: Report, exc: BaseException, out: Path, save: Callable) -> int:
    """The report of a run stopped by a signal, and the exit code. An item still "running" was
    stopped as it started (while the report said so), before its runner could record it."""
    for result in report.results:
        if result.status == "running":
            result.status, result.reason = "failed", f"stopped: the acceptance run got {exc!r}"
    report.notes.append(f"Stopped by {exc!r}: the items after the stopped one did not run.")
    save(report.results)
    _say(f"gpu_acceptance: stopped ({exc!r}); the report in {out} lists what ran")
    return 128 + exc.signum if isinstance(exc, Stopped) else 130


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="the folder everything goes to (the kept one)"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--first", action="store_true", help="the first command (the default)")
    which.add_argument("--second", action="store_true", help="what the first command leaves out")
    parser.add_argument(
        "--after", type=Path, help="--second: the first command's acceptance.json (its passed "
        "items are not run again; the others are, before the second's own)",
    )  # fmt: skip
    parser.add_argument(
        "--budget-min",
        type=float,
        default=BUDGET_S / 60,
        help="the whole command's time, start-up and ending included (default 7)",
    )
    parser.add_argument(
        "--only", default="", help="comma-separated words: run only the items whose names hold one"
    )
    parser.add_argument(
        "--rehearse", action="store_true", help="run on CPU at small shapes, GPU image mimicked"
    )
    args = parser.parse_args(argv)
    if args.after is not None and not args.second:
        parser.error("--after goes with --second")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
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
        return accept(args, out, scratch, started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
