"""Ring or gather: which schedule a distributed cross-attention call runs, chosen from the query
rows and the ranks.

The ring (`lv_xattn_with_lse`) costs n-1 dependent rounds of latency but sends each query block once
per hop; the gather schedule (`gather_xattn_with_lse`) costs two collectives whatever n but sends
all rows to every rank. Below a crossover number of query rows in total the gather wins. The
crossover was measured by `scripts/bench_schedule.py` (docs/benchmarks.md, "Ring or gather by query
size") on 2 and 4 CPU ranks over gloo; on GPUs with a fast link the kernel time shrinks and the
crossover moves, so measure there and override with `--xattn-schedule`.
"""

from __future__ import annotations

from lvx_app.config import SCHEDULES

__all__ = ["GATHER_MAX_ROWS", "SCHEDULES", "choose_schedule"]

# most query rows in total (over all ranks) for which gather beat the ring, by number of ranks
# measured; other numbers of ranks take the entry of the most ranks measured not above theirs.
# Measured 2026-11-24: gather 1.7x (2 ranks) / 1.3x (4 ranks) ahead at 8 rows, still 1.08x / 1.33x
# at 256; from 384 rows on the two are within the noise (both do the same kernel work), and
# the ring, which sends each row once per hop instead of all rows to every rank, is kept there for
# links slower than loopback.
GATHER_MAX_ROWS = {2: 256, 4: 256}


def choose_schedule(rows: int, ranks: int, schedule: str = "auto") -> str:
    """'ring' or 'gather' for `rows` query rows in total over `ranks` ranks; `schedule` other than
    auto forces it."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"unknown cross-attention schedule {schedule!r}; use one of {', '.join(SCHEDULES)}"
        )
    if schedule != "auto":
        return schedule
    if ranks <= 1:
        return "ring"  # one rank: both are the same local kernel call
    limit = GATHER_MAX_ROWS[
        max((r for r in GATHER_MAX_ROWS if r <= ranks), default=min(GATHER_MAX_ROWS))
    ]
    return "gather" if rows <= limit else "ring"
