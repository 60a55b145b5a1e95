"""Ring or gather: which schedule a distributed cross-attention call runs, chosen from the query
rows and the ranks.

The ring (`lv_xattn_with_lse`) costs n-1 dependent rounds of latency but sends each query block once
per hop; the gather schedule (`gather_xattn_with_lse`) costs two collectives whatever n but sends
all rows to every rank. Below a crossover number of query rows in total the gather wins. The
crossover was measured by `scripts/bench_schedule.py` (docs/benchmarks.md, "Ring or gather by query
size") on a shared 2-vCPU CPU VM over gloo; on GPUs with a fast link the kernel time shrinks and the
crossover moves, so measure there and override with `--xattn-schedule`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from lvx_app.attention.gather_xattn import gather_xattn_with_lse
from lvx_app.attention.lv_xattn import lv_xattn_with_lse, query_sizes
from lvx_app.parallel import get_world_size

SCHEDULES = ("auto", "ring", "gather")
# most query rows in total (over all ranks) for which gather beat the ring, by number of ranks
# measured; other numbers of ranks take the entry of the most ranks measured not above theirs.
# Measured 2026-11-24: gather 1.7x (2 ranks) / 1.3x (4 ranks) ahead at 8 rows, still 1.08x / 1.33x
# at 256; from 384 rows on the two are within this VM's noise (both do the same kernel work), and
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


def xattn_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    schedule: str = "auto",
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_vis: Tensor | None = None,
    k_frame: Tensor | None = None,
    q_sizes: list[int] | None = None,
    stats: dict | None = None,
) -> tuple[Tensor, Tensor]:
    """Distributed cross-attention by the schedule `choose_schedule` picks; contract as
    `lv_xattn_with_lse`.

    Every rank must pass the same `schedule`; the choice uses every rank's block length (one tiny
    all_gather, skipped when `q_sizes` is given), so all ranks take the same path."""
    n = get_world_size(group)
    sizes = query_sizes(q, group, n, dist.get_rank(group), q_sizes) if n > 1 else [q.shape[1]]
    chosen = (
        lv_xattn_with_lse
        if choose_schedule(sum(sizes), n, schedule) == "ring"
        else gather_xattn_with_lse
    )
    return chosen(
        q, k, v, group=group, scale=scale, q_vis=q_vis, k_frame=k_frame, q_sizes=sizes, stats=stats
    )
