"""The acceptance run's report: one row per item (pending, running, passed, partial with what it
skipped, failed with one line, skipped with the reason; pytest's counts, every attention-kernel
fallback, the files it wrote), the machine, and the measured-versus-planned table, which exists
from the start with the plan's figures and fills in as each item's file appears. `acceptance.json`
(strict JSON) and `acceptance.md` are replaced atomically after every change, so a run killed at any
point leaves a valid report.

An item passes only if it ran everything it names: a pytest item whose tests were all skipped is
"skipped", and so is a benchmark whose JSON says every case it was asked for was skipped; one that
skipped some of its modes (CUDA graphs on a CPU) is "partial", naming them; one whose figures came
in part from a fallback kernel or a compiled graph that broke failed, and so did a benchmark that
exits 0 without writing its figures.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from scripts.acceptance_items import Item
from scripts.harness import dumps, write_json

SCHEMA = 4
TAIL_LINES = 40
DECODE_MODES = ("eager", "cuda-graphs", "compile", "compile-graphs")
DECODE_FILE = "decode.json"  # the first command's decoding: eager and CUDA graphs on one build
# a decode mode as bench_decode names it in its rows
ROW_MODE = {"compile-graphs": "compile+cuda-graphs"}


@dataclass
class Result:
    name: str
    status: str  # pending | running | passed | partial (some parts skipped) | failed | skipped
    reason: str  # one line: why it failed or was skipped, or what a passed item should flag
    seconds: float
    command: str
    tail: str = ""  # the last lines of its output, passed or not
    counts: dict[str, int] = field(default_factory=dict)  # pytest's: passed, skipped, ...
    fallbacks: list[str] = field(default_factory=list)  # attention kernels that fell back
    files: list[str] = field(default_factory=list)  # what it wrote under the report's folder
    figures: dict = field(default_factory=dict)  # its JSON output line (versions.py: the machine)


@dataclass
class Report:
    schema: int
    started: str
    mode: str  # "gpu" or "rehearsal"
    run: str  # "first" or "second"
    machine: dict
    budget_s: int
    missing: dict[str, str]
    checkout: str  # how the children import lvx
    results: list[Result] = field(default_factory=list)
    comparison: list[dict] = field(default_factory=list)  # measured vs planned, per figure
    notes: list[str] = field(default_factory=list)
    # the first lines a person reads: which figures came from a fallback kernel, whether the decode
    # modes agree, the kv mode auto chose, every aten op whose signature differs from lvx's calls
    headlines: list[str] = field(default_factory=list)
    signatures: list[str] = field(default_factory=list)  # scripts/op_signatures.py, at start
    updated: str = ""
    finished: bool = False  # False: the run was stopped, or is still going


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no output")[:300]


# ----------------------------------------------------------------------------- an item's outcome

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b")
_PLURAL = {"error": "errors", "warning": "warnings"}


def pytest_counts(output: str) -> dict[str, int]:
    """pytest's closing summary ("11 skipped, 77 deselected in 0.1s") as counts, plural keys."""
    for line in reversed(output.strip().splitlines()):
        found = _COUNT.findall(line)
        if found and " in " in line:
            return {_PLURAL.get(word, word): int(n) for n, word in found}
    return {}


def figures(out: Path | None, item: Item) -> dict | None:
    """What the item wrote to its first file (its entry there when it shares the file), if any."""
    if out is None or not item.writes:
        return None
    try:
        data = json.loads((out / item.writes[0]).read_text())
    except (OSError, ValueError):
        return None
    data = data.get(item.key) if item.key and isinstance(data, dict) else data
    return data if isinstance(data, dict) else None


def _last_json(output: str) -> dict:
    try:
        found = json.loads(output.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def ran_nothing(item: Item, counts: dict[str, int], data: dict | None) -> str | None:
    """Why an item that exited 0 ran nothing (all its tests skipped, every case skipped), or
    None."""
    if item.pytest and not any(counts.get(k) for k in ("passed", "failed", "errors", "xpassed")):
        return f"ran no test ({', '.join(f'{v} {k}' for k, v in counts.items()) or 'none'})"
    if data is not None and data.get("skipped"):
        return str(data["skipped"])
    return None


def finish(item: Item, result: Result, code: int | None, output: str, out: Path | None) -> None:
    """Fill in a finished item's result from its exit code, output and files."""
    result.tail = "\n".join(output.strip().splitlines()[-TAIL_LINES:])
    result.counts = pytest_counts(output) if item.pytest else {}
    data = figures(out, item)
    result.fallbacks = [str(f) for f in (data or {}).get("fallbacks", [])]
    result.files = [w for w in item.writes if out is not None and (out / w).exists()]
    if item.reports_machine and code == 0:
        result.figures = _last_json(output)
    nothing = ran_nothing(item, result.counts, data) if code == 0 else None
    if nothing:
        result.status, result.reason = "skipped", nothing
    elif code == 0 and item.writes and data is None:
        result.status = "failed"
        where = ", ".join(x for x in (item.writes[0], item.key) if x)
        result.reason = f"exit 0 without writing its figures ({where})"
    elif code == 0 and (result.fallbacks or (data or {}).get("graph_breaks")):
        result.status, result.reason = "failed", _fell_back(result.fallbacks, data or {})
    elif code == 0 and (data or {}).get("skipped_modes"):
        result.status = "partial"
        parts = "; ".join(f"{m} ({why})" for m, why in data["skipped_modes"].items())
        result.reason = f"skipped: {parts}; the rest passed"
    elif code == 0:
        result.status, result.reason = "passed", ""
    else:
        result.status = "failed"
        why = f"timed out after {result.seconds:.0f} s" if code is None else f"exit {code}"
        result.reason = why if code is None else f"{why}: {one_line(output)}"


def _fell_back(fallbacks: list[str], data: dict) -> str:
    """One line: the fallbacks and graph breaks that fail an item whose figures came from them."""
    breaks = data.get("graph_breaks", [])
    parts = [f"{len(fallbacks)} attention-kernel fallback(s): {fallbacks[0]}"] if fallbacks else []
    return "; ".join(parts + ([f"{len(breaks)} graph break(s): {breaks[0]}"] if breaks else []))


# ----------------------------------------------------------------------------- measured vs planned


def planned(shape: str, chat_minutes: list[float], decode_minutes: float) -> list[dict]:
    """The plan's figures (scripts/memory_plan.py) for the model shape the run measures, one row
    per (figure, minutes), measured cells empty."""
    from scripts.memory_plan import Workload, memory_plan, time_plan
    from scripts.random_model import model_config

    cfg, rows = model_config(shape), []
    for minutes in chat_minutes:  # the longest in the first command's file, the rest the second's
        chat = "chat_7b.json" if minutes == max(chat_minutes) else "chat_7b_10min.json"
        work = Workload(minutes=minutes, answer_tokens=64)
        t = time_plan(cfg, work)
        for figure, value, source in (
            ("video-prompt prefill s", t["video-prompt prefill"]["seconds"], chat),
            ("TTFT s", t["question prefill (TTFT)"]["seconds"], chat),
            ("tokens/s, chat loop", t["tokens/s"], chat),
            ("peak GiB", memory_plan(cfg, work).peak / 2**30, chat),
            ("peak reserved GiB", memory_plan(cfg, work).reserved / 2**30, chat),
        ):
            rows.append({"figure": figure, "minutes": minutes, "planned": value, "from": source})
    tokens_s = time_plan(cfg, Workload(minutes=decode_minutes, answer_tokens=64))["tokens/s"]
    for mode in DECODE_MODES:
        source = DECODE_FILE if mode in ("eager", "cuda-graphs") else "decode_compile.json"
        rows.append({"figure": f"tokens/s, decode {mode}", "minutes": decode_minutes,
                     "planned": tokens_s, "from": source})  # fmt: skip
    return [row | {"measured": None, "measured/planned": None} for row in rows]


_CHAT = {
    "video-prompt prefill s": "video_prompt_prefill_s",
    "TTFT s": "ttft_s",
    "tokens/s, chat loop": "tokens_per_s",
    "peak GiB": "peak_gib",
    "peak reserved GiB": "peak_reserved_gib",
}


def _measured(out: Path, row: dict) -> float | None:
    try:
        data = json.loads((out / row["from"]).read_text())
    except (OSError, ValueError):
        return None
    for r in data.get("rows", []):
        if row["figure"] in _CHAT and abs(r.get("minutes", -1) - row["minutes"]) < 1e-9:
            return r.get(_CHAT[row["figure"]])
        mode = row["figure"].removeprefix("tokens/s, decode ")
        if mode != row["figure"] and r.get("mode") == ROW_MODE.get(mode, mode):
            return r.get("tokens_per_s")
    return None


def compare(out: Path, rows: list[dict]) -> list[dict]:
    """The planned rows with every figure measured so far filled in."""
    filled = []
    for row in rows:
        measured = _measured(out, row)
        ratio = measured / row["planned"] if measured is not None and row["planned"] else None
        filled.append(row | {"measured": measured, "measured/planned": ratio})
    return filled


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _group_speeds(group: dict) -> list[str]:
    """The group's decode speeds (eager, static step: one build, the slowest rank's), as one
    line."""
    rows = [r for r in group.get("rows", []) if isinstance(r.get("tokens_per_s"), (int, float))]
    if not rows:
        return []
    ranks = next(iter(group.get("comparison", {}).values()), {}).get("ranks", "?")
    speeds = ", ".join(f"{r['mode']} {r['tokens_per_s']:.3g}" for r in rows)
    return [f"Decoding on {ranks} ranks, tokens/s at the slowest rank (one build): {speeds}."]


def _compared(mode: str, c: dict) -> str:
    """One line: a decode mode's teacher-forced comparison with eager (with the noise floor it was
    bounded by, where it had one)."""
    state = "agree" if c.get("ok") else "DISAGREE"
    floor = f"noise floor {c['noise_floor']:.2e}, " if "noise_floor" in c else ""
    checks = ""
    if "kv_steps_differing" in c:
        checks = (f"; first layer's output within {c['first_layer']['max']:.2e} (bound "
                  f"{c['first_layer']['bound']:.2e}), its K/V bit-equal at "
                  f"{c['steps'] - c['kv_steps_differing']} of {c['steps']} steps, positions and "
                  f"keys seen equal at "
                  f"{c['steps'] - c['bookkeeping_steps_differing']}")  # fmt: skip
    why = f": {c['why']}" if c.get("why") else ""
    return (
        f"Decoding: {mode} and eager {state} on the same tokens: logits differ by at most "
        f"{c['max_relative_logits_difference']:.2e} of their RMS over {c['steps']} steps "
        f"({floor}bound {c['bound']:.2e}){checks}{why}."
    )


def headlines(results: list[Result], out: Path) -> list[str]:
    """The report's first lines: decoding's share of the memory roofline; every item whose figures
    came (in part) from a fallback kernel, or that none did; the decode modes skipped and their
    teacher-forced comparisons; the kv mode `auto` chose for the chat, with the memory it saw."""
    from scripts.roofline import line as roofline_line

    first = _read(out / DECODE_FILE)
    lines = [roofline_line(mode, r) for mode, r in first.get("roofline", {}).items()]
    lines += [
        f"FALLBACK: '{r.name}' ran {len(r.fallbacks)} kind(s) of call on a fallback kernel, its "
        f"figures are that kernel's: {'; '.join(r.fallbacks)}"
        for r in results
        if r.fallbacks
    ]
    if not any(r.fallbacks for r in results) and any(r.status == "passed" for r in results):
        lines.append("Kernels: no attention-kernel fallback in any item that ran (every figure is "
                     "from the kernel the engine picks).")  # fmt: skip
    compiled = _read(out / "decode_compile.json")
    group = compiled.get("group")  # the group's static step (the second command's 2+ GPUs)
    decoded = [first, compiled, group if isinstance(group, dict) else {}]
    compared = {m: c for d in decoded for m, c in d.get("comparison", {}).items()}
    lines += [f"Decoding: {r['mode']} SKIPPED, not compared with eager: {r['skipped']}."
              for d in decoded for r in d.get("rows", []) if r.get("skipped")]  # fmt: skip
    lines += [_compared(mode, c) for mode, c in compared.items()]
    lines += _group_speeds(group if isinstance(group, dict) else {})
    for row in _read(out / "chat_7b.json").get("rows", []):
        if row.get("kv_choice"):
            lines.append(f"kv mode auto at {row['minutes']:g} min: {row['kv_choice']}")
    return lines


# ----------------------------------------------------------------------------- the files


def _cell(value) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _md_row(r: Result) -> str:
    counts = ", ".join(f"{v} {k}" for k, v in r.counts.items())
    why = "; ".join(x for x in (r.reason, counts) if x).replace("|", "/")
    return f"| {r.name} | {r.status} | {r.seconds:.0f} | {why} | {', '.join(r.files)} |"


def markdown(report: Report) -> str:
    """The summary a person reads: machine, missing packages, one row per item, every fallback,
    measured vs planned."""
    state = "finished" if report.finished else f"NOT FINISHED (last written {report.updated})"
    lines = [
        f"# GPU acceptance, {report.run} command ({report.mode}), {report.started}: {state}", "",
        *[f"- {line}" for line in report.headlines + report.signatures],
        *([""] if report.headlines or report.signatures else []),
        f"Machine: {dumps(report.machine)}", "",
        f"Time budget: {report.budget_s / 60:.0f} min. lvx: {report.checkout}.", "",
    ]  # fmt: skip
    if report.missing:
        missing = "; ".join(f"{k} ({v})" for k, v in report.missing.items())
        lines += [f"Not installed (items needing them are skipped): {missing}", ""]
    lines += ["| item | status | s | reason | files |", "|---|---|---|---|---|"]
    lines += [_md_row(r) for r in report.results]
    fell = [f"- {r.name}: {f}" for r in report.results for f in r.fallbacks]
    if fell:
        lines += ["", "Attention-kernel fallbacks (the figures are the fallback kernel's):", *fell]
    lines += [f"\n{note}" for note in report.notes]
    if report.comparison:
        keys = ["figure", "minutes", "planned", "measured", "measured/planned"]
        lines += ["", "Measured vs planned (`scripts/plan_gpu.py`), one device:", ""]
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_cell(r[k]) for k in keys) + " |" for r in report.comparison]
    return "\n".join(lines) + "\n"


def write_report(report: Report, out: Path) -> tuple[Path, Path]:
    """acceptance.json and acceptance.md, each replaced atomically."""
    report.updated = now()
    md = out / "acceptance.md"
    tmp = md.with_name(".acceptance.md.tmp")
    js = write_json(out / "acceptance.json", asdict(report))
    tmp.write_text(markdown(report))
    tmp.replace(md)
    return js, md
