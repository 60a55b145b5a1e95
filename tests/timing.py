"""Deadlines in tests that stretch with the machine's load, so a busy machine does not fail them.

A deadline here is a guard against a hang, never what a test checks: `scaled(60)` is 60 s on a quiet
machine and proportionally more when the load per core is higher (or `$LVX_TEST_SLOWDOWN` times).
"""

from __future__ import annotations

import os


def slowdown() -> float:
    """How many times slower than a quiet machine this one runs now (at least 1)."""
    forced = os.environ.get("LVX_TEST_SLOWDOWN")
    if forced:
        return max(1.0, float(forced))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, os.getloadavg()[0] / max(1, cores or 1))


def scaled(seconds: float) -> float:
    """`seconds` on a quiet machine, stretched by the load now."""
    return seconds * slowdown()
