"""What the scripts beside the product share: they run as `python3 scripts/NAME.py` from a checkout
that is not installed (scripts/checkout.py), and their results are strict JSON written as they come
(scripts/harness.py)."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import checkout
from scripts import gpu_acceptance as acc
from scripts.harness import Rows, dumps, markdown, strict, write_json

ROOT = Path(__file__).resolve().parents[1]
# every script with options of its own (guard.py and versions.py take none, nccl_check.py runs
# under torchrun)
WITH_OPTIONS = sorted(
    p for p in (ROOT / "scripts").rglob("*.py") if "argparse.ArgumentParser(" in p.read_text()
)


def test_strict_json_has_no_nan_and_a_keyed_write_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "out" / "figures.json"
    write_json(path, {"peak_gib": float("nan"), "rows": [(1, math.inf)], "where": tmp_path})
    assert json.loads(path.read_text()) == {
        "peak_gib": None, "rows": [[1, None]], "where": str(tmp_path),
    }  # fmt: skip
    shared = tmp_path / "shared.json"
    write_json(shared, {"ok": True}, key="checks")
    write_json(shared, {"ok": False}, key="lv_xattn")
    write_json(shared, {"ok": None}, key="checks")
    assert json.loads(shared.read_text()) == {"checks": {"ok": None}, "lv_xattn": {"ok": False}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "shared.json"], "no temp files"
    assert strict({"a": [float("-inf")]}) == {"a": [None]}


def test_every_json_the_scripts_write_or_print_is_strict() -> None:
    """No script writes or prints NaN as JSON: every json.dump(s) in scripts/ refuses it
    (`harness.dumps` and `write_json` make figures strict first)."""
    lax = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            call = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(call, ast.Attribute)
                and call.attr in ("dump", "dumps")
                and isinstance(call.value, ast.Name)
                and call.value.id == "json"
            ):
                strict_ = any(
                    k.arg == "allow_nan" and getattr(k.value, "value", True) is False
                    for k in node.keywords
                )
                lax += [] if strict_ else [f"{path.relative_to(ROOT)}:{node.lineno}"]
    assert not lax, lax
    assert json.loads(dumps({"peak_gib": float("nan")})) == {"peak_gib": None}


def test_rows_are_on_disk_as_soon_as_each_is_added(tmp_path: Path) -> None:
    rows = Rows(tmp_path / "bench.json", command="x")
    rows.add({"minutes": 10, "ttft_s": 0.5})
    assert json.loads((tmp_path / "bench.json").read_text()) == {
        "command": "x", "rows": [{"minutes": 10, "ttft_s": 0.5}],
    }  # fmt: skip
    rows.add({"minutes": 60, "ttft_s": float("nan")})
    rows.save(fallbacks=[])
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["rows"][1]["ttft_s"] is None and data["fallbacks"] == []
    assert markdown(rows.rows).splitlines()[2] == "| 10 | 0.5 |"


def test_the_checkout_is_linked_only_where_lvx_is_not_installed_from_it(tmp_path: Path) -> None:
    assert checkout.installed_here()
    folder = checkout.link_folder(tmp_path / "links")
    assert {p.name: p.resolve() for p in folder.iterdir()} == {
        name: ROOT / source for name, source in checkout.PACKAGES.items()
    }
    env = checkout.with_path({"PYTHONPATH": "/a"}, folder)
    assert env["PYTHONPATH"].split(":") == [str(folder), "/a"]


def test_a_bare_image_does_not_find_lvx_until_a_script_links_it(tmp_path: Path) -> None:
    """The environment the next test runs the scripts in: no lvx installed, no checkout on the
    path; importing the package `scripts` from the checkout finds the packages again."""
    env = acc.child_env(True, tmp_path)
    find = "import importlib.util as u; print(u.find_spec('lvx_models') is None)"
    done = subprocess.run([sys.executable, "-c", find], cwd=tmp_path, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert done.stdout.strip() == "True", done.stderr
    code = "import scripts, lvx_models, lvx_ui; print(scripts.HOW_LVX_IMPORTS)"
    env = {**env, "PYTHONPATH": f"{ROOT}:{env['PYTHONPATH']}"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert done.stdout.startswith("not installed: the checkout's packages linked into"), done.stderr


# Runs each script as `python3 PATH --help` would (its folder first on sys.path, run as __main__)
# in a child forked from one Python that has imported torch already: a Python per script would
# import torch once each.
AS_MAIN_FORKED = """
import json, os, runpy, sys, traceback
import torch  # noqa: F401 - what every child would import first, imported once
for path in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps([os.path.basename(path), code, "usage:" in said, said[-300:]]))
"""


@pytest.mark.slow
def test_every_script_runs_from_a_checkout_that_is_not_installed(tmp_path: Path) -> None:
    """`python3 scripts/plan_gpu.py --help` and every other script's, with the editable install
    hidden and the packages a bare GPU image lacks hidden too, from outside the checkout."""
    assert {"plan_gpu.py", "bench_chat.py", "bench_xattn.py", "gpu_acceptance.py"} <= {
        p.name for p in WITH_OPTIONS
    }
    env = acc.child_env(True, tmp_path)
    done = subprocess.run([sys.executable, "-c", AS_MAIN_FORKED, *map(str, WITH_OPTIONS)],
                          cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert [name for name, *_ in rows] == [p.name for p in WITH_OPTIONS], done.stderr[-2000:]
    failed = {name: said for name, code, usage, said in rows if code != 0 or not usage}
    assert not failed, failed
