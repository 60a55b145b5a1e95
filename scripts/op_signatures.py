"""The aten attention ops lvx calls, checked against the torch this process runs: each op exists,
takes as many positional arguments as the adapters pass (`lvx_kernels/backends.py`) and the
keywords they name, needs none they leave out, and returns the outputs they read (exactly as many
where they unpack them all).

The GPU image may carry another torch than CI (its op signatures change between releases: an
argument added without a default, a keyword renamed), and such a change turns a kernel call into a
fallback or a crash on the GPU only. One line per mismatch; none when all fit.

    python scripts/op_signatures.py        # prints the lines, exit 1 when any
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

Call = tuple[int, tuple[str, ...], int, bool]
# op -> (positional arguments passed, keywords passed, outputs read, whether the adapter unpacks
# exactly that many), as the adapters call them
CALLS: dict[str, Call] = {
    "_scaled_dot_product_flash_attention_for_cpu": (5, ("attn_mask", "scale"), 2, True),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (8, ("attn_mask", "scale"), 3, True),
    "_scaled_dot_product_efficient_attention": (7, ("scale",), 4, True),
    "_scaled_dot_product_efficient_attention_backward": (12, ("scale",), 4, True),
    "_scaled_dot_product_flash_attention": (6, ("scale",), 2, False),
    "_scaled_dot_product_flash_attention_backward": (14, ("scale",), 3, True),
    "_scaled_dot_product_cudnn_attention": (8, ("scale",), 2, False),
    "_flash_attention_forward": (10, ("scale", "seqused_k"), 2, False),
}


def mismatch(
    name: str, positional: int, keywords: tuple[str, ...], outputs: int, exact: bool
) -> list[str]:
    """Why this torch's op `name` does not take the adapters' call (empty: it does)."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return [f"aten.{name}: not in torch {torch.__version__}"]
    schema = packet.default._schema
    args = schema.arguments
    lines = []
    takes = [a for a in args if not a.kwarg_only]
    if len(takes) < positional:
        lines.append(f"takes {len(takes)} positional arguments, lvx passes {positional}")
    names = {a.name for a in args}
    lines += [f"has no argument {k!r}" for k in keywords if k not in names]
    passed = {a.name for a in takes[:positional]} | set(keywords)
    lines += [
        f"needs {a.name!r}, which lvx does not pass"
        for a in args
        if a.name not in passed and not a.has_default_value()
    ]
    returns = len(schema.returns)
    if returns < outputs or (exact and returns != outputs):
        lines.append(f"returns {returns} outputs, lvx {'unpacks' if exact else 'reads'} {outputs}")
    return [f"aten.{name} (torch {torch.__version__}): {line}" for line in lines]


def mismatches(calls: dict[str, Call] = CALLS) -> list[str]:
    """One line per mismatch between the calls and this torch's ops."""
    return [line for name, call in calls.items() for line in mismatch(name, *call)]


def main() -> int:
    lines = mismatches()
    for line in lines:
        print(line)
    if not lines:
        print(f"every aten attention op lvx calls fits torch {torch.__version__}")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
