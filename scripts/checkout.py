"""The checkout's packages, importable without installing lvx.

`pip install -e .` maps the folders `models/` and `ui/` to the import names `lvx_models` and
`lvx_ui`. Where lvx is not installed (a bare GPU image), `link()` makes those names (and `lvx_app`)
point at this checkout: a temporary folder of links, first on `sys.path` and on `PYTHONPATH`, so
every process a script starts (torchrun's ranks, the acceptance run's items) finds them too. An lvx
installed from this checkout is used as it is. No torch here: the acceptance runner imports this.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lvx_app": "lvx_app", "lvx_models": "models", "lvx_ui": "ui"}  # import name -> folder


def installed_here() -> bool:
    """Whether every package imports from this checkout as things stand."""
    for name, folder in PACKAGES.items():
        spec = importlib.util.find_spec(name)
        where = spec and spec.submodule_search_locations
        if not where or not any(Path(p).resolve() == ROOT / folder for p in where):
            return False
    return True


def with_path(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` with `folder` first on PYTHONPATH."""
    paths = [str(folder), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def link_folder(folder: Path, root: Path = ROOT) -> Path:
    """`folder` holding one link per import name to the package folder of the checkout at `root`
    (default: this one)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in PACKAGES.items():
        (folder / name).symlink_to(root / source, target_is_directory=True)
    return folder


def link() -> str:
    """Make the checkout's packages importable here and in every child process; say how they
    import ("installed" or the folder of links)."""
    if installed_here():
        return "installed"
    folder = link_folder(Path(tempfile.mkdtemp(prefix="lvx-checkout-")))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    sys.path.insert(0, str(folder))
    os.environ.update(with_path(dict(os.environ), folder))
    importlib.invalidate_caches()
    return f"not installed: the checkout's packages linked into {folder}"
