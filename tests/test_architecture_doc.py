"""docs/architecture.md names real code: every function, class and file its walks (a question to
the kernel, `--fps` to the decoder, an API request to the engine, ...), its wire table and its
CUDA-only table name exists, so a rename or a removal shows up here instead of in a reader's
search. The three walks also keep no more stops than they have now.

The walks' cells read `path/to/file.py: Class.method` → `other_method` (a bare name belongs to the
last file named before it in the cell), `path.py` alone, or a name in parentheses (an aside, which
may live anywhere in the product). Names are looked up in the files' syntax trees, not imported.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
FOLDERS = ("", "lvx_app/")  # where a path the page gives may start (or beside the last one)
PACKAGE_FOLDERS = ("lvx_app", "lvx_kernels", "models", "ui")
PRODUCT = [p for folder in PACKAGE_FOLDERS for p in (ROOT / folder).rglob("*.py")]
IDENT = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
# the tables that name code, by their header's words, and the column of each that does
CODE_TABLES = {"file: function": 1, "sender → receiver": 1, "CUDA-only lines": 0}
WALKS = {
    # title -> most stops along one path (the names outside asides, an "or" counted once): the
    # walks as they are now. Counted so, the page's walks before one request per load and the
    # engine service had 33, 22 and 16 stops.
    "One question": 33,
    "`--fps`": 11,
    "A request to the OpenAI-compatible API": 12,
}


def _sections() -> dict[str, str]:
    return dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", DOC, flags=re.S | re.M))


def _code_tables() -> dict[str, tuple[str, list[str]]]:
    """title -> (the section's text, the cells of its table's code column, top to bottom)."""
    out = {}
    for title, body in _sections().items():
        lines = [line for line in body.splitlines() if line.startswith("|")]
        column = next((c for word, c in CODE_TABLES.items() if lines and word in lines[0]), None)
        if column is not None:
            cells = [line.strip().strip("|").split("|")[column].strip() for line in lines[2:]]
            out[title] = (body, cells)
    return out


def _file(given: str, beside: Path | None) -> Path | None:
    """The product file a page's path names: beside the last file named, from the root, or under
    lvx_app/."""
    candidates = [ROOT / (folder + given) for folder in FOLDERS]
    if beside is not None:
        candidates.insert(0, beside.parent / given)
    return next((p for p in candidates if p.is_file()), None)


@cache
def _index(path: Path) -> tuple[dict[str, str], dict[str, tuple[list[str], set[str]]]]:
    """(top-level name -> kind ("def", "class", "value"), class -> (its bases, its members)) of a
    file's syntax tree; members are methods, attributes and nested classes."""

    def defined(node: ast.AST) -> list[tuple[str, str]]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return [(node.name, "def")]
        if isinstance(node, ast.ClassDef):
            return [(node.name, "class")]
        if isinstance(node, ast.Assign):
            return [(t.id, "value") for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [(node.target.id, "value")]
        return []

    top: dict[str, str] = {}
    classes: dict[str, tuple[list[str], set[str]]] = {}
    for node in ast.parse(path.read_text()).body:
        top.update(defined(node))
        if isinstance(node, ast.ClassDef):
            bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
            members = {name for inner in node.body for name, _ in defined(inner)}
            classes[node.name] = (bases, members)
    return top, classes


def _class_has(name: str, member: str, seen: frozenset = frozenset()) -> bool:
    """Whether class `name` (anywhere in the product) defines `member`, or inherits it from a
    product class."""
    for path in PRODUCT:
        bases, members = _index(path)[1].get(name, ([], set()))
        if member in members:
            return True
        if any(b not in seen and _class_has(b, member, seen | {name}) for b in bases):
            return True
    return False


def _defines(path: Path, name: str) -> bool:
    """Whether `path` defines `name`: a top-level name, `Class.member` (inherited too), a member
    of one of its classes given bare, or `VALUE.attribute` of a top-level value (a command)."""
    top, classes = _index(path)
    head, _, rest = name.partition(".")
    if not rest:
        return name in top or any(name in members for _, members in classes.values())
    if head in classes:
        return "." not in rest and _class_has(head, rest)
    return top.get(head) == "value"


def _references(cell: str) -> list[tuple[str, str, bool]]:
    """(span, its text, whether inside an aside in parentheses) for each code span of a cell."""
    out, depth, pos = [], 0, 0
    for match in re.finditer(r"`([^`]+)`", cell):
        between = cell[pos : match.start()]
        depth = max(0, depth + between.count("(") - between.count(")"))
        out.append((match.group(0), match.group(1), depth > 0))
        pos = match.end()
    return out


def _named_files(text: str) -> list[Path]:
    """The product files a section's text names by their path from the root or lvx_app/."""
    spans = re.findall(r"`([\w/]+\.py)(?::[^`]*)?`", text)
    return [p for p in (_file(s, None) for s in spans) if p is not None]


def _unresolved(cells: list[str], text: str = "") -> list[str]:
    """What a table's cells name that is no code. `file: name`: the file must define it; a bare
    name outside an aside: the last file named, or another file the section names; a capitalised
    name in an aside (`Class`, `Class.member`): some file of the product. Lower-case asides,
    flags and constants are words, not checked."""
    wrong, last = [], None
    files = _named_files(text + "\n".join(cells))
    for cell in cells:
        for span, given, aside in _references(cell):
            path_part, _, name = given.rpartition(": ")
            if not path_part and given.endswith(".py"):
                path_part, name = given, ""
            if path_part:
                last = _file(path_part, last)
                if last is None:
                    wrong.append(f"{span}: no such file")
                    continue
            found = re.match(IDENT, name)
            name = found.group(0) if found else ""
            if not name or (name.isupper() and not path_part) or name.startswith("torch."):
                continue  # a flag, a value, a command's constant, torch's own
            if path_part:
                if not _defines(last, name):
                    wrong.append(f"{span}: not defined in {last.relative_to(ROOT)}")
            elif not aside:
                if not any(_defines(p, name) for p in [last, *files] if p is not None):
                    wrong.append(f"{span}: defined in no file the section names")
            elif name[0].isupper() and not any(_defines(p, name) for p in PRODUCT):
                wrong.append(f"{span}: defined nowhere in the product")
    return wrong


def test_the_page_has_the_walks_and_tables() -> None:
    titles = list(_code_tables())
    for word in WALKS:
        assert any(title.startswith(word) for title in titles), (word, titles)
    assert len(titles) >= len(WALKS) + 2  # the wire and the CUDA-only code too


@pytest.mark.parametrize("title", list(_code_tables()), ids=lambda t: t[:40])
def test_every_name_a_walk_gives_is_real_code(title: str) -> None:
    text, cells = _code_tables()[title]
    wrong = _unresolved(cells, text)
    assert not wrong, "\n".join(wrong)


def _stops(cells: list[str]) -> int:
    """Stops along one path of a walk: the names outside asides, each `or` counted once."""
    stops = 0
    for cell in cells:
        stops += sum(not aside for _, _, aside in _references(cell))
        stops -= len(re.findall(r"`\s+or\s+`", re.sub(r"\([^()]*\)", "", cell)))
    return stops


@pytest.mark.parametrize("word", list(WALKS))
def test_no_walk_grows(word: str) -> None:
    cells = next(cells for title, (_, cells) in _code_tables().items() if title.startswith(word))
    assert _stops(cells) <= WALKS[word]


def test_a_name_that_is_not_there_is_found() -> None:
    """The checker itself: a renamed method, a missing file, a name beside the wrong file and an
    aside named nowhere fail; a path beside the last file, an inherited method and an aside that
    exists pass."""
    cells = [
        "`lvx_app/runtime/engine_handle.py: Engine.ask` → `Engine.ask_twice`",
        "`lvx_app/runtime/no_such.py: open_engine`",
        "`lvx_app/engine/session.py: RankSession.ask` (`NoSuchFeed` rides on it)",
        "`lvx_app/engine/session.py: RankSession.ask` → `qwen2.py: Qwen2LM.forward`",
    ]
    assert _unresolved(cells) == [
        "`Engine.ask_twice`: defined in no file the section names",
        "`lvx_app/runtime/no_such.py: open_engine`: no such file",
        "`NoSuchFeed`: defined nowhere in the product",
        "`qwen2.py: Qwen2LM.forward`: no such file",
    ]
    good = [
        "`models/mplug_owl3/modeling.py: Owl3Model.forward` → `qwen2.py: Qwen2LM.forward` "
        "(`Feed`, `StepContext`)",
        "`lvx_app/engine/parallelize.py: ShardedAttention.sharded_feed` → `ShardedHooks.ring`",
    ]
    assert _unresolved(good) == []


def test_stops_count_one_path() -> None:
    cells = ["`a.py: f` → `g` (`h`, the aside) → `i` (one) or `j` (other)", "`k`"]
    assert _stops(cells) == 4
