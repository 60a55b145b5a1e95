"""Benchmark video ingestion: sampled frames/s at 1 fps with 1, 2, 4 decode processes (CPU), or the
whole ingest of a long video into SigLIP-so400m-shaped features on a GPU.

    # CPU: 10-minute 720p video, decode with 1, 2, 4 processes python scripts/bench_ingest.py # GPU:
    1-hour 1080p video at 1 fps through a random so400m python scripts/bench_ingest.py --device cuda

Both print a table; `--out FILE.json` also writes the rows, the settings and the machine as JSON.

The test video is generated once (PyAV, libx264 veryfast, 30 fps, GOP 250, a panning random texture
under the frame-index blocks: ~2 Mbit/s at 720p) into --video-dir: a `--segment-s` segment (60 s;
the GPU acceptance's 10 s, encoded in seconds) is encoded and
stream-copied back to back to the requested length, so generation takes a minute or two but decoding
costs what a real video of that length costs (every frame of every GOP is decoded). Each decoded
frame is checked against its index for the first copy.

Decode timings exclude starting the worker processes (reported separately); "video fr/s" counts the
frames the decoder had to go through (duration x 30 fps), "sampled fr/s" the frames delivered,
resized to 384x384 as the processor wants.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(ROOT)
    import scripts  # noqa: F401

from lvx_app.config import VideoConfig
from lvx_app.devices import usable_cores
from lvx_app.video import DecodePool, Encoder, IngestTuning, ingest
from lvx_app.video.plan import time_indices
from lvx_app.video.synthetic import concat_video, make_video, read_index
from lvx_models.mplug_owl3.config import Owl3Config, SiglipVisionConfig
from lvx_models.mplug_owl3.vision import SiglipVisionTower, build_projector
from lvx_models.pixels import normalize
from scripts.harness import command_line, cpu_model, machine, median_seconds, timed, write_json


def make_long_video(
    video_dir: Path, minutes: float, width: int, height: int, segment_s: int = 60
) -> Path:
    video_dir.mkdir(parents=True, exist_ok=True)
    seg = video_dir / f"segment_{width}x{height}_{segment_s}s.mp4"
    out = video_dir / f"long_{width}x{height}_{minutes:g}min_{segment_s}s.mp4"
    if out.exists():
        return out
    if not seg.exists():
        t = time.perf_counter()
        print(f"generating {seg} ({segment_s} s, {width}x{height}, 30 fps) ...", flush=True)
        make_video(seg.with_suffix(".tmp.mp4"), 30 * segment_s, 30, width, height, noise=40,
                   gop=250)  # fmt: skip
        seg.with_suffix(".tmp.mp4").rename(seg)
        print(f"  {time.perf_counter() - t:.0f} s, {seg.stat().st_size / 1e6:.1f} MB", flush=True)
    concat_video(seg, out.with_suffix(".tmp.mp4"), max(1, round(minutes * 60 / segment_s)))
    out.with_suffix(".tmp.mp4").rename(out)
    print(f"{out}: {out.stat().st_size / 1e6:.0f} MB", flush=True)
    return out


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of processes (Linux /proc), so results can be read independently of other
    load."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            return float("nan")
    return total / os.sysconf("SC_CLK_TCK")


def bench_decode(
    path: Path, workers: int, fps: float, chunk: int, image_size: int, segment_s: int = 60
) -> dict:
    t0 = time.perf_counter()
    with DecodePool(workers, image_size=image_size) as pool:
        plan, _ = pool.plan(path, fps)
        for w in range(pool.num_workers):  # start every worker before timing
            pool._proc(w)
        t1 = time.perf_counter()
        n, checked, wrong = 0, 0, 0
        for offset, frames in pool.decode(path, plan.shard(0, 1).chunks(chunk)):
            n += len(frames)
            if offset < segment_s * fps:  # first copy of the segment: indices are unique there
                for j, f in enumerate(normalize(torch.from_numpy(frames))):
                    checked += 1
                    wrong += read_index(f) != plan.indices[offset + j] % (30 * segment_s)
        t2 = time.perf_counter()
        threads = pool.threads
        cpu = cpu_seconds(pool.pids())
    return dict(
        workers=workers,
        threads=threads,
        frames=n,
        start_s=t1 - t0,
        decode_s=t2 - t1,
        cpu_s=cpu,
        sampled_fps=n / (t2 - t1),
        video_fps=plan.num_video_frames / (t2 - t1),
        checked=checked,
        wrong=wrong,
    )


def bench_decord_inline(path: Path, fps: float, chunk: int, threads: int) -> dict:
    """Baseline: decord get_batch in this process, same chunks, no resize, no worker process."""
    # only this baseline decodes in the benchmark's own process (lvx keeps decord in workers)
    import decord

    t0 = time.perf_counter()
    c0 = time.process_time()
    vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=threads)
    idx = time_indices(len(vr), vr.get_avg_fps(), fps)
    n = 0
    for i in range(0, len(idx), chunk):
        n += len(vr.get_batch(idx[i : i + chunk]).asnumpy())
    dt = time.perf_counter() - t0
    return dict(
        workers="inline decord (baseline)",
        threads=threads,
        frames=n,
        start_s=0.0,
        decode_s=dt,
        cpu_s=time.process_time() - c0,
        sampled_fps=n / dt,
        video_fps=len(vr) / dt,
        checked=0,
        wrong=0,
    )


def save(args, result: dict) -> None:
    """Write the settings, the machine and the measured rows to --out (if given)."""
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        report = {"command": command_line(), "settings": settings, "machine": machine(args.device)}
        report |= result
        print(f"wrote {write_json(args.out, report)}")


def cpu_main(args) -> None:
    path = make_long_video(Path(args.video_dir), args.minutes, args.width, args.height,
                           args.segment_s)  # fmt: skip
    with DecodePool(
        1
    ) as warm:  # start the forkserver once (imports torch + decord), outside the timings
        warm.plan(path, args.fps)
    cores = usable_cores()
    load_start = os.getloadavg()[0]
    rows = [bench_decord_inline(path, args.fps, args.chunk, min(4, cores))] if args.baseline else []
    rows += [bench_decode(path, w, args.fps, args.chunk, args.image_size, args.segment_s)
             for w in args.workers]  # fmt: skip
    print(
        f"\n{args.minutes:g} min {args.width}x{args.height} at {args.fps:g} fps, chunks of "
        f"{args.chunk}, resize to {args.image_size}; {cores} cores "
        f"({cpu_model()}), load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        "| decode processes | decord threads each | sampled frames | start (s) | decode (s) | "
        "sampled fr/s | video fr/s | decoder CPU-s | video fr per CPU-s | index check |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        check = f"{r['checked'] - r['wrong']}/{r['checked']} ok" if r["checked"] else "-"
        print(
            f"| {r['workers']} | {r['threads']} | {r['frames']} | {r['start_s']:.2f} | "
            f"{r['decode_s']:.1f} | "
            f"{r['sampled_fps']:.1f} | {r['video_fps']:,.0f} | {r['cpu_s']:.1f} | "
            f"{r['video_fps'] * r['decode_s'] / r['cpu_s']:,.0f} | {check} |"
        )
    save(args, dict(video=str(path), load_avg_start=load_start, rows=rows))


def _encoder(args, dev: torch.device):
    """A random SigLIP so400m tower and 7B projector in bf16: (encode, frames/s alone, source)."""
    cfg = Owl3Config()
    tower = SiglipVisionTower(SiglipVisionConfig()).to(dev, torch.bfloat16).eval()
    proj = build_projector(cfg).to(dev, torch.bfloat16).eval()
    source = (
        "models/mplug_owl3/vision.py (SigLIP so400m, 26 layers used) + 7B projector, random weights"
    )

    def encode_fn(pv):
        return proj(tower(pv))

    x = torch.randn(args.encode_batch, 3, 384, 384, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        seconds = median_seconds(lambda: encode_fn(x), iters=5, warmup=2, device=dev)
    return encode_fn, args.encode_batch / seconds, source


def cuda_main(args) -> None:
    path = make_long_video(Path(args.video_dir), args.minutes, args.width, args.height,
                           args.segment_s)  # fmt: skip
    dev = torch.device("cuda")
    encode_fn, enc_fps, source = _encoder(args, dev)
    print(f"encoder alone: {enc_fps:.0f} frames/s (batch {args.encode_batch}, bf16) [{source}]")
    rows = []
    for workers in args.workers:
        torch.cuda.reset_peak_memory_stats(dev)
        shard, dt = timed(
            lambda: ingest(
                path, Encoder(encode_fn, model_id="bench-random"),
                VideoConfig(fps=args.fps, cache=False, decode_workers=workers), device=dev,
                dtype=torch.bfloat16, progress=True, tuning=IngestTuning(chunk_frames=args.chunk),
            ),
            dev,
        )  # fmt: skip
        rows.append(
            dict(
                decode_workers=workers,
                frames=shard.num_frames,
                features_shape=list(shard.features.shape),
                ingest_s=dt,
                frames_per_s=shard.num_frames / dt,
                peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30,
            )
        )
        print(rows[-1], flush=True)
        del shard
        torch.cuda.empty_cache()
        save(args, dict(video=str(path), source=source, encoder_frames_per_s=enc_fps, rows=rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--minutes", type=float, default=None, help="video length (default 10 on CPU, 60 on cuda)"
    )
    ap.add_argument(
        "--height", type=int, default=None, help="720 (CPU default) or 1080 (cuda default)"
    )
    ap.add_argument("--fps", type=float, default=1.0)
    ap.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated decode process counts (default 1,2,4 on CPU, 16 on cuda)",
    )
    ap.add_argument("--chunk", type=int, default=32, help="frames per decode chunk")
    ap.add_argument(
        "--segment-s", type=int, default=60, help="seconds of video encoded, then stream-copied"
    )
    ap.add_argument("--image-size", type=int, default=384)
    ap.add_argument("--encode-batch", type=int, default=32)
    ap.add_argument(
        "--baseline", action="store_true", help="also time plain in-process decord (CPU mode)"
    )
    ap.add_argument(
        "--video-dir", default=os.environ.get("LVX_BENCH_VIDEOS", "/tmp/lvx-bench-videos")
    )
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    args.minutes = args.minutes or (60 if gpu else 10)
    args.height = args.height or (1080 if gpu else 720)
    args.width = {720: 1280, 1080: 1920}.get(args.height, args.height * 16 // 9)
    args.workers = args.workers or ([16] if gpu else [1, 2, 4])
    (cuda_main if gpu else cpu_main)(args)


if __name__ == "__main__":
    main()
