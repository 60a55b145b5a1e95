"""`python3 scripts/versions.py`: the software and devices a run measures with, as one JSON line:
Python, torch and its CUDA and cuDNN, every GPU (name, memory, compute capability), the optional
packages lvx uses (flash-attn, decord, PyAV) and the compilers torch.compile needs. The acceptance
run's first item; no figure of lvx's own."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def compiler() -> str | None:
    """The C compiler torch.compile would call ($CC, else cc, gcc or clang), or None."""
    names = [os.environ.get("CC"), "cc", "gcc", "clang"]
    return next((found for name in names if name and (found := shutil.which(name))), None)


def versions() -> dict:
    import torch

    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpus": [
            {
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
            }
            for p in gpus
        ],  # fmt: skip
        "packages": {
            name: _version(name) for name in ("flash-attn", "decord", "av", "triton", "numpy")
        },
        "compiler": compiler(),
        "nvcc": shutil.which("nvcc"),
    }


if __name__ == "__main__":
    print(json.dumps(versions(), allow_nan=False))
