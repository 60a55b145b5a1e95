"""What the scripts beside the product share: they run as `python3 scripts/NAME.py` from a checkout
that is not installed (scripts/checkout.py), and their results are strict JSON written as they come
(scripts/harness.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import checkout
from scripts import gpu_acceptance as acc
from scripts.harness import Rows, markdown, strict, write_json

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


@pytest.mark.slow
def test_every_script_runs_from_a_checkout_that_is_not_installed(tmp_path: Path) -> None:
    """`python3 scripts/plan_gpu.py --help` and every other script's, with the editable install
    hidden and the packages a bare GPU image lacks hidden too, from outside the checkout."""
    assert {"plan_gpu.py", "bench_chat.py", "bench_xattn.py", "gpu_acceptance.py"} <= {
        p.name for p in WITH_OPTIONS
    }
    env = acc.child_env(True, tmp_path)
    procs = {
        p: subprocess.Popen([sys.executable, str(p), "--help"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for p in WITH_OPTIONS
    }  # fmt: skip
    failed = {}
    for path, proc in procs.items():
        out, err = proc.communicate()
        if proc.returncode != 0 or "usage:" not in out:
            failed[path.name] = err.strip().splitlines()[-1:] or out[-200:]
    assert not failed, failed
