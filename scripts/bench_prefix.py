"""Load time of a video in the real `lvx` engine: first open, reopen with the cached features only,
reopen with the saved video prompt (`lvx_app/cache/prompts.py`) — side by side in one run, with
the first answer of each.

The checkpoint is written in the official layout with the small shapes of `bench_chat.py --shape
small` (text hidden 256, 8 layers, 4 hyper layers, GQA 8/2 heads; SigLIP hidden 64 at 384 px -> 729
visual tokens per frame), random weights, float32 on CPU ranks. The video is synthetic (96x64,
sampled at 1 fps). Load time is the engine's own `load_video` time (ranks already started, model
loaded). Answers are greedy, so "same answer" means token for token.

The visual K/V on reopen are what the engine picks (`--save-visual-kv auto`,
lvx_app/engine/resident_visual_kv.py): the first open times computing them and saves them when that
was clearly slower than reading them back; the features-only reopen computes them as before (the
saved ones are set aside, nothing is written); the reopen with the saved prompt reads them back when
the first open saved them. The `visual_kv` column says which it did and the line under the table
gives the first open's figures (rank 0's).

    python scripts/bench_prefix.py --minutes 10 --ranks 1 2 --out runs/bench_prefix_cpu.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from scripts.harness import command_line, machine, show, write_json
from scripts.random_model import small_config

QUESTION = "What happens in the video, and when does the scene change?"


def small_checkpoint(directory: Path) -> Path:
    """The tiny checkpoint's tokenizer and files, with the small shapes (random_model.py) and
    random weights."""
    from lvx_models.mplug_owl3.config import Owl3Config
    from lvx_models.mplug_owl3.tiny import random_weights, write_tiny_checkpoint

    write_tiny_checkpoint(directory, "g2")
    cfg = small_config(Owl3Config.from_json(directory / "config.json"))
    cfg.to_json(directory / "config.json")
    save_file(
        random_weights(cfg, 0, torch.float32),
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return directory


def _open(
    checkpoint: Path, video: Path, cache_dir: Path, ranks: int, new_tokens: int, save_visual_kv: str
) -> tuple[float, bool, bool, str, bool, str]:
    from lvx_app.config import Config
    from lvx_app.runtime.open import open_engine

    config = Config.from_options(
        model=str(checkpoint),
        cache_dir=str(cache_dir),
        dtype="float32",
        save_visual_kv=save_visual_kv,
        gpus=0,
        ranks=ranks,
    )
    engine = open_engine(config)
    try:
        t0 = time.perf_counter()
        summary = engine.load_video(str(video), subtitles=[])
        load_s = time.perf_counter() - t0
        why = str(engine.stats().get("visual K/V", "?"))
        answer = "".join(engine.ask(QUESTION, max_new_tokens=new_tokens))
    finally:
        engine.close()
    return (
        load_s,
        summary.from_cache,
        summary.prompt_from_cache,
        answer,
        summary.visual_kv_from_cache,
        why,
    )


def bench(
    minutes: float,
    ranks: int,
    new_tokens: int,
    workdir: Path,
    checkpoint: Path,
    save_visual_kv: str,
) -> dict:
    from lvx_app.video.synthetic import make_video

    video = workdir / f"video_{minutes:g}min.mp4"
    if not video.exists():
        make_video(video, num_frames=int(minutes * 60), fps=1, width=96, height=64)
    cache = workdir / f"cache-{minutes:g}-{ranks}"
    shutil.rmtree(cache, ignore_errors=True)
    first = _open(checkpoint, video, cache, ranks, new_tokens, save_visual_kv)
    shutil.rmtree(cache / "prefixes")
    kv_dir, aside = cache / "visual-kv", cache / "visual-kv-aside"
    if kv_dir.is_dir():
        # the features-only reopen computes the visual K/V as before and writes none
        kv_dir.rename(aside)
    features = _open(checkpoint, video, cache, ranks, new_tokens, "never")
    if aside.is_dir():
        aside.rename(kv_dir)
    prefix = _open(checkpoint, video, cache, ranks, new_tokens, save_visual_kv)
    assert not features[4], "the features-only reopen computes the visual K/V"
    assert (first[1:3], features[1:3], prefix[1:3]) == ((False, False), (True, False), (True, True))
    saved = sum(f.stat().st_size for f in (cache / "prefixes").rglob("*.safetensors"))
    saved_kv = sum(f.stat().st_size for f in (cache / "visual-kv").rglob("*.safetensors"))
    return {
        "minutes": minutes,
        "ranks": ranks,
        "first_open_s": first[0],
        "reopen_features_s": features[0],
        "reopen_prompt_s": prefix[0],
        "speedup": features[0] / prefix[0],
        "saved_prompt_mib": saved / 2**20,
        "visual_kv": "read back" if prefix[4] else "computed",
        "saved_visual_kv_mib": saved_kv / 2**20,
        "same_answer": first[3] == features[3] == prefix[3],
        "answer_chars": len(first[3]),
        "why": first[5],
    }


def visual_kv_choice(minutes: float, checkpoint: Path, workdir: Path) -> dict:
    """Recompute the visual K/V from the features (what reopen does) vs read resident K/V back from
    a file."""
    from safetensors.torch import load_file

    from lvx_app.cache import tensor_crc
    from lvx_models.mplug_owl3.loader import load_model

    model = load_model(str(checkpoint), dtype=torch.float32).model
    frames, cfg = int(minutes * 60), model.config
    features = torch.randn(frames, cfg.vision.num_patches, cfg.hidden_size)
    starts = 18 + 5 * torch.arange(frames)
    t0 = time.perf_counter()
    with torch.no_grad():
        visual = model.prepare_visual(features, starts, precompute=True)
    recompute_s = time.perf_counter() - t0
    tensors = {f"{n}.{i}": t.contiguous() for n, kv in visual.kv.items() for i, t in enumerate(kv)}
    path = workdir / "visual_kv.safetensors"
    save_file(tensors, str(path))
    t0 = time.perf_counter()
    back = load_file(str(path))
    crc = 0
    for t in back.values():  # the caches check every byte (CRC-32), which also makes the read real
        crc = tensor_crc(t, crc)
    read_s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in back.values())
    path.unlink()
    return {
        "minutes": minutes,
        "frames": frames,
        "recompute_kv_s": recompute_s,
        "read_and_check_kv_s": read_s,
        "kv_mib": nbytes / 2**20,
        "features_mib": features.numel() * 4 / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, nargs="+", default=[10.0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--visual-kv", action="store_true", help="only time recomputing vs reading the visual K/V"
    )
    parser.add_argument(
        "--save-visual-kv",
        choices=["auto", "always", "never"],
        default="auto",
        help="SessionConfig.save_visual_kv of every open (default: auto, measure and pick)",
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lvx-bench-prefix-"))
    checkpoint = small_checkpoint(workdir / "small-g2")
    if args.visual_kv:
        rows = [visual_kv_choice(m, checkpoint, workdir) for m in args.minutes]
    else:
        rows = [
            bench(m, n, args.new_tokens, workdir, checkpoint, args.save_visual_kv)
            for m in args.minutes
            for n in args.ranks
        ]
    title = (
        "visual K/V on reopen: recompute from features vs read back"
        if args.visual_kv
        else "lvx load_video, small shapes, float32 CPU ranks: first open / features cached / "
        "prompt saved"
    )
    show(title, rows, [key for key in rows[0] if key != "why"], digits=4)
    for row in rows:
        if "why" in row:
            print(
                f"{row['minutes']:g} min, {row['ranks']} rank(s), visual K/V at the first open: "
                f"{row['why']}"
            )
    if args.out:
        report = {"command": command_line(), "machine": machine(), "rows": rows}
        print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
