"""`ingest()`: the one call that turns a video file into this rank's resident visual features.

    encoder = Encoder(model.encode_images, image_size=384, model_id="mPLUG/mPLUG-Owl3-7B-241101")
    shard = ingest("movie.mp4", encoder, VideoConfig(fps=1))
    shard.features        # (n_local, T, H) on the rank's device: E_local, the rank's K/V source
    shard.plan            # the whole video's plan (every rank's frames and timestamps)

Every rank of the group calls it with the same arguments. Each rank:
1. checks the inputs (one-line `VideoError`s), looks up its shard in the cache;
2. on a miss, opens the video in a decode worker, builds the (deterministic) plan and takes the
frames its layout deals it;
3. decodes its chunks in worker processes and streams them through the encoder into E_local;
4. writes its shard to the cache.
With several ranks, one small all-reduce per step keeps the ranks in step (`Agreement.agreed`): it
carries the progress counts shown on rank 0 and an error flag, so a failure on any rank is raised on
every rank with the same message instead of leaving the others waiting in a collective.
`_RankIngest` holds these steps; `ingest()` runs them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lvx_app.cache import CachedShard, FeatureCache, FeatureKey
from lvx_app.config import VideoConfig
from lvx_app.devices import default_dtype
from lvx_app.parallel import get_rank, get_world_size
from lvx_app.parallel.layout import check_layout
from lvx_app.video.decode import DEFAULT_CHUNK_FRAMES, DecodePool, check_video_path
from lvx_app.video.encode import EncodeFn, ShardEncoder, frame_numel
from lvx_app.video.errors import RemoteRankError, VideoError, VideoWarning
from lvx_app.video.plan import PLAN_VERSION, SamplingPlan, check_memory, format_timestamp
from lvx_app.wire import Failure
from lvx_models.api import FramePrep, square_prep

log = logging.getLogger(__name__)


@dataclass
class VisualShard:
    """One rank's visual features and where its frames sit in the video."""

    features: torch.Tensor  # (n_local, T, H) on the rank's device
    frame_indices: torch.Tensor  # (n_local,) int64: the video's frame numbers (decord indices)
    timestamps: torch.Tensor  # (n_local,) float64: seconds from the start of the video
    rank: int
    world_size: int
    from_cache: bool
    plan: SamplingPlan  # the whole plan: all ranks' frames, in order
    frame_offset: int  # plan position of this rank's first frame (its global frame number)
    cache_key: FeatureKey | None = None  # its feature-cache key (None when the cache is off)
    layout: str = (
        "contiguous"  # how the plan's frames are dealt to the ranks (lvx_app/parallel/layout.py)
    )
    # the encoder's header features of the frames when it gives any and they were encoded (not
    # read from the cache): held only until the prompt's first rows are prefilled
    header_features: torch.Tensor | None = None

    @property
    def num_frames(self) -> int:
        return int(self.features.shape[0])

    @property
    def positions(self) -> torch.Tensor:
        """Plan positions (global frame numbers 0..len(plan)-1) of the local frames, sorted."""
        return torch.tensor(
            self.plan.shard(self.rank, self.world_size, self.layout).positions, dtype=torch.int64
        )

    def labels(self) -> list[str]:
        """ "12:34"-style timestamps of the local frames."""
        return [format_timestamp(t) for t in self.timestamps.tolist()]


@dataclass(frozen=True)
class IngestProgress:
    """Counts for all ranks together. `stage` is "open", "ingest" or "done"."""

    stage: str
    done: int  # frames decoded and encoded (or loaded from the cache)
    total: int
    elapsed_s: float
    from_cache: bool = False

    @property
    def rate(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0


ProgressFn = Callable[[IngestProgress], None]


class RichProgress:
    """A rich progress bar: frames decoded+encoded across all ranks, and the rate."""

    def __init__(self, title: str) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("frames"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.title = title
        self.task = None

    def __call__(self, p: IngestProgress) -> None:
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task(self.title, total=p.total or None, rate="")
        rate = "from cache" if p.from_cache else (f"{p.rate:,.0f} frames/s" if p.done else "")
        self.progress.update(self.task, completed=p.done, total=p.total or None, rate=rate)
        if p.stage == "done":
            self.close()

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()


def _reporter(progress: bool | ProgressFn | None, rank: int, title: str) -> ProgressFn | None:
    if callable(progress):
        return progress
    if progress is None:
        progress = sys.stderr.isatty()
    return RichProgress(title) if progress and rank == 0 else None


def idle_ranks_note(frames: int, world: int) -> str | None:
    """The warning for more ranks than frames: the extra ranks hold an empty shard and only take
    part in the collectives."""
    if frames >= world:
        return None
    return (
        f"{world} ranks for {frames} frame(s): {world - frames} rank(s) hold no frames and idle; "
        f"use {frames} rank(s) (--gpus/--ranks), or sample more frames (--fps, --max-frames)"
    )


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def auto_memory_budget(device: torch.device) -> int | None:
    """Free memory for features on `device`: free GPU memory minus 2 GiB, or 80 % of available
    RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, free - (2 << 30))
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.8)
    except (ValueError, OSError, AttributeError):
        return None


def rank_memory_budget(device: torch.device, stated_gib: float | None) -> int | None:
    """The bytes a rank may use: `--rank-memory-gib` when it is given, else what is free now
    (`auto_memory_budget`)."""
    return auto_memory_budget(device) if stated_gib is None else int(stated_gib * 2**30)


class Agreement:
    """The ranks' per-step agreement: one small all-reduce of counts plus an error flag."""

    def __init__(self, group) -> None:
        self.group = group
        self.on = get_world_size(group) > 1
        backend = dist.get_backend(group) if self.on else None
        self.device = default_device() if backend == "nccl" else torch.device("cpu")

    def reduce(self, values: list[int], op=None) -> list[int]:
        if not self.on:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def raise_all(self, err: BaseException | None) -> None:
        """Every rank calls this after a collective showed an error flag: all raise the first rank's
        error (a `VideoError` as its own type, anything else as a `RemoteRankError` naming it)."""
        mine = None if err is None else Failure.of(err)
        if self.on:
            every: list[Failure | None] = [None] * get_world_size(self.group)
            dist.all_gather_object(every, mine, group=self.group)
        else:
            every = [mine]
        if err is not None:
            raise err
        rank, first = next((r, e) for r, e in enumerate(every) if e is not None)
        raise first.error(VideoError) or RemoteRankError(
            f"rank {rank} failed while ingesting the video: {first.name}: {first.message}"
        )

    @contextlib.contextmanager
    def agreed(self, counts: list[int], op=None) -> Iterator[list[int]]:
        """Run the block on this rank, then all-reduce [failed, *counts] (sum, or `op`) so no rank
        is left waiting.

        If the block failed on any rank, every rank raises the first failing rank's error
        (`raise_all`; a failing rank re-raises its own); otherwise `counts` holds the reduced values
        afterwards. The block fills `counts` in place and never changes its length, so the
        collective matches on every rank even when it stopped half-way.
        """
        err: BaseException | None = None
        try:
            yield counts
        except BaseException as exc:  # noqa: BLE001 - shared with the other ranks, re-raised
            err = exc
        reduced = self.reduce([int(err is not None), *counts], op)
        if reduced[0]:
            self.raise_all(err)
        counts[:] = reduced[1:]


@dataclass(frozen=True)
class Encoder:
    """What turns frames into features, and what names it in the feature cache (another encoder
    never hits: its id, revision and weights' fingerprint are in the key)."""

    fn: EncodeFn  # pixel values (n, 3, S, S) on the device in the dtype -> features (n, T, H)
    image_size: int = 384  # S
    model_id: str = "unknown"
    revision: str = ""
    fingerprint: str = ""
    prep: FramePrep | None = None  # the family's frame preparation (None: a bicubic square of S)

    @property
    def frame_prep(self) -> FramePrep:
        return self.prep or square_prep(self.image_size)


@dataclass(frozen=True)
class IngestTuning:
    """Knobs of the decode-and-encode pipeline that benchmarks and tests turn; the defaults are what
    the product runs."""

    over_max: str = "thin"  # a plan over --max-frames is thinned uniformly, or "error" refuses it
    chunk_frames: int = DEFAULT_CHUNK_FRAMES  # frames decoded per request to a decode worker
    decode_threads: int | None = None  # decord threads per worker (default: by the cores)
    encode_batch: int | None = None  # frames per encoder call (default: the encoder's choice)
    # per rank: "auto" = free GPU memory - 2 GiB (80 % of free RAM on CPU); None = no check
    memory_budget_bytes: int | None | str = "auto"


@dataclass
class _RankIngest:
    """One rank's part of `ingest()` as named steps; every rank runs them in the same order (they
    meet in `Agreement`)."""

    path: str | os.PathLike
    encoder: Encoder
    video: VideoConfig
    tuning: IngestTuning
    device: torch.device
    dtype: torch.dtype
    layout: str
    store: FeatureCache | None
    pool: DecodePool | None
    report: ProgressFn | None
    sync: Agreement
    rank: int
    world: int
    t0: float = field(default_factory=time.monotonic)
    own_pool: bool = field(init=False)
    vpath: Path | None = None
    key: FeatureKey | None = None
    cached: CachedShard | None = None
    plan: SamplingPlan | None = None
    chunks: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.own_pool = self.pool is None

    def _progress(self, stage: str, done: int, total: int) -> None:
        if self.report:
            self.report(
                IngestProgress(
                    stage, done, total, time.monotonic() - self.t0, self.cached is not None
                )
            )

    # 1. check the inputs, look the shard up in the cache, plan on a miss
    def look_up(self) -> None:
        self.vpath = check_video_path(self.path)
        enc, video = self.encoder, self.video
        if self.store is not None:
            self.key = FeatureKey.make(
                self.vpath,
                fps=video.fps,
                max_frames=video.max_frames,
                num_frames=video.num_frames,
                model_id=enc.model_id,
                model_revision=enc.revision,
                dtype=self.dtype,
                world_size=self.world,
                rank=self.rank,
                image_size=enc.image_size,
                over_max=self.tuning.over_max,
                encoder=enc.fingerprint,
                layout=self.layout,
                plan_version=PLAN_VERSION,
            )
            self.cached = self.store.load(self.key, device=self.device)
        if self.cached is not None:
            self.plan = SamplingPlan.from_dict(self.cached.plan)
        else:
            self._plan()

    def _plan(self) -> None:
        self._progress("open", 0, 0)
        size, tuning, video = self.encoder.image_size, self.tuning, self.video
        prep = self.encoder.frame_prep
        if self.pool is None:
            self.pool = DecodePool(
                video.decode_workers,
                threads=tuning.decode_threads,
                image_size=size,
                resize=prep.resize,
            )
        elif self.pool.image_size != size or self.pool.resize is not prep.resize:
            raise ValueError(
                f"the DecodePool resizes to {self.pool.image_size} with "
                f"{getattr(self.pool.resize, '__name__', self.pool.resize)}"
                f", ingest wants {size} with {getattr(prep.resize, '__name__', prep.resize)}"
            )
        plan, _ = self.pool.plan(
            self.vpath,
            video.fps,
            video.max_frames,
            over_max=tuning.over_max,
            timeout_s=video.decode_timeout_s,
            spread=video.num_frames,
        )
        self.plan = plan
        budget = tuning.memory_budget_bytes
        budget = auto_memory_budget(self.device) if budget == "auto" else budget
        if budget is not None:
            numel = frame_numel(self.encoder.fn, size, self.device, self.dtype)
            per_frame = numel * self.dtype.itemsize
            check_memory(len(plan), plan.fps, self.world, per_frame, int(budget))
        self.chunks = plan.shard(self.rank, self.world, self.layout).chunks(tuning.chunk_frames)

    def plan_counts(self) -> list[int]:
        """[chunks to decode, plan length, plan digest, -length, -digest]: under MAX, -max(-x) =
        min(x), so the ranks see whether they all planned the same frames."""
        n = len(self.plan) if self.plan is not None else 0
        digest = self.plan.digest() if self.plan is not None else 0
        return [len(self.chunks), n, digest, -n, -digest]

    # 2. agree across ranks
    def check_same_plan(self, agreed: list[int]) -> None:
        if agreed[1] != -agreed[3] or agreed[2] != -agreed[4]:
            raise VideoError(
                f"the ranks planned different frames for {self.path}: every node must see the same "
                "file (same size and content); copy it to each node or use a shared file system."
            )

    # 3. decode and encode in lockstep: one agreement per step, as many steps as the busiest rank
    #    has chunks
    def decode_and_encode(self, steps: int) -> ShardEncoder | None:
        assert self.plan is not None
        shard = self.plan.shard(self.rank, self.world, self.layout)
        encoder = (
            None
            if self.cached is not None
            else ShardEncoder(
                self.encoder.fn,
                len(shard),
                image_size=self.encoder.image_size,
                device=self.device,
                dtype=self.dtype,
                batch_size=self.tuning.encode_batch,
                prep=self.encoder.frame_prep,
            )
        )
        stream = iter(())
        if self.chunks:
            assert self.pool is not None
            stream = self.pool.decode(
                self.vpath,
                self.chunks,
                timeout_s=self.video.decode_timeout_s,
                time_of=lambda off: shard.timestamps[off],
            )
        done = 0
        # cache-hit ranks count their frames in step 0
        first = len(shard) if self.cached is not None else 0
        for step in range(max(1, steps)):
            with self.sync.agreed([first if step == 0 else 0]) as new:
                item = next(stream, None) if encoder is not None else None
                if item is not None:
                    new[0] += encoder.add(*item)
            done += new[0]
            self._progress("ingest", done, len(self.plan))
        return encoder

    # 4. keep the result (and save a freshly encoded shard in the cache)
    def result(self, encoder: ShardEncoder | None) -> VisualShard:
        plan = self.plan
        assert plan is not None
        shard = plan.shard(self.rank, self.world, self.layout)
        if self.cached is not None:
            features, idx, ts = (
                self.cached.features,
                self.cached.frame_indices,
                self.cached.timestamps,
            )
        else:
            assert encoder is not None
            features = encoder.result()
            idx = torch.tensor(shard.indices, dtype=torch.int64)
            ts = torch.tensor(shard.timestamps, dtype=torch.float64)
            self._save(features, idx, ts, shard.start)
        self._progress("done", len(plan), len(plan))
        return VisualShard(
            features,
            idx,
            ts,
            self.rank,
            self.world,
            self.cached is not None,
            plan,
            shard.start,
            self.key,
            self.layout,
            encoder.header_features if encoder is not None else None,
        )

    def _save(
        self, features: torch.Tensor, idx: torch.Tensor, ts: torch.Tensor, offset: int
    ) -> None:
        if self.store is None or self.key is None:
            return
        plan = self.plan.to_dict()  # a store that cannot write says so once and goes on
        self.store.save(
            self.key, features, idx, ts, plan=plan, frame_offset=offset, video=self.vpath
        )

    def close(self) -> None:
        if isinstance(self.report, RichProgress):
            self.report.close()
        if self.own_pool and self.pool is not None:
            self.pool.close()


def ingest(
    path: str | os.PathLike,
    encoder: Encoder,
    video: VideoConfig = VideoConfig(),
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    layout: str = "contiguous",
    group: dist.ProcessGroup | None = None,
    pool: DecodePool | None = None,
    progress: bool | ProgressFn | None = None,
    tuning: IngestTuning = IngestTuning(),
    planned: Callable[[SamplingPlan], None] | None = None,
) -> VisualShard:
    """Decode and encode (or load from the cache) this rank's frames of `path`, sampled as `video`
    says (fps, max_frames, the decode timeout and workers, the cache and its folder).

    `layout`: which plan positions this rank holds (contiguous | striped | zigzag; in the cache
    key). `pool`: a DecodePool reused across calls (it must resize to the encoder's image size);
    else one is made and closed here. `progress`: None = a rich bar on rank 0 when stderr is a
    terminal, True/False, or a callable taking IngestProgress (global counts). Raises a VideoError
    subclass, on every rank, for anything the user can fix. `planned`: called on every rank with
    the whole plan before any frame is decoded, so a caller's check refuses a video in a second,
    not after its encode (what it raises, every rank raises).
    """
    rank, world = get_rank(group), get_world_size(group)
    device = torch.device(device) if device else default_device()
    title = f"Ingesting {Path(path).name}" + (f" on {world} ranks" if world > 1 else "")
    job = _RankIngest(
        path=path,
        encoder=encoder,
        video=video,
        tuning=tuning,
        device=device,
        dtype=dtype or default_dtype(device),
        layout=check_layout(layout),
        store=FeatureCache(video.cache_dir) if video.cache else None,
        pool=pool,
        report=_reporter(progress, rank, title),
        sync=Agreement(group),
        rank=rank,
        world=world,
    )
    try:
        with job.sync.agreed([0] * 5, dist.ReduceOp.MAX) as agreed:
            job.look_up()
            if planned is not None:
                planned(job.plan)
            notes = [*job.plan.notes, idle_ranks_note(len(job.plan), world)]
            for note in filter(None, notes) if rank == 0 else ():
                warnings.warn(note, VideoWarning, stacklevel=2)
            agreed[:] = job.plan_counts()
        job.check_same_plan(agreed)
        shard_encoder = job.decode_and_encode(steps=agreed[0])
        return job.result(shard_encoder)
    finally:
        job.close()
