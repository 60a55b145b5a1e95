"""The aten attention ops lvx calls, checked against the torch this process runs: each op exists,
takes as many positional arguments as the adapters pass (`lvx_kernels/backends.py`) and the
keywords they name, needs none they leave out, and returns the outputs they read (exactly as many
where they unpack them all).

The GPU image may carry another torch than CI (its op signatures change between releases: an
argument added without a default, a keyword renamed), and such a change turns a kernel call into a
fallback or a crash on the GPU only. One line per mismatch; none when all fit. The same check runs
in CI against the schemas recorded from the GPU image's torch wheel (`RECORDED`, read by
`recorded_mismatches`); on the GPU the kernel check fails on any mismatch with the torch present.

    python scripts/op_signatures.py                 # this torch: the lines, exit 1 when any
    python scripts/op_signatures.py --recorded      # the GPU image's torch, as recorded
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

ROOT = Path(__file__).resolve().parents[1]
# the schemas of these ops in the GPU image's torch, recorded from its wheel (the file says which)
RECORDED = ROOT / "tests" / "data" / "torch_2_11_op_schemas.json"
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


def _live_schema(name: str):
    """This torch's schema of aten op `name`, or None when it has no such op."""
    packet = getattr(torch.ops.aten, name, None)
    return None if packet is None else packet.default._schema


def mismatch(
    name: str, positional: int, keywords: tuple[str, ...], outputs: int, exact: bool,
    schema=None, version: str | None = None,
) -> list[str]:  # fmt: skip
    """Why op `name` (`schema`, default this torch's) does not take the adapters' call (empty: it
    does); `version` names the torch in the lines."""
    version = version or torch.__version__
    schema = schema if schema is not None else _live_schema(name)
    if schema is None:
        return [f"aten.{name}: not in torch {version}"]
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
    return [f"aten.{name} (torch {version}): {line}" for line in lines]


def mismatches(calls: dict[str, Call] = CALLS) -> list[str]:
    """One line per mismatch between the calls and this torch's ops."""
    return [line for name, call in calls.items() for line in mismatch(name, *call)]


def recorded_mismatches(path: Path = RECORDED, calls: dict[str, Call] = CALLS) -> list[str]:
    """One line per mismatch between the calls and the schemas recorded in `path` (JSON: `torch`,
    the version, and `schemas`, op name -> schema string as the wheel's headers hold it)."""
    data = json.loads(path.read_text())
    schemas = {name: torch._C.parse_schema(text) for name, text in data["schemas"].items()}
    lines = []
    for name, call in calls.items():
        if name not in schemas:
            lines.append(f"aten.{name}: not recorded for torch {data['torch']}")
        else:
            lines += mismatch(name, *call, schema=schemas[name], version=data["torch"])
    return lines


def main(argv: list[str] | None = None) -> int:
    recorded = "--recorded" in (sys.argv[1:] if argv is None else argv)
    lines = recorded_mismatches() if recorded else mismatches()
    for line in lines:
        print(line)
    if not lines:
        which = json.loads(RECORDED.read_text())["torch"] if recorded else torch.__version__
        print(f"every aten attention op lvx calls fits torch {which}")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
