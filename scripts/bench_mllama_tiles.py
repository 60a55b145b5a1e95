"""What the published empty tiles cost Llama-3.2-Vision's vision tower per video frame.

A frame is one tile. The published processor hands the tower `max_num_tiles` tiles (the image's
and empty ones, which the real tokens attend to), and lvx runs a frame so; only the frame's tile
becomes visual keys. The one-tile shortcut (the frame's tile alone) is not the published
computation: it runs here only to show the difference.

- measured: seconds per frame of the tower (`MllamaVisionModel`) at the tiny checkpoint's shapes,
  float32 on CPU, published padding vs one tile, interleaved (the order turns every round),
  medians;
- planned: FLOPs per frame and ingest seconds (tower + projector) per hour of video at 1 fps for
  the 11B on 1 and 8 GPUs, from the time plan (`scripts/memory_plan.py`'s `time_plan`, which reads
  the config's `vision_tokens_per_frame`), against the same plan for one tile a frame.

    python3 scripts/bench_mllama_tiles.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(ROOT)
    import scripts  # noqa: F401

from lvx_app.engine.memory_plan import Workload, param_counts
from lvx_models.mllama.config import MllamaConfig
from lvx_models.mllama.modeling import MllamaModel
from lvx_models.mllama.published import RELEASES
from lvx_models.mllama.tiny import random_weights, tiny_config
from scripts.bench_vision import time_interleaved
from scripts.harness import machine, markdown
from scripts.memory_plan import time_plan

INGEST = "ingest (vision tower + projector)"


def tower_runs(cfg: MllamaConfig, seed: int = 0):
    """{published, one tile}: frames (N, 3, S, S) -> the tower's features of each frame's tile."""
    model = MllamaModel(cfg).eval()
    model.load_state_dict(random_weights(cfg, seed, torch.float32), strict=True)
    tower, tiles = model.vision_model, cfg.vision.max_num_tiles

    def published(px: torch.Tensor) -> torch.Tensor:
        pixels = px.new_zeros((px.shape[0], tiles, *px.shape[1:]))
        pixels[:, 0] = px
        mask = torch.zeros(px.shape[0], tiles, dtype=torch.int64)
        mask[:, 0] = 1
        return tower(pixels, torch.ones(px.shape[0], dtype=torch.int64), mask, keep=1)[:, 0]

    def one_tile(px: torch.Tensor) -> torch.Tensor:
        n = px.shape[0]
        ones = torch.ones(n, dtype=torch.int64)
        return tower(px[:, None], ones, ones[:, None])[:, 0]

    return {"published (4 tiles)": published, "one tile (not published)": one_tile}


def measured(frames: int, repeats: int) -> list[dict]:
    cfg = tiny_config(first_special=500)
    px = torch.randn(frames, 3, cfg.vision.image_size, cfg.vision.image_size)
    runs = tower_runs(cfg)
    with torch.inference_mode():
        for fn in runs.values():
            fn(px)  # warm-up
        times = time_interleaved(runs, px, repeats)
    tokens, tiles = cfg.vision.tower_tokens_per_frame, cfg.vision.max_num_tiles
    rows = []
    for name, (wall, cpu) in times.items():
        rows.append(
            {
                "tower": name,
                "tokens/frame": tokens if name.startswith("published") else tokens // tiles,
                "us/frame (wall)": 1e6 * statistics.median(wall) / frames,
                "us/frame (CPU)": 1e6 * statistics.median(cpu) / frames,
            }
        )
    return rows


def planned() -> list[dict]:
    """Tower + projector FLOPs per frame and ingest seconds per hour at 1 fps, 11B, 1 and 8 GPUs."""
    cfg = RELEASES["Llama-3.2-11B-Vision"]
    one = replace(cfg, vision=replace(cfg.vision, max_num_tiles=1))  # one tile, same weights
    counts = param_counts(cfg)
    rows = []
    for name, config in (("published (4 tiles)", cfg), ("one tile (not published)", one)):
        for gpus in (1, 8):
            work = Workload(minutes=60, fps=1, ranks=gpus)
            stage = time_plan(config, work, counts=counts)[INGEST]
            rows.append(
                {
                    "tower": name,
                    "GPUs": gpus,
                    "tower tokens/frame": config.vision_tokens_per_frame,
                    "TFLOP/frame": stage["matmul_tflop"] * gpus / work.frames,
                    "ingest s/hour": stage["seconds"],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--frames", type=int, default=256, help="frames per tower call")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine())
    print("measured, tiny shapes, float32 CPU\n" + markdown(measured(args.frames, args.repeats)))
    print("\nplanned, Llama-3.2-11B-Vision, H100 rates, 1 fps\n" + markdown(planned()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
