"""Ring or gather: which schedule a question's prefill runs, chosen from its query rows and the
ranks.

The ring shards the question over the ranks and runs its text and visual attention as LV-XAttn
rings (`lv_xattn_with_lse`): n-1 dependent rounds of latency, each query block sent once per hop.
The gather feeds the whole question on every rank (the replicated feed): text attention is local
over the replicated cache and the visual partials are combined in one collective
(`decode_xattn`), whatever n, but every rank computes every row. Below a crossover number of query
rows in total the gather wins. Where it lies depends on the machine (kernel time against collective
latency), so a machine measures its own with `scripts/bench_schedule.py --calibrate [--cache-dir
DIR]`, which times those very hooks of the engine and writes `calibration.json`
(`write_calibration`) in the cache folder (`--cache-dir`, else `$LVX_CACHE_DIR`, else
~/.cache/lvx); an engine reads the one in its own run's cache folder once and otherwise uses the
built-in table, measured on 2 and 4 CPU ranks over gloo (docs/design-measurements.md, "Ring or
gather by query size"). `--xattn-schedule ring|gather` overrides both.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from datetime import datetime, timezone
from pathlib import Path

from lvx_app.config import SCHEDULES
from lvx_app.defaults import default_cache_dir

__all__ = [
    "CALIBRATION_FILE",
    "GATHER_MAX_ROWS",
    "SCHEDULES",
    "CalibrationWarning",
    "calibration_path",
    "choose_schedule",
    "crossovers",
    "gather_limit",
    "read_calibration",
    "write_calibration",
]

# most query rows in total (over all ranks) for which gather beat the ring, by number of ranks
# measured; other numbers of ranks take the entry of the most ranks measured not above theirs.
# Both do the same kernel work; the gather was 2.0x (2 ranks) / 2.8x (4 ranks) ahead at 8 rows,
# 1.2x ahead at 256 rows on 4 ranks and behind at 512; on 2 ranks from 64 to 256 rows the two
# trade places between runs (0.8x-1.4x). Above 256 the ring, which sends each row once per hop
# instead of all rows to every rank, is kept for links slower than loopback.
GATHER_MAX_ROWS = {2: 256, 4: 256}
CALIBRATION_FILE = "calibration.json"
# 2: timed as the engine runs each schedule (its hooks under either feed); an older file is
# refused in one warning and measured again
CALIBRATION_VERSION = 2


class CalibrationWarning(UserWarning):
    """This machine's calibration file could not be used; the built-in crossovers apply."""


def calibration_path(cache_dir: str | Path | None = None) -> Path:
    """Where this machine's measured crossovers live: in the cache folder a run uses
    (`--cache-dir`; None: the default one)."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / CALIBRATION_FILE


def read_calibration(path: Path) -> dict[int, int]:
    """{ranks: most gather rows} from a calibration file ({} when there is none); a file that cannot
    be used is named in one warning and ignored."""
    try:
        data = json.loads(path.read_text())
        table = {int(n): int(rows) for n, rows in data["gather_max_rows"].items()}
        if data.get("version") != CALIBRATION_VERSION or any(
            n < 2 or rows < 0 for n, rows in table.items()
        ):
            raise ValueError("not a calibration this version writes")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(
            f"ignoring {path} ({exc}); measure again (scripts/bench_schedule.py --calibrate) or "
            "delete it",
            CalibrationWarning,
            stacklevel=2,
        )
        return {}
    return table


def write_calibration(measured: dict[int, int], machine: dict, command: str, path: Path) -> Path:
    """Write `measured` crossovers ({ranks: most gather rows}) to the calibration file `path`, over
    the ranks an earlier calibration there measured; atomically (a reader sees the old file or the
    new). Returns `path`."""
    table = {**read_calibration(path), **measured}
    data = {
        "version": CALIBRATION_VERSION,
        "gather_max_rows": {str(n): int(rows) for n, rows in sorted(table.items())},
        "machine": machine,
        "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


@functools.cache
def crossovers(cache_dir: str | None = None) -> dict[int, int]:
    """The crossovers in force for a run whose cache folder is `cache_dir` (`--cache-dir`; None:
    the default one): the built-in table, with the numbers of ranks this machine measured replaced
    by its own (read once per folder and process)."""
    return {**GATHER_MAX_ROWS, **read_calibration(calibration_path(cache_dir))}


def gather_limit(ranks: int, table: dict[int, int] | None = None) -> int:
    """Most query rows the gather schedule takes at `ranks` ranks: the entry of the most ranks
    measured not above `ranks` (the fewest measured below all of them). `table`: the crossovers in
    force (default: `crossovers()`, the default cache folder's)."""
    table = crossovers() if table is None else table
    return table[max((r for r in table if r <= ranks), default=min(table))]


def choose_schedule(rows: int, ranks: int, schedule: str = "auto", limit: int | None = None) -> str:
    """'ring' or 'gather' for `rows` query rows in total over `ranks` ranks; `schedule` other than
    auto forces it. `limit`: the most rows to gather (default: `gather_limit(ranks)`; the engine
    passes the one its ranks agreed on)."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"unknown cross-attention schedule {schedule!r}; use one of {', '.join(SCHEDULES)}"
        )
    if schedule != "auto":
        return schedule
    if ranks <= 1:
        return "ring"  # one rank: both are the same local kernel call
    return "gather" if rows <= (gather_limit(ranks) if limit is None else limit) else "ring"
