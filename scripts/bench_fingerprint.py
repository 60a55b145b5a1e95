"""What keying the feature cache on the weights costs at start-up: `encoder_fingerprint` on a
checkpoint-shaped file.

Writes a safetensors file holding MiB of bf16 `vision_model.*` bytes (SigLIP-400M in bf16 is ~0.8
GB), then times the first fingerprint (reads and hashes those bytes) and a second one answered by
the memo (one stat per file). The first read is from a warm page cache (the file was just written);
a cold disk adds its read time.

    python scripts/bench_fingerprint.py --mib 512 --out runs/bench_fingerprint.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

import torch
from safetensors.torch import save_file

from lvx_app.cache.fingerprints import fingerprint_memo
from lvx_models.fingerprint import encoder_fingerprint
from lvx_models.mplug_owl3.family import VISION_PREFIXES
from scripts.harness import Rows, command_line, machine, show, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB of vision-tower weights to hash")
    ap.add_argument("--out", type=Path, default=None, help="write the row here (JSON)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        vision = torch.zeros(args.mib * 2**20 // 2, dtype=torch.bfloat16)
        save_file(
            {"vision_model.w": vision, "language_model.w": torch.zeros(8)},
            str(d / "model.safetensors"),
        )

        def fingerprint() -> str:
            with fingerprint_memo(d) as memo:  # read from and written to the folder, as lvx does
                return encoder_fingerprint(d, prefixes=VISION_PREFIXES, memo=memo)

        _, first = timed(fingerprint)
        _, again = timed(fingerprint)
    rows = Rows(args.out, command=command_line(), machine=machine())
    row = {"MiB": args.mib, "first s": first, "MiB/s": args.mib / first, "memo hit ms": again * 1e3}
    show("the encoder fingerprint: first read, then the memo", [rows.add(row)])


if __name__ == "__main__":
    main()
