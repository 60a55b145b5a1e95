"""The shape of the tree (docs/architecture.md): imports go one way, no file cycles, no unexplained
long function.

The layers are listed once, here and in docs/architecture.md; a module may import its own layer or
lower ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_readme import TEST_COMMAND

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder
PACKAGES = {
    "lvx_app": "lvx_app",
    "lvx_kernels": "lvx_kernels",
    "lvx_models": "models",
    "lvx_ui": "ui",
}
MAX_LINES = 60
# a function over MAX_LINES says why within its first lines, e.g. "# long: the option list"
WHY_LONG = "# long:"

# (layer, module prefixes), top first; the first matching prefix wins, so list the specific ones
# before their package.
LAYERS = [
    (7, ["lvx_ui", "lvx_app.cli"]),
    (6, ["lvx_app.eval", "lvx_app.train"]),
    (5, ["lvx_app.runtime.service", "lvx_app.runtime"]),
    (4, ["lvx_app.engine"]),
    (3, ["lvx_app.video", "lvx_app.subtitles", "lvx_app.speech"]),
    (2, ["lvx_models"]),
    (1, ["lvx_app.attention", "lvx_app.parallel"]),
    (1, ["lvx_app.cache"]),
    (0, ["lvx_kernels"]),  # a leaf: imports none of ours (the config reads its backend names)
    (0, ["lvx_app.config", "lvx_app.defaults", "lvx_app.devices", "lvx_app.warning_lines",
         "lvx_app.interrupts", "lvx_app.version", "lvx_app.wire", "lvx_app.regular_files"]),
]  # fmt: skip


def layer_of(module: str) -> int:
    if module == "lvx_app":
        return 7  # the package root is the Python API (`lvx_app.open`), a frontend
    for layer, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """Our modules that `module` imports anywhere in its file (function-level imports count)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            stem = ".".join(x for x in (base, node.module or "") if x)
            names = [stem] + [f"{stem}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: _imported(m, p) for m, p in MODULES.items()}


def _is_package_init(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_never_go_up_a_layer():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
        for m, deps in GRAPH.items()
        for d in deps
        if layer_of(d) > layer_of(m)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_file_import_cycles():
    # a package __init__ re-exports its children; it is not a file the children depend on
    graph = {m: {d for d in deps if not _is_package_init(d)} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(
                    " -> ".join(trail[trail.index(nxt) :] + [node, nxt])
                    if nxt in trail
                    else f"{node} -> {nxt}"
                )
            elif nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


MAX_CLASS_LINES = 250  # a class longer than this does more than one job: split it


def test_no_class_in_the_product_is_over_250_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    long.append(f"{module}.{node.name}: {length} lines")
    assert not long, "\n".join(long)


def test_only_the_text_cache_writes_its_length():
    """The text cache's length (the one count of the tokens fed) is set by the cache alone
    (`TextKVCache`: update, truncate, count_written); everything else asks it."""
    owner = ROOT / "models" / "steps.py"
    writes = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets = [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else targets
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "length" and path != owner:
                    writes.append(f"{module}:{node.lineno}")
    assert not writes, "\n".join(writes)


BESIDE = sorted((ROOT / "scripts").rglob("*.py"))  # benchmarks, baselines: not the product


def _long_functions() -> list[str]:
    out = []
    for path in [*MODULES.values(), *BESIDE]:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                head = lines[node.lineno - 1 : node.body[0].lineno + 1]
                if length > MAX_LINES and not any(WHY_LONG in line for line in head):
                    out.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)"
                    )
    return out


def test_no_function_over_60_lines_without_a_reason():
    assert not _long_functions(), "\n".join(_long_functions())


def _import_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
    return names


def test_the_product_never_imports_what_lives_beside_it():
    """scripts/ (benchmarks, the baselines, the acceptance run) sits beside the installed packages:
    it installs its attention from outside, and nothing in them imports it."""
    assert not (ROOT / "lvx_app" / "attention" / "baselines").exists()
    inward = [
        f"{module} imports {name}"
        for module, path in MODULES.items()
        for name in _import_names(path)
        if name == "scripts" or name.startswith("scripts.")
    ]
    assert not inward, "\n".join(inward)


# what each package below the app may not import: the models never the app, the kernels neither
FORBIDDEN = {"lvx_models": ("lvx_app",), "lvx_kernels": ("lvx_app", "lvx_models", "lvx_ui")}


def _forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in deps
        for bad in FORBIDDEN.get(m.split(".")[0], ())
        if d == bad or d.startswith(bad + ".")
    )


def test_the_models_and_the_kernels_never_import_the_app():
    """Two top-level packages never need each other: the models import the kernels (a leaf both
    share) and torch, never lvx_app; the kernels import nothing of ours (function-level and
    type-checking imports count)."""
    assert not _forbidden_imports(GRAPH), "\n".join(_forbidden_imports(GRAPH))


def test_the_import_walk_sees_a_model_importing_the_app():
    graph = {
        "lvx_models.mplug_owl3.hyper": {"lvx_kernels.masks", "lvx_app.cache.store"},
        "lvx_kernels.feed": {"lvx_models.mplug_owl3"},
        "lvx_app.engine.session": {"lvx_models.mplug_owl3", "lvx_kernels.feed"},
    }
    assert _forbidden_imports(graph) == [
        "lvx_kernels.feed imports lvx_models.mplug_owl3",
        "lvx_models.mplug_owl3.hyper imports lvx_app.cache.store",
    ]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import lvx_kernels.merge as m", {"lvx_kernels.merge"}),
        ("from .config import Owl3Config", {"lvx_models.mplug_owl3.config"}),
        ("def f():\n    from lvx_app.engine.api import EngineError", {"lvx_app.engine.api"}),
    ],
)
def test_import_reader_resolves_absolute_relative_and_function_level_imports(
    tmp_path, source, expected
):
    path = tmp_path / "x.py"
    path.write_text(source)
    assert _imported("lvx_models.mplug_owl3.x", path) == expected


def test_layers_of_modules():
    assert layer_of("lvx_app.cli.cache") == 7 and layer_of("lvx_app.video.ingest") == 3
    assert layer_of("lvx_app.engine.session") == 4 and layer_of("lvx_app.defaults") == 0
    assert layer_of("lvx_app.runtime.open") == 5 and layer_of("lvx_app.config") == 0
    assert layer_of("lvx_app.runtime.service") == 5  # the engine every frontend shares
    assert layer_of("lvx_models.mplug_owl3.hyper") == 2 and layer_of("lvx_kernels.feed") == 0
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("lvx_app.new_module")


def test_every_package_folder_is_installed_under_its_import_name():
    """pyproject.toml lists the packages by hand (models/ and ui/ install as lvx_models and lvx_ui),
    so a new folder must be added there or a wheel would leave it out."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert listed == folders


def test_ci_runs_the_readmes_test_line_word_for_word():
    """The README's two copy-paste lines come first; CI runs the second as it is."""
    lines = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("\n```", 1)[0]
    demo, tests = lines.splitlines()
    assert demo.endswith("lvx demo") and tests.endswith(TEST_COMMAND)
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


# the parts of a model only its own folder names: parameters, layer paths, generations
MODEL_PARTS = (
    "language_model", "vision_model", "vision2text_model", "lm_head", "embed_tokens",
    "patch_embedding", "input_layernorm", "self_attn", "q_proj", "k_proj", "v_proj", "o_proj",
    "v_kv_proj", "gate_proj",
)  # fmt: skip
GENERATIONS = {"g1", "g2", "g1-gateproj"}


def _docstrings(tree: ast.AST) -> set[int]:
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, scopes)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _words(node: ast.AST, docstrings: set[int]) -> list[str]:
    """The names and text a node of code holds (not a docstring's)."""
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.arg, ast.keyword)):
        return [node.arg or ""]
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ):
        return [node.value]
    return []


def model_parts_named(source: str) -> list[tuple[int, str]]:
    """(line, part) wherever code names a part of a model: in an identifier, an attribute (`.layers`
    too) or a string; docstrings and comments may still explain."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        for word in _words(node, docstrings):
            bad = [p for p in MODEL_PARTS if p in word]
            bad += [word] if word in GENERATIONS or word == "layers" else []
            found += [(node.lineno, b) for b in bad]
    return sorted(found)


def test_the_training_loop_names_no_part_of_a_model():
    """lvx_app/train reaches a model through its surface (trainable groups, adapter targets, the
    vision split, the parameters behind a layer's visual K/V, checkpointed layers), never by the
    names of its parameters, layers or generations."""
    found = [
        f"{path.relative_to(ROOT)}:{line} names {part}"
        for path in sorted((ROOT / "lvx_app" / "train").glob("*.py"))
        for line, part in model_parts_named(path.read_text())
    ]
    assert not found, "\n".join(found)
    inward = {
        f"{m} imports {d}"
        for m, deps in GRAPH.items()
        if m.startswith("lvx_app.train")
        for d in deps
        if d.startswith("lvx_models") and d != "lvx_models.api"
    }
    assert not inward, "\n".join(sorted(inward))


def test_the_part_scan_sees_attributes_strings_and_generations():
    planted = (
        '"""language_model in a docstring is fine."""\n'
        "x = model.language_model.model.layers[0]  # so is a comment: self_attn\n"
        "p = [n for n in names if '.self_attn.v_kv_proj.' in n]\n"
        "g = form == 'g2'\n"
        "f(proj=m.gate_proj)\n"
    )
    assert model_parts_named(planted) == [
        (2, "language_model"),
        (2, "layers"),
        (3, "self_attn"),
        (3, "v_kv_proj"),
        (3, "v_proj"),
        (4, "g2"),
        (5, "gate_proj"),
    ]
