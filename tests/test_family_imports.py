"""The model families stand side by side (docs/architecture.md, "A model family"): no file of one
family imports another family, the app and the page import no name that belongs to a family (what
several share lives in shared modules of lvx_models), and listing the families or resizing frames
imports no family's modeling code."""

from __future__ import annotations

import ast
import subprocess
import sys

from test_house import GRAPH, MODULES, ROOT

SURFACE = "lvx_models.api"


def family_of_module(module: str) -> str | None:
    """The family folder a module of lvx_models sits in (`lvx_models.mllama.text` -> `mllama`), or
    None for a shared module."""
    parts = module.split(".")
    if parts[0] != "lvx_models" or len(parts) < 2:
        return None
    folder = ROOT / "models" / parts[1]
    return parts[1] if (folder / "family.py").exists() else None


def cross_family_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        if family_of_module(m)
        for d in deps
        if family_of_module(d) not in (None, family_of_module(m))
    )


def surface_sources(source: str) -> dict[str, str]:
    """name -> the lvx_models module the surface takes it from (its imports, read with ast)."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = f"lvx_models.{node.module}"
    return out


def app_family_names(sources: dict[str, str], app: dict[str, str]) -> list[str]:
    """Where a module of the app or the page imports from the surface a name a family owns."""
    found = []
    for module, source in app.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module == SURFACE:
                for alias in node.names:
                    origin = sources.get(alias.name, SURFACE)
                    if family_of_module(origin):
                        found.append(f"{module} imports {alias.name} of {origin}")
    return sorted(found)


def _app_sources() -> dict[str, str]:
    return {
        m: p.read_text() for m, p in MODULES.items() if m.split(".")[0] in ("lvx_app", "lvx_ui")
    }


def test_no_family_imports_another():
    assert not cross_family_imports(GRAPH), "\n".join(cross_family_imports(GRAPH))


def test_the_walk_sees_a_family_importing_another():
    graph = {
        "lvx_models.mllama.processor": {"lvx_models.mplug_owl3.tokenizer", "lvx_models.steps"},
        "lvx_models.mllama.family": {"lvx_models.mllama.config", "lvx_models.surface"},
        "lvx_models.api": {"lvx_models.mllama.family", "lvx_models.mplug_owl3.family"},
    }
    assert cross_family_imports(graph) == [
        "lvx_models.mllama.processor imports lvx_models.mplug_owl3.tokenizer"
    ]


def test_the_app_imports_no_name_a_family_owns():
    sources = surface_sources((ROOT / "models" / "api.py").read_text())
    found = app_family_names(sources, _app_sources())
    assert not found, "\n".join(found)


def test_the_walk_sees_the_app_import_a_family_name():
    sources = surface_sources(
        "from .mplug_owl3.pixels import square_prep\nfrom .pixels import resize_uint8\n"
    )
    app = {"lvx_app.video.encode": "from lvx_models.api import resize_uint8, square_prep\n"}
    assert app_family_names(sources, app) == [
        "lvx_app.video.encode imports square_prep of lvx_models.mplug_owl3.pixels"
    ]


def defines_modules(source: str) -> list[str]:
    """The classes a module's source defines on `nn.Module` (or `Module`): modeling code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in
                     node.bases]  # fmt: skip
            found += [node.name] if "Module" in bases else []
    return found


def test_the_walk_sees_a_module_class():
    source = "import torch.nn as nn\nclass Perceiver(nn.Module): ...\nclass Config:\n    x = 1\n"
    assert defines_modules(source) == ["Perceiver"]
    assert defines_modules("from torch.nn import Module\nclass Tower(Module): ...\n") == ["Tower"]


def test_listing_families_and_resizing_frames_import_no_modeling_code():
    """The registry and a frame-resize worker (what `lvx_app.video.decode` imports, and every
    family's frame resize unpickled) import no family's model: no module of a family folder that
    defines an `nn.Module`, whatever the family names its files."""
    probe = (
        "import sys, pickle, lvx_app.video.decode, lvx_models.api as api\n"
        "assert len(api.FAMILIES) > 1\n"
        "from lvx_models.mllama.image_tiles import fit_and_pad_uint8\n"
        "pickle.loads(pickle.dumps(fit_and_pad_uint8))\n"
        "print(' '.join(m for m in sys.modules if m.startswith('lvx_models')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    loaded = [m for m in out if family_of_module(m) and defines_modules(MODULES[m].read_text())]
    assert "lvx_models.api" in out and not loaded, loaded
