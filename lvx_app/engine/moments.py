"""An answer's evidence as moments: runs of neighbouring frames that drew much of its attention.

Pure functions over the per-frame shares (lvx_app/attention/frame_shares.py) and the sampled frames'
real timestamps, so every frontend shows the same moments: `lvx chat` one line under each answer
(`seen_line`), the page thumbnails, the API's `lvx_evidence`, the eval's results file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# the one line under an answer, beside the answer's own numbers (print(engine.last_answer))
from lvx_app.engine.records import TOP_MOMENTS, Moment, label, seen_line  # noqa: F401

# a frame belongs to a moment when its share is at least this fraction of the largest share
HIGH_SHARE = 0.5


def moments(
    shares: Sequence[float], timestamps: Sequence[float], high: float = HIGH_SHARE
) -> list[Moment]:
    """Every moment, largest share first: each maximal run of neighbouring frames whose share is at
    least `high` times the largest frame's share, from its first frame's timestamp to its last's,
    with the run's summed share. No frames (or no attention) -> no moments."""
    if len(shares) != len(timestamps):
        raise ValueError(f"{len(shares)} shares for {len(timestamps)} frame timestamps")
    top = max(shares, default=0.0)
    if top <= 0:
        return []
    found, run = [], []
    for i, share in enumerate([*shares, -1.0]):  # a sentinel closes the last run
        if share >= high * top:
            run.append(i)
            continue
        if run:
            found.append(
                Moment(
                    float(timestamps[run[0]]),
                    float(timestamps[run[-1]]),
                    min(1.0, math.fsum(shares[j] for j in run)),  # rounding never makes > 1
                )
            )
            run = []
    return sorted(found, key=lambda m: (-m.share, m.start))
