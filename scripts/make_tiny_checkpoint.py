#!/usr/bin/env python
"""Write tiny random-weight mPLUG-Owl3 checkpoints in the official Hugging Face layout (no
downloads).

python scripts/make_tiny_checkpoint.py out/tiny            # out/tiny/g1 and out/tiny/g2
python scripts/make_tiny_checkpoint.py out/tiny --generation all   # also out/tiny/g1-gateproj
python scripts/make_tiny_checkpoint.py out/tiny-g2 --generation g2 --shards 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_models.mplug_owl3.config import FORMS
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "out", type=Path, help="output directory (one subdirectory per generation with 'both')"
    )
    ap.add_argument(
        "--generation",
        choices=(*FORMS, "all", "both"),
        default="both",
        help="g1-gateproj = 7B-240728-style (input-dependent gate_proj, linear projector), g1 = "
        "241014-style "
        "(constant gate), g2 = 7B-241101-style (fused, MLP projector); 'both' = g1 and g2",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shards", type=int, default=1, help="split the weights into N safetensors shards + index"
    )
    args = ap.parse_args(argv)
    many = {"all": tuple(FORMS), "both": ("g1", "g2")}
    gens = many.get(args.generation, (args.generation,))
    paths = []
    for g in gens:
        d = args.out / g if args.generation in many else args.out
        paths.append(write_tiny_checkpoint(d, g, seed=args.seed, shards=args.shards))
        print(f"{g}: {d}")
    return paths


if __name__ == "__main__":
    main()
