"""What every benchmark shares: the machine a figure was measured on, timing, result rows written as
strict JSON the moment they exist, tables (terminal and Markdown) and plots.

JSON is strict everywhere (`allow_nan=False`): a figure that does not exist (no peak memory on a
CPU, a cost that could not grow) is written as null, never NaN.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterable


def cpu_model() -> str:
    """The CPU's model name (Linux says it in /proc/cpuinfo; `platform` often says nothing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: Any = None) -> dict:
    """The machine a result was measured on, for a benchmark's JSON; with a CUDA `device`, the
    GPU's name and CUDA's version too."""
    import torch

    from lvx_app.devices import usable_cores

    info = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpus": usable_cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg": list(os.getloadavg()),
    }
    if device is not None and torch.device(device).type == "cuda":
        info |= {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return info


def command_line() -> str:
    """How this script was started, to be written beside its figures."""
    return " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


# ----------------------------------------------------------------------------- timing


def sync(device: Any) -> None:
    """Wait for a CUDA device's queued work (nothing to wait for on a CPU)."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Any = None) -> tuple[Any, float]:
    """(fn(), seconds) with the device synchronised on both sides and no autograd."""
    import torch

    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        result = fn()
    sync(device)
    return result, time.perf_counter() - t0


def median_seconds(fn: Callable[[], Any], iters: int, warmup: int = 1, device: Any = None) -> float:
    """The median time of `iters` calls after `warmup` untimed ones: CUDA events on a GPU (the
    device's time), the wall clock on a CPU."""
    import torch

    for _ in range(warmup):
        fn()
    cuda = device is not None and torch.device(device).type == "cuda"
    times = []
    for _ in range(iters):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- results


def strict(value: Any) -> Any:
    """`value` as strict JSON holds it: NaN and infinities become None, tuples lists, paths and
    other objects their text, dataclasses dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, str) else k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return strict(asdict(value))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def dumps(data: Any, **kwargs: Any) -> str:
    """`data` as strict JSON text (see `strict`): what a script prints for another to read."""
    return json.dumps(strict(data), allow_nan=False, **kwargs)


def write_json(path: Path | str, data: Any, key: str | None = None) -> Path:
    """Write `data` as strict JSON to `path`, atomically (a reader, or a kill, sees the old file or
    the new one). With `key`, `data` replaces that entry of the object the file holds, the rest
    kept (two items of one run writing one file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if key is not None:
        try:
            whole = json.loads(path.read_text())
        except (OSError, ValueError):
            whole = {}
        data = {**(whole if isinstance(whole, dict) else {}), key: data}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


class Rows:
    """A benchmark's rows, the file rewritten after each one: a run killed between two rows keeps
    every row it finished. `extra` (the command, the machine, ...) goes beside "rows"; with `key`,
    all of it goes under that key of the file (see `write_json`)."""

    def __init__(self, path: Path | str | None, key: str | None = None, **extra: Any):
        self.path, self.key, self.extra, self.rows = path and Path(path), key, extra, []

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.save()
        return row

    def save(self, **more: Any) -> None:
        self.extra |= more
        if self.path is not None:
            write_json(self.path, {**self.extra, "rows": self.rows}, self.key)


# ----------------------------------------------------------------------------- tables and plots


def cell(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def columns(rows: list[dict]) -> list[str]:
    """The keys of the rows that hold one value each (lists and dicts go to the JSON only)."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return [k for k in keys if not any(isinstance(r.get(k), (list, dict)) for r in rows)]


def show(title: str, rows: list[dict], keys: Iterable[str] | None = None, digits: int = 3) -> None:
    """Print the rows as a table in the terminal."""
    from rich.console import Console
    from rich.table import Table

    keys = list(keys or columns(rows))
    table = Table(title=title)
    for key in keys:
        table.add_column(str(key), justify="right")
    for row in rows:
        table.add_row(*(cell(row.get(k, ""), digits) for k in keys))
    Console(width=220).print(table)


def markdown(rows: list[dict], keys: Iterable[str] | None = None, digits: int = 3) -> str:
    """The rows as a Markdown table."""
    keys = list(keys or columns(rows))
    lines = ["| " + " | ".join(map(str, keys)) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k, ""), digits) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path | str, **kwargs: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, **kwargs)
    return path
