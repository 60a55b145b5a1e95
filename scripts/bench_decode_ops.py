"""Aten ops per decoded token at mPLUG-Owl3-7B's depth, counted on a CPU around the engine's own
token loop: each is a kernel launch and host dispatch time on a GPU, where a token's device work
is a few milliseconds, so this count bounds how fast the host lets decoding go.

Ops do not depend on the width, so the model is a random one with the 7B checkpoint's 28 layers,
hyper layers, heads and key/value heads at a small hidden size (`--hidden`); one process, a few
random frames, greedy, the count per token taken between an 8- and a 40-token answer
(`scripts/op_count.py`). Writes a table and, with `--json`, the rows.

    python scripts/bench_decode_ops.py
    python scripts/bench_decode_ops.py --generation g1 g2 --json decode_ops.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_models.mplug_owl3.config import Owl3Config, SiglipVisionConfig
from lvx_models.mplug_owl3.modeling import Owl3Model
from scripts.harness import Rows, command_line, machine, show
from scripts.op_count import decode_ops
from scripts.random_model import SMALL_VISION

TOP = 8  # ops named in a row, the most frequent first


def deep_narrow(generation: str, hidden: int) -> Owl3Model:
    """A random model of the 7B checkpoint's depth, hyper layers and heads at width `hidden`,
    fused as the loader leaves it (float32, CPU)."""
    base = Owl3Config()
    cfg = dataclasses.replace(
        base,
        generation=generation,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        vocab_size=4096,
        vision=SiglipVisionConfig(**SMALL_VISION),
    )
    torch.manual_seed(0)
    model = Owl3Model(cfg).eval()
    model.fuse_projections()
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generation", nargs="+", default=["g2"], choices=["g1", "g2"])
    parser.add_argument("--hidden", type=int, default=28 * 16, help="width (a multiple of 28)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = Rows(args.json, command=command_line(), machine=machine())
    for generation in args.generation:
        model = deep_narrow(generation, args.hidden)
        cfg = model.config
        per_token, by_name, _ = decode_ops(model)
        rows.add(
            {
                "generation": generation,
                "layers": cfg.num_hidden_layers,
                "hyper_layers": len(cfg.hyper_layer_indices),
                "heads": f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}",
                "ops_per_token": per_token,
                "ops_per_layer": per_token / cfg.num_hidden_layers,
                "top_ops": dict(by_name.most_common(TOP)),
            }
        )
    show("aten ops per decoded token at 7B depth (one process, greedy)", rows.rows, digits=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
