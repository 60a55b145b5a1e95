"""The shape of the tree (docs/architecture.md): imports go one way, no file cycles, no unexplained
long function.

The layers are listed once, here and in docs/architecture.md; a module may import its own layer or
lower ones.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
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


# The app and the page reach the models through one surface (lvx_models.api) and name none of a
# model's parts. Folders another branch still moves onto the surface, checked by that branch with
# these same tests; empty this at the merge.
NOT_YET_ON_THE_SURFACE: tuple[str, ...] = ()
SURFACE = "lvx_models.api"
# what only a model's own folder may name: its parameters and layer paths...
MODEL_PARTS = (
    "language_model",
    "vision_model",
    "vision2text_model",
    "multi_modal_projector",
    "v_kv_proj",
    "self_attn",
    "gate_proj",
    "input_layernorm",
    "embed_tokens",
    "patch_embedding",
    "lm_head",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
)
# ...and its generations' names (the app takes them from the family's `generations`)
GENERATION_NAMES = ("g1", "g2", "g1-gateproj")


def _on_the_surface(module: str) -> bool:
    """A module of the app or the page that the surface rules hold for."""
    if module.split(".")[0] not in ("lvx_app", "lvx_ui"):
        return False
    return not any(module == m or module.startswith(m + ".") for m in NOT_YET_ON_THE_SURFACE)


def _past_the_surface(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        if _on_the_surface(m)
        for d in deps
        if d.split(".")[0] == "lvx_models" and d != SURFACE
    )


def test_the_app_imports_the_models_only_through_their_surface():
    assert not _past_the_surface(GRAPH), "\n".join(_past_the_surface(GRAPH))


def test_the_import_walk_sees_the_app_past_the_surface():
    graph = {
        "lvx_app.engine.session": {"lvx_models.api", "lvx_models.mplug_owl3.config"},
        "lvx_ui.app": {"lvx_models"},
        "lvx_models.api": {"lvx_models.mplug_owl3.family"},
    }
    assert _past_the_surface(graph) == [
        "lvx_app.engine.session imports lvx_models.mplug_owl3.config",
        "lvx_ui.app imports lvx_models",
    ]


_PART = re.compile(r"\b(" + "|".join(MODEL_PARTS) + r")\b")


def model_names(source: str) -> list[str]:
    """Where `source` names a model's part or generation in its code: a name or attribute, or a
    string constant that is a generation's name or holds a part's name (f-strings included);
    comments and docstrings (any bare string statement) say what they like."""
    bare = [
        ((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset))
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    ]
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string in MODEL_PARTS:
            found.append(f"{tok.start[0]}: {tok.string}")
        elif tok.type == tokenize.STRING:
            if any(start <= tok.start and tok.end <= end for start, end in bare):
                continue
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # an f-string: its text, braces and all
                value = tok.string
            if isinstance(value, str) and (value in GENERATION_NAMES or _PART.search(value)):
                found.append(f"{tok.start[0]}: {tok.string}")
    return found


def test_the_app_names_no_part_or_generation_of_a_model():
    """Outside a model's folder nothing names a parameter, a layer path or a generation of one:
    the app asks the model (its methods, its config's generic sizes, its family's records)."""
    named = [
        f"{path.relative_to(ROOT)}:{where}"
        for module, path in MODULES.items()
        if _on_the_surface(module)
        for where in model_names(path.read_text())
    ]
    assert not named, "\n".join(named)


@pytest.mark.parametrize(
    "source, found",
    [
        ("x = model.language_model(ids)", ["1: language_model"]),
        ("if cfg.form == 'g2':\n    pass", ["1: 'g2'"]),
        ("w = getattr(layer, 'self_attn').q", ["1: 'self_attn'"]),
        ('key = f"language_model.{name}"', ['1: f"language_model.{name}"']),
        ('def f():\n    """Calls language_model, "g2"."""\n    # self_attn\n    return 1', []),
        ("help = 'the g2 generation'", []),
    ],
)
def test_the_model_name_scan_reads_code_not_prose(source, found):
    assert model_names(source) == found


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import lvx_kernels.merge as m", {"lvx_kernels.merge"}),
        ("from .config import Owl3Config", {"lvx_models.mplug_owl3.config"}),
        (
            "def f():\n    from lvx_app.engine.records import EngineError",
            {"lvx_app.engine.records"},
        ),
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


MAX_BENCHMARK_LINES = 350  # docs/benchmarks.md: every current number, no superseded table


def test_the_benchmarks_page_stays_short():
    lines = (ROOT / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= MAX_BENCHMARK_LINES, (
        f"docs/benchmarks.md is {lines} lines, over {MAX_BENCHMARK_LINES}: merge superseded tables"
    )
