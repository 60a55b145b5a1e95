"""The sampling plan: which frames of a video to use at a given fps, and which rank owns which of
them.

Frame indices come from *time*, never from a rounded step: sample k is taken at t_k = k / fps and
maps to frame round(t_k * video_fps) (half up), clamped to the last frame. So 1 fps on a 29.97 fps
video picks frames 0, 30, 60, 90, 120, 150, 180, 210, 240, 270, 300 (t=10 s -> 299.7), ... and stays
on time for hours, where the anchor's `step = round(avg_fps)` drifts by 3.6 s per hour; and fps
below 0.5 works (step would be 0).

With `num_frames`, the plan is instead exactly that many frames spread evenly over the whole video,
first and last included, as vLLM's video loader picks them (`np.linspace(0, frames - 1, N)` cast to
int; every frame when the video has fewer), so the same request means the same frames as there.

With `max_frames`, a longer plan is thinned uniformly the way mPLUG-Owl3's helper does it (split the
list into `max_frames` equal gaps, take the middle of each), or refused with `over_max="error"`.

The plan is a pure function of (number of frames, video fps, fps, max_frames), so every rank
computes the same one. Rank r of n owns the plan positions its layout deals it
(lvx_app/parallel/layout.py: contiguous runs, striped or zigzag), always sorted; sizes differ by at
most one frame for contiguous and striped, and a rank may own nothing when there are fewer frames
than ranks.
"""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from lvx_app.parallel.layout import owned
from lvx_app.parallel.shards import shard_bounds
from lvx_app.video.errors import CorruptVideoError, PlanTooLargeError, VideoWarning

PLAN_VERSION = 1  # bump when the index maths change: it is part of the cache key


def format_timestamp(seconds: float) -> str:
    """12.4 -> "0:12", 754 -> "12:34", 3723 -> "1:02:03" (whole seconds, rounded down)."""
    s = max(0, int(math.floor(seconds + 1e-6)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def num_samples(num_frames: int, video_fps: float, fps: float) -> int:
    """How many k >= 0 have k / fps < duration (= num_frames / video_fps); at least 1 for a
    non-empty video."""
    if num_frames <= 0:
        return 0
    x = num_frames * fps / video_fps
    return max(1, math.ceil(x - 1e-6))


def time_indices(num_frames: int, video_fps: float, fps: float) -> list[int]:
    """Frame indices for t_k = k / fps: round(k * video_fps / fps) half up, clamped, without
    repeats."""
    last = num_frames - 1
    out: list[int] = []
    ratio = video_fps / fps
    for k in range(num_samples(num_frames, video_fps, fps)):
        i = min(last, int(math.floor(k * ratio + 0.5)))
        if not out or i != out[-1]:
            out.append(i)
    return out


def uniform_thin(items: Sequence[int], n: int) -> list[int]:
    """mPLUG-Owl3's `uniform_sample`: n equal gaps over the list, the middle element of each."""
    if n >= len(items):
        return list(items)
    gap = len(items) / n
    return [items[int(i * gap + gap / 2)] for i in range(n)]


def _suggest_fps(fps: float, fit: int, total: int) -> str:
    """A round fps that keeps about `fit` of `total` frames."""
    want = fps * fit / max(total, 1)
    if want <= 0:
        return "a lower value"
    digits = max(0, 1 - int(math.floor(math.log10(want))))
    value = math.floor(want * 10**digits) / 10**digits
    return f"{value:g}" if value > 0 else f"{want:.2g}"


@dataclass(frozen=True)
class PlanShard:
    """The part of a plan one rank owns: its plan positions (sorted), their frame indices and
    timestamps."""

    rank: int
    world_size: int
    positions: tuple[int, ...]
    indices: tuple[int, ...]
    timestamps: tuple[float, ...]
    layout: str = "contiguous"
    start: int = (
        0  # plan position of the first local frame (of the next rank's first when it owns none)
    )

    def __len__(self) -> int:
        return len(self.positions)

    def chunks(self, size: int) -> list[tuple[int, list[int]]]:
        """(local offset, frame indices) runs of at most `size` frames, in order."""
        size = max(1, int(size))
        return [(o, list(self.indices[o : o + size])) for o in range(0, len(self), size)]


@dataclass(frozen=True)
class SamplingPlan:
    """Which frames of one video to use, with their timestamps (seconds from the start of the
    video)."""

    path: str
    num_video_frames: int
    video_fps: float
    requested_fps: float
    fps: float  # the rate actually sampled at (requested, or clamped to the video's fps)
    max_frames: int | None
    indices: tuple[int, ...]
    timestamps: tuple[float, ...]
    thinned: bool = False  # True when max_frames thinned the plan uniformly
    notes: tuple[str, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def duration_s(self) -> float:
        return self.num_video_frames / self.video_fps if self.video_fps > 0 else 0.0

    def shard(self, rank: int, world_size: int, layout: str = "contiguous") -> PlanShard:
        pos = tuple(owned(len(self), world_size, rank, layout))
        start = pos[0] if pos else shard_bounds(len(self), world_size, rank)[0]
        return PlanShard(
            rank,
            world_size,
            pos,
            tuple(self.indices[p] for p in pos),
            tuple(self.timestamps[p] for p in pos),
            layout,
            start,
        )

    def shards(self, world_size: int, layout: str = "contiguous") -> list[PlanShard]:
        return [self.shard(r, world_size, layout) for r in range(world_size)]

    def digest(self) -> int:
        """A 31-bit checksum of the indices, so ranks can check they planned the same thing."""
        return zlib.crc32(",".join(map(str, self.indices)).encode()) & 0x7FFFFFFF

    def to_dict(self) -> dict:
        d = asdict(self)
        d["indices"] = list(self.indices)
        d["timestamps"] = list(self.timestamps)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingPlan":
        d = dict(d)
        d["indices"] = tuple(int(i) for i in d["indices"])
        d["timestamps"] = tuple(float(t) for t in d["timestamps"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


def _check_settings(
    num_frames: int, video_fps: float, max_frames: int | None, over_max: str, name: str
) -> None:
    """One-line errors for a video without frames or frame rate and for unusable --max-frames /
    over_max."""
    if num_frames <= 0 or not (video_fps > 0 and math.isfinite(video_fps)):
        what = "no frames" if num_frames <= 0 else f"no usable frame rate ({video_fps})"
        raise CorruptVideoError(
            f"{name} has {what}; re-export it, e.g. ffmpeg -i IN -c:v libx264 -r 30 OUT.mp4"
        )
    if max_frames is not None and int(max_frames) < 1:
        raise PlanTooLargeError(
            f"--max-frames must be at least 1 (got {max_frames}); leave it out for no limit."
        )
    if over_max not in ("thin", "error"):
        raise ValueError(f"over_max must be 'thin' or 'error', not {over_max!r}")


def _cap_frames(
    indices: list[int],
    limit: int,
    over_max: str,
    rate: float,
    duration_s: float,
    name: str,
    notes: list[str],
) -> list[int]:
    """`indices` thinned uniformly to `limit` frames (noted in `notes`), or PlanTooLargeError with
    over_max="error"."""
    if over_max == "error":
        raise PlanTooLargeError(
            f"{name} at {rate:g} fps gives {len(indices)} frames, more than --max-frames {limit}; "
            f"use --fps {_suggest_fps(rate, limit, len(indices))} or raise --max-frames."
        )
    notes.append(
        f"{len(indices)} frames at {rate:g} fps exceed the cap of {limit} frames (--max-frames, "
        f"or a request's max_frames); sampling {limit} frames uniformly "
        f"(about {limit / duration_s:.3g} fps)."
    )
    return uniform_thin(indices, limit)


def spread_indices(num_frames: int, count: int) -> list[int]:
    """vLLM's uniform sampling: `count` frames evenly over `num_frames`, both ends included
    (`np.linspace(..., dtype=int)`), or every frame when there are no more than `count`."""
    if num_frames <= count:
        return list(range(num_frames))
    return np.linspace(0, num_frames - 1, count, dtype=int).tolist()


def build_plan(
    num_frames: int,
    video_fps: float,
    fps: float,
    max_frames: int | None = None,
    *,
    path: str = "",
    timestamps_fn: Callable[[list[int]], Sequence[float]] | None = None,
    over_max: str = "thin",
    warn: bool = True,
    spread: int | None = None,
) -> SamplingPlan:
    """The plan for a video of `num_frames` frames at `video_fps` (decord's `len(vr)` and
    `get_avg_fps()`).

    `timestamps_fn(indices)` gives the real start time of each frame (decord's
    `get_frame_timestamp`); without it a frame's time is index / video_fps. `over_max` is "thin"
    (uniform fallback) or "error". `spread`: exactly that many frames over the whole video
    (`spread_indices`), fps unused.
    """
    requested = float(fps)  # checked once, where it is an option (lvx_app.config.VideoConfig)
    name = path or "the video"
    _check_settings(num_frames, video_fps, max_frames, over_max, name)
    notes: list[str] = []
    rate = requested
    if spread is not None:
        indices = spread_indices(num_frames, int(spread))
        rate = len(indices) * video_fps / num_frames  # frames per second of video, on average
    else:
        if rate > video_fps:
            rate = float(video_fps)
            notes.append(
                f"--fps {requested:g} is above the video's own {video_fps:.4g} fps; "
                f"using {video_fps:.4g} (every frame)."
            )
        indices = time_indices(num_frames, video_fps, rate)
    thinned = max_frames is not None and len(indices) > int(max_frames)
    if thinned:
        indices = _cap_frames(
            indices, int(max_frames), over_max, rate, num_frames / video_fps, name, notes
        )
    if timestamps_fn is not None:
        stamps = tuple(float(t) for t in timestamps_fn(indices))
    else:
        stamps = tuple(i / video_fps for i in indices)
    if warn:
        for note in notes:
            warnings.warn(note, VideoWarning, stacklevel=2)
    return SamplingPlan(
        path=str(path),
        num_video_frames=int(num_frames),
        video_fps=float(video_fps),
        requested_fps=requested,
        fps=rate,
        max_frames=None if max_frames is None else int(max_frames),
        indices=tuple(indices),
        timestamps=stamps,
        thinned=thinned,
        notes=tuple(notes),
    )


def check_memory(
    plan_len: int, fps: float, world_size: int, bytes_per_frame: int, budget_bytes: int | None
) -> None:
    """Raise PlanTooLargeError when the biggest shard's features would not fit in `budget_bytes`
    (per rank)."""
    if budget_bytes is None or plan_len == 0 or bytes_per_frame <= 0:
        return
    per_rank = -(-plan_len // world_size)
    if per_rank * bytes_per_frame <= budget_bytes:
        return
    fit = max(0, int(budget_bytes // bytes_per_frame))
    gib = 1024**3
    gpus = -(-plan_len // fit) if fit else None
    more = f" or --gpus {gpus}" if gpus else ""
    raise PlanTooLargeError(
        f"{plan_len} frames at {fps:g} fps need {per_rank * bytes_per_frame / gib:.1f} GiB of "
        f"visual features per rank on {world_size} rank(s), but {budget_bytes / gib:.1f} GiB is "
        f"free: {fit} frames fit per rank ({fit * world_size} in all); use --fps "
        f"{_suggest_fps(fps, fit * world_size, plan_len)}{more}."
    )
