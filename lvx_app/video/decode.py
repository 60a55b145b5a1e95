"""Decode sampled frames with decord in worker processes: chunked, with a per-chunk timeout and a
hard kill.

Why processes, and why a forkserver:
- decord's `get_batch` can hang forever at 100 % CPU on some H.264 files and then ignores SIGTERM
  (dmlc/decord#375, #269), and its memory grows with the request size. Only a separate process can
  be stopped: the parent waits on a pipe with a deadline and SIGKILLs a worker that misses it.
- decord (FFmpeg) is never imported into the engine process. That process has CUDA, NCCL and
  OpenMP threads, and `fork()` from a multi-threaded process copies locks held by other threads
  (deadlocks) while CUDA state cannot be forked at all. Workers therefore come from a *forkserver*:
  a small single-threaded server started once per engine process (with numpy, torch and decord
  preloaded) that forks clean workers in ~10 ms. `spawn` would also be safe but re-imports torch in
  every worker (~1 s each).
- A segfault in FFmpeg kills one worker, not the rank: it is reported like any other decode failure.

The rank's frames are split into chunks of at most `chunk_frames`; worker w of W decodes a
contiguous run of chunks in increasing frame order (one `VideoReader` per worker, never seeking
backwards). At most `prefetch` chunks per worker are in flight, so memory stays bounded however long
the video is. Each chunk is resized in the worker with the processor's own bicubic
(`lvx_models.api.resize_uint8`, the uint8 kernel that matches PIL) and comes
back as uint8 (n, 3, S, S); `normalize` runs later on the encoder's device.

A chunk that fails or times out is retried once in a fresh worker with per-frame access (`vr[i]`,
which works on the files where `get_batch` hangs); if that fails too, a `DecodeTimeoutError` /
`CorruptVideoError` names the file, the time range and the frames.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import re
import signal
import sys
import tempfile
import time
import types
import weakref
from collections import deque
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from lvx_app.defaults import DEFAULT_DECODE_TIMEOUT_S
from lvx_app.devices import usable_cores
from lvx_app.parallel.failures import RUN_DIR_ENV
from lvx_app.parallel.shards import shard_bounds
from lvx_app.regular_files import (
    NotARegularFile,
    by_descriptor,
    check_regular,
    open_regular,
    regular_file,
)
from lvx_app.video.errors import (
    CorruptVideoError,
    DecodeTimeoutError,
    NotAVideoError,
    NoVideoStreamError,
    VideoError,
    VideoNotFoundError,
)
from lvx_app.video.plan import SamplingPlan, build_plan, format_timestamp
from lvx_app.wire import Failure, Reply, Request, receive, send
from lvx_models.api import resize_uint8

DEFAULT_TIMEOUT_S = DEFAULT_DECODE_TIMEOUT_S
DEFAULT_CHUNK_FRAMES = 32
_PRELOAD = ["numpy", "torch", "decord", "lvx_app.video.decode", "lvx_models.api"]

# --------------------------------------------------------------------------------------------------
# input checks

VIDEO_EXTENSIONS = {  # what a video file may be called (one that is not still passes a sniff)
    ".mp4",
    ".m4v",
    ".mov",
    ".mkv",
    ".webm",
    ".avi",
    ".flv",
    ".ts",
    ".mts",
    ".m2ts",
    ".mpg",
    ".mpeg",
    ".wmv",
    ".asf",
    ".3gp",
    ".ogv",
    ".h264",
    ".264",
    ".hevc",
    ".gif",
}


def sniff_container(path: str | os.PathLike) -> str | None:
    """A container name from the file's first bytes, or None when it looks like no video format we
    know."""
    with regular_file(path) as f:
        head = f.read(512)
    if len(head) >= 8 and head[4:8] in (
        b"ftyp",
        b"moov",
        b"mdat",
        b"free",
        b"wide",
        b"skip",
        b"pnot",
    ):
        return "mp4/mov"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska/webm"
    if head.startswith(b"RIFF") and head[8:11] == b"AVI":
        return "avi"
    if head.startswith(b"FLV"):
        return "flv"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"\x30\x26\xb2\x75"):
        return "asf/wmv"
    if head.startswith(b"\x00\x00\x01\xba"):
        return "mpeg-ps"
    if len(head) > 188 and head[0] == 0x47 and head[188] == 0x47:
        return "mpeg-ts"
    if head.startswith((b"\x00\x00\x00\x01", b"\x00\x00\x01")):
        return "h264/hevc elementary stream"
    if head.startswith(b"GIF8"):
        return "gif"
    return None


def check_video_path(path: str | os.PathLike) -> Path:
    """Resolve `path` and raise the right VideoError for a missing, empty or obviously non-video
    file."""
    p = Path(path).expanduser()
    if not p.exists():
        hint = f" (relative to {Path.cwd()})" if not p.is_absolute() else ""
        raise VideoNotFoundError(f"Video not found: {p}{hint}; check the path.")
    if p.is_dir():
        raise VideoNotFoundError(f"{p} is a directory; pass a video file, e.g. {p}/movie.mp4.")
    try:  # a FIFO or a device would block the process that opens it
        check_regular(p)
    except NotARegularFile as exc:
        raise NotAVideoError(f"{exc}; pass a video file.") from None
    except OSError:
        pass  # said below, in the words of each case
    if not os.access(p, os.R_OK):
        raise VideoNotFoundError(f"{p} is not readable; check its permissions (chmod +r).")
    if p.stat().st_size == 0:
        raise CorruptVideoError(f"{p} is empty (0 bytes); re-download or re-export the video.")
    if sniff_container(p) is None and p.suffix.lower() not in VIDEO_EXTENSIONS:
        raise NotAVideoError(
            f"{p} is not a video file (unknown format); pass an .mp4, .mkv, .webm, .mov or .avi "
            "file."
        )
    return p.resolve()


def clean_message(text: str, limit: int = 160) -> str:
    """decord/FFmpeg errors without their '[12:00:00] /src/file.cc:218: ' prefixes, on one short
    line."""
    text = re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", str(text))
    lines = [
        ln.strip()
        for ln in text.strip().splitlines()
        if ln.strip() and not ln.startswith("Stack trace")
    ]
    line = lines[0] if lines else "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _has_video_stream(path: str) -> bool | None:
    """Whether PyAV finds a video stream in the file (None when it cannot open it either)."""
    import av  # only on the error path of a decode worker

    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        with av.open(by_descriptor(fd, path)) as container:
            return bool(container.streams.video)
    except Exception:  # noqa: BLE001 - any PyAV/FFmpeg error means "cannot tell"
        return None
    finally:
        os.close(fd)


def _open_error(path: str, detail: str) -> VideoError:
    detail = clean_message(detail)
    if _has_video_stream(path) is False:
        return NoVideoStreamError(
            f"{path} has no video stream (audio only?); pass a file with video in it."
        )
    if sniff_container(path) is None:
        return NotAVideoError(
            f"{path} is not a video decord can read ({detail}); "
            f"pass an .mp4, .mkv, .webm, .mov or .avi file."
        )
    return CorruptVideoError(
        f"{path} cannot be opened as a video ({detail}); it may be truncated or damaged: "
        "re-download it or "
        f"repair it with ffmpeg -i IN -c:v libx264 OUT.mp4."
    )


def describe_range(path: str, timestamps: Sequence[float], indices: Sequence[int]) -> str:
    """'movie.mp4 at 12:34-13:05 (frames 22620-23550)' for error messages."""
    if not indices:
        return str(path)
    return (
        f"{path} at {format_timestamp(timestamps[0])}-{format_timestamp(timestamps[-1])} "
        f"(frames {indices[0]}-{indices[-1]})"
    )


# --------------------------------------------------------------------------------------------------
# worker side


@contextlib.contextmanager
def _native_stderr_dropped() -> Iterator[None]:
    """Drop what native code writes to fd 2 meanwhile (decord's C++ logger ignores QUIET for open
    errors).

    Used only in decode worker processes around opening a file, so the user sees our one-line error
    instead of decord's '[12:00:00] /github/workspace/src/video/video_reader.cc:83: ERROR opening
    ...' above it; the exception decord raises carries the same text.
    """
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class _Worker:
    """State of one decode worker process: one open VideoReader at a time."""

    def __init__(self, threads: int, image_size: int | None, resize=resize_uint8) -> None:
        # only ever in a worker process: never in the engine (see the module docstring)
        import decord

        try:
            decord.logging.set_level(decord.logging.QUIET)
        except Exception:  # noqa: BLE001 - logging control is best effort
            pass
        self.decord = decord
        self.threads = threads
        self.image_size, self.resize = image_size, resize
        self.path: str | None = None
        self.vr = None
        self.fd: int | None = None  # the open file behind `vr`
        if image_size is not None:
            torch.set_num_threads(max(1, threads))

    def reader(self, path: str):
        if self.path != path:
            # a failed open must not leave the old path marked as open
            self.vr, self.path = (None, None)
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            try:  # the file checked regular is the one decord opens (never a FIFO swapped in)
                self.fd = open_regular(path)
            except NotARegularFile as exc:
                raise NotAVideoError(f"{exc}; pass a video file.") from None
            except OSError as exc:
                raise VideoNotFoundError(f"{path} cannot be opened ({exc.strerror})") from None
            try:
                with _native_stderr_dropped():
                    self.vr = self.decord.VideoReader(
                        by_descriptor(self.fd, path),
                        ctx=self.decord.cpu(0),
                        num_threads=self.threads,
                    )
            except Exception as exc:  # noqa: BLE001 - decord raises RuntimeError/DECORDError
                raise _open_error(path, str(exc)) from None
            self.path = path
        return self.vr

    def plan(
        self,
        path: str,
        fps: float,
        max_frames: int | None,
        over_max: str,
        spread: int | None = None,
    ) -> dict:
        vr = self.reader(path)
        n, vfps = len(vr), float(vr.get_avg_fps())

        def stamps(idx: list[int]) -> list[float]:
            if not idx:
                return []
            ts = np.asarray(vr.get_frame_timestamp(idx), dtype=np.float64)[:, 0]
            if not np.all(np.isfinite(ts)) or np.any(np.diff(ts) < 0):
                return [i / vfps for i in idx]  # no usable pts: nominal times
            return [round(t, 6) for t in ts.tolist()]

        plan = build_plan(
            n,
            vfps,
            fps,
            max_frames,
            path=path,
            timestamps_fn=stamps,
            over_max=over_max,
            warn=False,
            spread=spread,
        )
        try:  # make sure the first and last planned frames decode (catches truncated files early)
            first = vr[plan.indices[0]].shape
            vr[plan.indices[-1]]
            vr.seek(0)
        except Exception as exc:  # noqa: BLE001
            raise CorruptVideoError(
                f"{path} opens but its frames do not decode ({clean_message(str(exc))}); "
                f"re-download it or repair it with ffmpeg -i IN -c:v libx264 OUT.mp4."
            ) from None
        return {"plan": plan.to_dict(), "height": int(first[0]), "width": int(first[1])}

    def decode(self, path: str, indices: list[int], mode: str) -> np.ndarray:
        vr = self.reader(path)
        if mode == "batch":
            frames = vr.get_batch(indices).asnumpy()
        # frame by frame: slower, but works where get_batch hangs, and names the frame that fails
        else:
            out = []
            for i in indices:
                try:
                    out.append(vr[i].asnumpy())
                except Exception as exc:  # noqa: BLE001
                    raise RuntimeError(f"frame {i}: {clean_message(str(exc))}") from None
            frames = np.stack(out)
        if self.image_size is None:
            return np.ascontiguousarray(frames)
        return self.resize(frames, self.image_size).numpy()


def _worker_main(
    conn, threads: int, image_size: int | None, worker_class: type[_Worker], resize=resize_uint8
) -> None:
    """Answer `Request`s ("plan" or "decode") until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills us
    worker = worker_class(threads, image_size, resize)
    ops = {"plan": worker.plan, "decode": worker.decode}
    while True:
        try:
            request = receive(conn)
        except (EOFError, OSError):
            return
        send(conn, _answer(ops, request))


def _answer(ops: dict[str, Callable[..., Any]], request: Request) -> Reply | Failure:
    """The worker's answer to one request: its result, or its error as one line."""
    try:
        return Reply(ops[request.command](**request.args), id=request.id)
    except VideoError as exc:
        return Failure.of(exc, id=request.id)
    except Exception as exc:  # noqa: BLE001 - the parent names the time range
        line = clean_message(str(exc)) or type(exc).__name__
        return Failure.of(exc, id=request.id, message=line)


# --------------------------------------------------------------------------------------------------
# parent side

_POOLS: "weakref.WeakSet[DecodePool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    _socket_folder()
    return ctx


# an AF_UNIX socket's path holds at most 107 bytes on Linux; multiprocessing names the forkserver's
# `<tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX`
_SOCKET_PATH_MAX, _SOCKET_NAME_LEN = 107, 32


def _fits(folder: str) -> bool:
    return len(os.fsencode(folder)) + _SOCKET_NAME_LEN <= _SOCKET_PATH_MAX


def _socket_folder() -> None:
    """Where multiprocessing puts the forkserver's socket folder (`pymp-*`), once per process: in a
    rank, its group's run folder, which the launcher clears when the group ends however it ends
    (a rank killed by Ctrl-C or a restart never runs the exit hook that would remove it from the
    temporary folder); under a long TMPDIR (a job's scratch folder, a test's folder), where the
    socket's path would be too long ("AF_UNIX path too long" when the first video opens), /tmp,
    as newer Pythons do. The folder multiprocessing made first is kept."""
    run_dir = os.environ.get(RUN_DIR_ENV, "")
    if run_dir and os.path.isdir(run_dir) and _fits(run_dir):
        base = run_dir
    elif not _fits(tempfile.gettempdir()) and os.access("/tmp", os.W_OK | os.X_OK):
        base = "/tmp"
    else:
        return
    given, tempfile.tempdir = tempfile.tempdir, base
    try:
        mp_util.get_temp_dir()  # multiprocessing keeps (and removes at exit) the folder made here
    finally:
        tempfile.tempdir = given


@contextlib.contextmanager
def _main_unseen() -> Iterator[None]:
    """Start processes as if `__main__` were empty: multiprocessing otherwise runs the user's script
    again in the forkserver and in every worker, and a script without an
    `if __name__ == "__main__":` guard (the README's example) would open an engine in each. The
    workers need nothing from it: what they run comes from lvx's own modules."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _local_ranks(local_world_size: int | None = None) -> int:
    return max(1, local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def default_workers(local_world_size: int | None = None) -> int:
    """Decode processes per rank: the CPU cores shared by the ranks on this node, at most 8."""
    return max(1, min(8, usable_cores() // _local_ranks(local_world_size)))


def default_threads(workers: int, local_world_size: int | None = None) -> int:
    """Decoder threads per decode process: the node's cores shared by every rank's workers, at most
    4. (Each rank's workers taking all the cores oversubscribes a node of several ranks, and frame
    threading then costs about twice the CPU per frame.)"""
    return max(1, min(4, usable_cores() // (max(1, workers) * _local_ranks(local_world_size))))


class _Proc:
    def __init__(
        self, ctx, threads: int, image_size: int | None, worker_class: type, resize=resize_uint8
    ) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main,
            args=(child, threads, image_size, worker_class, resize),
            daemon=not mp.current_process().daemon,
            name="lvx-decode",
        )
        with _main_unseen():
            self.proc.start()
        child.close()
        self.conn = parent
        self.outstanding: deque = deque()  # (req_id, chunk_id, mode)
        self.deadline: float | None = None

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # SIGKILL: decord may ignore SIGTERM
        self.proc.join(timeout=5)
        self.conn.close()


class DecodePool:
    """A few decode worker processes for one rank. Use as a context manager, or call `close()`.

    `image_size` = S makes workers return uint8 (n, 3, S, S) made by `resize(frames, S)` (the model
    family's `FramePrep.resize`: by default mPLUG-Owl3's bicubic square); None returns the decoded
    frames as they are, uint8 (n, H, W, 3).
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        threads: int | None = None,
        image_size: int | None = None,
        worker_class: type[_Worker] = _Worker,
        resize=resize_uint8,
    ) -> None:
        self.num_workers = max(1, int(workers or default_workers()))
        self.threads = int(threads) if threads else default_threads(self.num_workers)
        self.image_size, self.resize = image_size, resize
        self.worker_class = worker_class  # what each worker process runs (tests pass faulty ones)
        self._ctx = _context()
        self._procs: list[_Proc | None] = [None] * self.num_workers
        self._ids = itertools.count()
        self.closed = False
        _POOLS.add(self)

    # -- lifecycle
    def _proc(self, w: int) -> _Proc:
        if self.closed:
            raise RuntimeError("DecodePool is closed")
        p = self._procs[w]
        if p is None or not p.proc.is_alive():
            if p is not None:
                p.kill()
            p = self._procs[w] = _Proc(
                self._ctx, self.threads, self.image_size, self.worker_class, self.resize
            )
        return p

    def _restart(self, w: int) -> _Proc:
        p = self._procs[w]
        if p is not None:
            p.kill()
        self._procs[w] = None
        return self._proc(w)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in self._procs:
            if p is not None:
                p.kill()
        self._procs = [None] * self.num_workers

    def __enter__(self) -> "DecodePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self._procs if p is not None and p.proc.is_alive()]

    # -- one request, synchronously (probe/plan)
    def _call(self, w: int, op: str, timeout_s: float, what: str, **kwargs) -> Any:
        p = self._proc(w)
        send(p.conn, Request(op, kwargs, next(self._ids)))
        if not p.conn.poll(timeout_s):
            self._restart(w)
            raise DecodeTimeoutError(
                f"{what} did not answer within {timeout_s:g} s and was killed; re-encode the "
                f"file (ffmpeg -i IN -c:v libx264 OUT.mp4) or raise --decode-timeout."
            )
        try:
            answer = receive(p.conn)
        except (EOFError, OSError):
            code = p.proc.exitcode
            self._restart(w)
            raise CorruptVideoError(
                f"{what}: the decoder process stopped (exit code {code}) before it answered; if "
                "other videos open, this file may be damaged (repair it with ffmpeg -i IN -c:v "
                "libx264 OUT.mp4)."
            ) from None
        if isinstance(answer, Failure):
            raise answer.error(VideoError) or CorruptVideoError(f"{what}: {answer.message}")
        return answer.value

    def plan(
        self,
        path: str | os.PathLike,
        fps: float,
        max_frames: int | None = None,
        *,
        over_max: str = "thin",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        spread: int | None = None,
    ) -> tuple[SamplingPlan, tuple[int, int]]:
        """Open the video in a worker and build its sampling plan (`spread`: exactly that many
        frames over the whole video); returns (plan, (height, width))."""
        out = self._call(
            0,
            "plan",
            timeout_s,
            f"Opening {path}",
            path=str(path),
            fps=fps,
            max_frames=max_frames,
            over_max=over_max,
            spread=spread,
        )
        return SamplingPlan.from_dict(out["plan"]), (out["height"], out["width"])

    # -- the stream of chunks
    def decode(
        self,
        path: str | os.PathLike,
        chunks: Sequence[tuple[int, Sequence[int]]],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        prefetch: int = 2,
        time_of: Callable[[int], float] | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (offset, frames) for every (offset, frame indices) chunk, in completion order.

        `time_of(offset)` gives the timestamp of a chunk position for error messages (default index
        / 1). Frames are uint8 (n, 3, S, S) with `image_size`, else (n, H, W, 3).
        """
        chunks = [(int(o), [int(i) for i in idx]) for o, idx in chunks]
        if not chunks:
            return
        yield from _ChunkStream(self, str(path), chunks, timeout_s, prefetch, time_of)


class _ChunkStream:
    """One `DecodePool.decode` call: which worker owes which chunk, the deadlines, and the per-frame
    retries.

    Worker w of W decodes the contiguous run `shard_bounds(len(chunks), W, w)` of chunks, with up to
    `prefetch` requests in flight. A worker that misses its deadline, fails or dies is restarted;
    its chunk is retried once frame by frame, then reported as a `DecodeTimeoutError` /
    `CorruptVideoError` naming the time range.
    """

    def __init__(
        self,
        pool: DecodePool,
        path: str,
        chunks: list[tuple[int, list[int]]],
        timeout_s: float,
        prefetch: int,
        time_of: Callable[[int], float] | None,
    ) -> None:
        self.pool, self.path, self.chunks = pool, path, chunks
        self.timeout_s, self.prefetch, self.time_of = timeout_s, prefetch, time_of
        n_workers = min(pool.num_workers, len(chunks))
        self.todo: list[deque] = []
        for w in range(n_workers):
            lo, hi = shard_bounds(len(chunks), n_workers, w)
            self.todo.append(deque((c, "batch") for c in range(lo, hi)))
        self.procs = {w: pool._proc(w) for w in range(n_workers)}
        self.remaining = len(chunks)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        try:
            while self.remaining:
                now = time.monotonic()
                self._send(now)
                busy = [p for p in self.procs.values() if p.outstanding]
                wait_s = max(0.0, min(p.deadline for p in busy) - now)
                ready = set(wait_any([p.conn for p in busy], timeout=wait_s))
                for w, p in list(self.procs.items()):
                    if p.outstanding:
                        yield from self._collect(w, p, ready)
        finally:  # abandoned early (consumer stopped, error): drop workers that still owe answers
            for w, p in self.procs.items():
                if p.outstanding and not self.pool.closed:
                    self.pool._restart(w)

    def _send(self, now: float) -> None:
        """Keep every worker busy with up to `prefetch` requests."""
        for w, p in self.procs.items():
            while self.todo[w] and len(p.outstanding) < self.prefetch:
                cid, mode = self.todo[w].popleft()
                req = next(self.pool._ids)
                args = {"path": self.path, "indices": self.chunks[cid][1], "mode": mode}
                send(p.conn, Request("decode", args, req))
                if not p.outstanding:
                    p.deadline = now + self.timeout_s
                p.outstanding.append((req, cid, mode))

    def _collect(self, w: int, p: _Proc, ready: set) -> Iterator[tuple[int, np.ndarray]]:
        """Worker w's oldest request: yield its chunk when answered, retry or raise when it failed
        or is late."""
        req, cid, mode = p.outstanding[0]
        if p.conn in ready:
            try:
                answer = receive(p.conn)
            except (EOFError, OSError):
                self._fail(
                    w,
                    cid,
                    mode,
                    f"the decoder process died with exit code {p.proc.exitcode}",
                    False,
                )
                return
            if answer.id != req:
                raise RuntimeError(f"decode worker answered request {answer.id}, expected {req}")
            if isinstance(answer, Failure):
                self._fail(w, cid, mode, answer.message, False)
                return
            p.outstanding.popleft()
            p.deadline = time.monotonic() + self.timeout_s
            self.remaining -= 1
            paused = time.monotonic()
            yield self.chunks[cid][0], answer.value
            pause = time.monotonic() - paused  # the consumer's time does not count against workers
            for q in self.procs.values():
                if q.deadline is not None:
                    q.deadline += pause
        elif time.monotonic() >= p.deadline:
            self._fail(w, cid, mode, "timed out", True)

    def _fail(self, w: int, cid: int, mode: str, reason: str, timed_out: bool) -> None:
        """Chunk `cid` failed on worker w: restart it and retry per frame once, else raise."""
        p = self.procs[w]
        requeue = [(c, m) for _, c, m in p.outstanding if c != cid]
        self.procs[w] = self.pool._restart(w)
        offset, idx = self.chunks[cid]
        if mode == "batch":
            self.todo[w].extendleft(reversed([(cid, "frames")] + requeue))
            return
        time_of, path = self.time_of, self.path
        stamps = (
            [time_of(offset), time_of(offset + len(idx) - 1)] if time_of else [float("nan")] * 2
        )
        where = (
            describe_range(path, stamps, idx) if time_of else f"{path} (frames {idx[0]}-{idx[-1]})"
        )
        if timed_out:
            raise DecodeTimeoutError(
                f"Decoding {where} hung for {self.timeout_s:g} s (also frame by frame) and was "
                "killed; re-encode the "
                "file (ffmpeg -i IN -c:v libx264 OUT.mp4), or raise --decode-timeout if the "
                "machine is just slow."
            )
        raise CorruptVideoError(
            f"Decoding {where} failed ({reason}); the file is damaged there: re-download it "
            f"or repair it with ffmpeg -i IN -c:v libx264 OUT.mp4."
        )
