"""Decoding's share of the memory roofline: tokens/s times the bytes each token reads (the plan's:
every weight once, and the visual and text K/V it attends to, `memory_plan.time_plan`'s decode
step) over the bandwidth a device copy measures in the same process. Our goal for an hour of video
is 85 % of it.

The projection to another length keeps the measured step's time and adds the K/V bytes the longer
video adds, read at the copy's bandwidth (the best the added reads can do), so it says what the
share becomes if nothing but the K/V read grows.
"""

from __future__ import annotations

import torch

from scripts.harness import median_seconds
from scripts.memory_plan import GB, Workload, time_plan

GOAL = 0.85  # of the roofline, for an hour of video
COPY_BYTES = {"cuda": 2**30, "cpu": 2**27}  # the copied buffer: large against any cache


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy of COPY_BYTES moves (read and written), the median
    of 5 after one warm-up."""
    size = COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), 5, 1, device)  # noqa: F821 - freed below
    del src, dst
    return 2 * size / seconds


def bytes_per_token(config, minutes: float, tokens: int, dtype_bytes: int) -> float:
    """The plan's bytes a decoded token reads on one device at `minutes` of video."""
    work = Workload(minutes=minutes, ranks=1, answer_tokens=tokens, dtype_bytes=dtype_bytes)
    return time_plan(config, work)["decode step"]["hbm_gb"] * GB


def roofline(config, minutes: float, tokens_per_s: float, bandwidth: float, tokens: int,
             dtype_bytes: int, at_minutes: float = 60.0) -> dict:  # fmt: skip
    """The share at the measured length and projected to `at_minutes` (module docstring)."""
    here = bytes_per_token(config, minutes, tokens, dtype_bytes)
    there = bytes_per_token(config, at_minutes, tokens, dtype_bytes)
    step_s = 1.0 / tokens_per_s + max(0.0, there - here) / bandwidth
    return {
        "minutes": minutes,
        "tokens_per_s": tokens_per_s,
        "bytes_per_token": here,
        "copy_bandwidth_gb_s": bandwidth / GB,
        "share": tokens_per_s * here / bandwidth,
        "projected_minutes": at_minutes,
        "projected_bytes_per_token": there,
        "projected_share": there / bandwidth / step_s,
        "goal": GOAL,
    }


def line(mode: str, r: dict) -> str:
    """One line for the report's head."""
    return (
        f"Decode roofline ({mode}): {r['tokens_per_s']:.3g} tokens/s x "
        f"{r['bytes_per_token'] / GB:.3g} GB a token at {r['minutes']:g} min over a copy's "
        f"{r['copy_bandwidth_gb_s']:.4g} GB/s = {100 * r['share']:.1f} % of the roofline; "
        f"projected {100 * r['projected_share']:.1f} % at {r['projected_minutes']:g} min "
        f"(goal {100 * r['goal']:.0f} %)."
    )
