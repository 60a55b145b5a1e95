"""Accuracy tables, the JSON summary and the duration x domain bar plot, from answer records.

Letters are re-extracted from each record's raw ``response`` with the requested scoring mode, so one
results file can be reported both ways. Both denominators are always given: ``accuracy_answered``
(correct / parsed, the official script's number) and ``accuracy_asked`` (correct / asked,
lmms-eval's); ``accuracy`` is the one the scoring mode uses, and ``unparsed`` counts replies with no
letter.
"""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.table import Table

from lvx_app.eval.dataset import DOMAINS, DURATIONS, SUB_CATEGORIES, TASK_TYPES
from lvx_app.eval.extract import extract

GROUPS = {
    "duration": DURATIONS,
    "domain": DOMAINS,
    "sub_category": SUB_CATEGORIES,
    "task_type": TASK_TYPES,
}


def _pct(num: int, den: int) -> float | None:
    return 100.0 * num / den if den else None


class _Tally:
    __slots__ = ("asked", "parsed", "correct")

    def __init__(self) -> None:
        self.asked = self.parsed = self.correct = 0

    def add(self, pred: str, answer: str) -> None:
        self.asked += 1
        self.parsed += bool(pred)
        self.correct += pred == answer

    def stats(self, scoring: str) -> dict[str, Any]:
        answered, asked = _pct(self.correct, self.parsed), _pct(self.correct, self.asked)
        return {
            "asked": self.asked,
            "parsed": self.parsed,
            "unparsed": self.asked - self.parsed,
            "correct": self.correct,
            "accuracy": answered if scoring == "official" else asked,
            "accuracy_answered": answered,
            "accuracy_asked": asked,
        }


def _ordered(keys: Iterable[str], known: Sequence[str]) -> list[str]:
    keys = set(keys)
    return [k for k in known if k in keys] + sorted(keys - set(known))


def summarize(records: Iterable[dict[str, Any]], scoring: str = "official") -> dict[str, Any]:
    """Counts and accuracies (percent, None where nothing counts) overall, per group and per
    duration x domain."""
    overall = _Tally()
    groups: dict[str, dict[str, _Tally]] = {g: defaultdict(_Tally) for g in GROUPS}
    grid: dict[str, dict[str, _Tally]] = defaultdict(lambda: defaultdict(_Tally))
    for r in records:
        pred = extract(r.get("response") or "", scoring)
        overall.add(pred, r["answer"])
        for g in GROUPS:
            groups[g][r[g]].add(pred, r["answer"])
        grid[r["duration"]][r["domain"]].add(pred, r["answer"])
    summary: dict[str, Any] = {"scoring": scoring, "overall": overall.stats(scoring)}
    for g, known in GROUPS.items():
        summary[f"by_{g}"] = {k: groups[g][k].stats(scoring) for k in _ordered(groups[g], known)}
    summary["by_duration_domain"] = {
        d: {k: grid[d][k].stats(scoring) for k in _ordered(grid[d], DOMAINS)}
        for d in _ordered(grid, DURATIONS)
    }
    return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


GROUP_NAMES = {"sub_category": "subcategory", "task_type": "task type"}


def report_table(summary: dict[str, Any], title: str = "Video-MME") -> Table:
    """One rich table: overall, then a section per group; one decimal as the official script
    prints."""
    other = "% of\nasked" if summary["scoring"] == "official" else "% of\nanswered"
    table = Table(title=f"{title} — scoring: {summary['scoring']}", show_edge=False)
    # fits 80 columns with 13 for the names (Video-MME's longest word is 12 letters): names wrap
    # between words, numbers and group names never break
    table.add_column("group", no_wrap=True)
    table.add_column("", overflow="fold")
    for col in ("asked", "unparsed", "correct", "accuracy\n%", other):
        table.add_column(col, justify="right", no_wrap=True)

    def row(group: str, name: str, s: dict[str, Any], style: str | None = None) -> None:
        alt = s["accuracy_asked"] if summary["scoring"] == "official" else s["accuracy_answered"]
        cells = (
            group,
            name,
            str(s["asked"]),
            str(s["unparsed"]),
            str(s["correct"]),
            _fmt(s["accuracy"]),
            _fmt(alt),
        )
        table.add_row(*cells, style=style)

    row("overall", "", summary["overall"], style="bold")
    for g in GROUPS:
        table.add_section()
        for i, (name, s) in enumerate(summary[f"by_{g}"].items()):
            row(GROUP_NAMES.get(g, g) if i == 0 else "", name, s)
    return table


def print_report(
    summary: dict[str, Any], console: Console | None = None, title: str = "Video-MME"
) -> None:
    (console or Console()).print(report_table(summary, title))


def write_summary(
    summary: dict[str, Any], path: Path | str, extra: dict[str, Any] | None = None
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({**(extra or {}), **summary}, indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
    return path


def plot_duration_domain(
    summary: dict[str, Any], path: Path | str, title: str = "Video-MME"
) -> Path:
    """Grouped bars: accuracy per domain (x) for each duration, plus an 'overall' group. Agg, no
    pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    grid = summary["by_duration_domain"]
    durations = list(grid)
    domains = _ordered({k for d in grid.values() for k in d}, DOMAINS) + ["overall"]
    inches = max(6.0, 1.4 * len(domains))
    fig = Figure(figsize=(inches, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(durations))
    for j, d in enumerate(durations):
        cells = [grid[d].get(k) for k in domains[:-1]] + [summary["by_duration"].get(d)]
        values = [(c or {}).get("accuracy") or 0.0 for c in cells]
        xs = [i + (j - (len(durations) - 1) / 2) * width for i in range(len(domains))]
        bars = ax.bar(xs, values, width, label=d)
        ax.bar_label(
            bars, labels=[_fmt((c or {}).get("accuracy")) if c else "" for c in cells], fontsize=6
        )
    ax.set_xticks(range(len(domains)), [k.replace(" & ", " &\n") for k in domains], fontsize=7)
    ax.set_ylim(0, 105)
    ax.set_ylabel(f"accuracy % ({summary['scoring']})")
    overall = summary["overall"]["accuracy"]
    said = "no answer parsed" if overall is None else f"{overall:.1f}%"
    # wrapped at spaces to the figure's width (about 11 characters an inch at 10 pt), so a long
    # model name never runs off both sides
    text = textwrap.fill(f"{title}: overall {said}", int(inches * 11), break_on_hyphens=False)
    ax.set_title(text, fontsize=10)
    if durations:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def model_name(model: str) -> str:
    """A checkpoint as a title names it: a hub id as it is, a local folder by its own name."""
    return Path(model).name if model.startswith(("/", "~", ".")) else model


def output_paths(results: Path | str) -> dict[str, Path]:
    """Where the reports of ``results.jsonl`` go: beside it, same stem."""
    results = Path(results)
    stem = results.with_suffix("") if results.suffix == ".jsonl" else results
    return {
        "summary": stem.with_name(stem.name + ".summary.json"),
        "plot": stem.with_name(stem.name + ".png"),
        "official": stem.with_name(stem.name + ".official.json"),
    }


def report_file(
    results: Path | str,
    scoring: str = "official",
    only: set[str] | None = None,
    console: Console | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Read a results file, print the table, write the JSON summary, the PNG plot and the records in
    the official submission shape next to it. ``only`` limits the report to those question_ids."""
    from lvx_app.eval.results import read_results, to_official_json

    res = read_results(results)
    records = [r for r in res.records if only is None or r["question_id"] in only]
    summary = summarize(records, scoring)
    paths = output_paths(results)
    header = res.headers[0] if res.headers else {}
    manifest = {k: v for k, v in header.items() if k not in ("type", "started")}
    write_summary(
        summary, paths["summary"], {"results": str(results), "manifest": manifest, **(extra or {})}
    )
    title = f"Video-MME {model_name(header.get('model', ''))}".strip()
    plot_duration_domain(summary, paths["plot"], title)
    paths["official"].write_text(
        json.dumps(to_official_json(records), indent=1, ensure_ascii=False) + "\n"
    )
    console = console or Console()
    print_report(summary, console, title)
    o = summary["overall"]
    console.print(
        f"{o['asked']} question(s) reported, {o['unparsed']} unparsed; summary {paths['summary']}, "
        f"plot {paths['plot']}, "
        f"official-format responses {paths['official']}"
    )
    return summary
