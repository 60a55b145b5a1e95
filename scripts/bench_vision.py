"""Is lvx's SigLIP tower + projector at least as fast as `transformers`' `SiglipVisionModel` + the
same projector, on the same weights and frames?

Both sides get one set of random weights in the official checkpoint layout (every `vision_model.*`
key, the unused last layer, `post_layernorm` and pooling head included, plus the projector): lvx
loads them by its own key names (the loader's rule: official names, unused keys skipped), the
`transformers` model takes all of its keys, and the projector is the same module on both sides.
Timed, interleaved (the order turns every repeat), medians reported:

- `lvx`: `Owl3Model.encode_images(frames)`, what a caller with all frames at hand runs;
- `lvx, ingest chunks`: the same in the chunks ingest hands it (32 decoded frames at a time;
  shown where there are more frames than one chunk);
- `transformers`: the official mPLUG-Owl3 code's use, all frames in one call under inference mode,
  `hidden_states[-2]` of the whole model (it also runs the last layer, `post_layernorm` and head);
- `transformers, used layers`: the same model cut to the layers mPLUG-Owl3 reads (the last one
  dropped), `hidden_states[-1]`: the same work as lvx, the comparison the ratio is quoted against.

Two shapes: the tiny checkpoint's (`tiny.tiny_config("g1-gateproj")`: SigLIP hidden 32, 2 used
layers, 30 px, 4 visual tokens per frame; linear projector to 64) at hundreds of frames, and
mPLUG-Owl3-7B-240728's (SigLIP-so400m: hidden 1152, 26 used layers, 16 heads, 384 px, 729 tokens;
linear projector to 3584) at a few frames. float32 on CPU. Outputs are checked equal (float
tolerance) before anything is timed.

    python3 scripts/bench_vision.py --threads 2 --json runs/bench_vision.json
    python3 scripts/bench_vision.py --real-frames 0   # tiny shapes only, a few seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(ROOT)
    import scripts  # noqa: F401

from lvx_app.video.decode import DEFAULT_CHUNK_FRAMES
from lvx_models.mplug_owl3.checkpoint import PROJECTOR, VISION, is_unused, official_shapes
from lvx_models.mplug_owl3.config import Owl3Config
from lvx_models.mplug_owl3.modeling import Owl3Model
from lvx_models.mplug_owl3.published import RELEASES
from lvx_models.mplug_owl3.tiny import tiny_config
from scripts.harness import machine, write_json

SHAPES: dict[str, Callable[[], Owl3Config]] = {
    "tiny": lambda: tiny_config("g1-gateproj"),
    "so400m": lambda: RELEASES["mPLUG-Owl3-7B-240728"],
}
REFERENCE = "transformers, used layers"  # the same work as lvx: the ratio is quoted against it
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def random_visual_weights(cfg: Owl3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every official `vision_model.*` and `vision2text_model.*` key, float32: norms ~ 1 + N(0,
    0.1), the position embedding and pooling probe N(0, 0.5), other tensors N(0, 0.02)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in official_shapes(cfg).items():
        if not key.startswith((VISION, PROJECTOR)):
            continue
        if "norm" in key and key.endswith("weight"):
            out[key] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif key.endswith(("position_embedding.weight", "probe")):
            out[key] = 0.5 * torch.randn(shape, generator=g)
        else:
            out[key] = 0.02 * torch.randn(shape, generator=g)
    return out


def lvx_model(cfg: Owl3Config, weights: dict[str, torch.Tensor]) -> Owl3Model:
    """Owl3Model holding `weights` (shared, not copied) in its tower and projector; the language
    model stays on the meta device (encode_images never touches it)."""
    with torch.device("meta"):
        model = Owl3Model(cfg)
    used = {k: v for k, v in weights.items() if not is_unused(k, cfg)}
    missing, _ = model.load_state_dict(used, strict=False, assign=True)
    left = [k for k in missing if k.startswith((VISION, PROJECTOR))]
    if left:
        raise RuntimeError(f"lvx's tower has no weight for {left[0]}")
    return model.eval()


def siglip_model(cfg: Owl3Config, weights: dict[str, torch.Tensor], layers: int | None = None):
    """`transformers.SiglipVisionModel` holding the `vision_model.*` tensors of `weights` (shared),
    with the first `layers` encoder layers (default: all)."""
    import transformers

    v = cfg.vision
    layers = v.num_hidden_layers if layers is None else layers
    hf = transformers.SiglipVisionModel(
        transformers.SiglipVisionConfig(
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            num_hidden_layers=layers,
            num_attention_heads=v.num_attention_heads,
            num_channels=v.num_channels,
            image_size=v.image_size,
            patch_size=v.patch_size,
            layer_norm_eps=v.layer_norm_eps,
            hidden_act=v.hidden_act,
        )
    )
    # transformers 4 names the keys as the checkpoint does, transformers 5 without `vision_model.`
    bare = not next(iter(hf.state_dict())).startswith(VISION)
    dropped = tuple(f"{VISION}encoder.layers.{k}." for k in range(layers, v.num_hidden_layers))
    sd = {
        (k.removeprefix(VISION) if bare else k): t
        for k, t in weights.items()
        if k.startswith(VISION) and not k.startswith(dropped)
    }
    hf.load_state_dict(sd, strict=True, assign=True)
    return hf.eval()


def contenders(
    cfg: Owl3Config, weights: dict[str, torch.Tensor], *, chunked: bool = True
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> frames (N, 3, S, S) -> features (N, T, H), all on the same weights (`chunked`: with
    the ingest-chunks row)."""
    lvx = lvx_model(cfg, weights)
    projector: nn.Module = lvx.vision2text_model
    hf_all = siglip_model(cfg, weights)
    hf_used = siglip_model(cfg, weights, layers=cfg.vision.num_used_layers)

    def transformers_all(px: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return projector(hf_all(pixel_values=px, output_hidden_states=True).hidden_states[-2])

    def transformers_used(px: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return projector(hf_used(pixel_values=px, output_hidden_states=True).hidden_states[-1])

    def lvx_chunks(px: torch.Tensor) -> torch.Tensor:
        return torch.cat([lvx.encode_images(c) for c in px.split(DEFAULT_CHUNK_FRAMES)])

    fns = {"lvx": lvx.encode_images, "lvx, ingest chunks": lvx_chunks}
    if not chunked:
        del fns["lvx, ingest chunks"]
    return {**fns, "transformers": transformers_all, REFERENCE: transformers_used}


def time_interleaved(
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]], px: torch.Tensor, repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """(wall s, process CPU s) of each fn on px, `repeats` rounds, the order turned by one every
    round. CPU seconds count what the process ran, not the time other processes took the cores."""
    names = list(fns)
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            fns[n](px)
            times[n][0].append(time.perf_counter() - t0)
            times[n][1].append(time.process_time() - c0)
    return times


def bench_shape(shape: str, frames: int, repeats: int, seed: int = 0) -> list[dict]:
    """Rows for one shape and frame count: check the outputs agree, warm up, time."""
    cfg = SHAPES[shape]()
    weights = random_visual_weights(cfg, seed)
    fns = contenders(cfg, weights, chunked=frames > DEFAULT_CHUNK_FRAMES)
    g = torch.Generator().manual_seed(seed + 1)
    s = cfg.vision.image_size
    px = torch.rand(frames, 3, s, s, generator=g) * 2 - 1
    want = fns[REFERENCE](px)
    diffs = {}
    for name, fn in fns.items():  # doubles as the warm-up
        got = fn(px)
        torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
        diffs[name] = float((got - want).abs().max())
    times = time_interleaved(fns, px, repeats)
    ref_wall, ref_cpu = (statistics.median(t) for t in times[REFERENCE])
    rows = []
    for name, (wall, cpu) in times.items():
        med, med_cpu = statistics.median(wall), statistics.median(cpu)
        rows.append(
            {
                "shape": shape,
                "frames": frames,
                "impl": name,
                "median_s": med,
                "min_s": min(wall),
                "median_cpu_s": med_cpu,
                "times_s": wall,
                "cpu_times_s": cpu,
                "frames_per_s": frames / med,
                "reference_over_this": ref_wall / med,
                "reference_over_this_cpu": ref_cpu / med_cpu,
                "max_abs_diff_vs_reference": diffs[name],
            }
        )
    return rows


def environment(threads: int) -> dict:
    import transformers

    return machine() | {
        "threads": threads,
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | frames | implementation | median s | min s | median CPU s | frames/s "
        "| speed-up, wall | speed-up, CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['frames']} | {r['impl']} | {r['median_s']:.4f} | "
            f"{r['min_s']:.4f} | {r['median_cpu_s']:.4f} | {r['frames_per_s']:.3g} | "
            f"{r['reference_over_this']:.2f}× | {r['reference_over_this_cpu']:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--tiny-frames", type=int, nargs="*", default=[600, 1800])
    parser.add_argument("--real-frames", type=int, nargs="*", default=[2], help="so400m frames")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds, tiny shapes")
    parser.add_argument("--real-repeats", type=int, default=3, help="timed rounds, so400m")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_vision needs transformers: pip install transformers", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    rows = []
    runs = [("tiny", n) for n in args.tiny_frames] + [("so400m", n) for n in args.real_frames if n]
    for shape, frames in runs:
        rows += bench_shape(shape, frames, args.repeats if shape == "tiny" else args.real_repeats)
    env["load_avg_after"] = list(os.getloadavg())
    print(table(rows))
    print(f"speed-up: the median time of `{REFERENCE}` over this row's (above 1: faster)")
    print(
        f"{env['cpu']}, {env['threads']} threads, torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['date']}, load average {env['load_avg'][0]:.1f} before, "
        f"{env['load_avg_after'][0]:.1f} after"
    )
    if args.json:
        write_json(args.json, {"environment": env, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
