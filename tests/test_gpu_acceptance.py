"""The acceptance command's report logic on CPU: items skipped with their reason, failures recorded
without stopping,
the JSON schema, measured-vs-projected rows, and the one-line exit on a machine without CUDA."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "gpu_acceptance", ROOT / "scripts" / "gpu_acceptance.py"
)
acc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_acceptance"] = acc
_spec.loader.exec_module(acc)


def _runner(outcomes: dict):
    calls = []

    def run(item, timeout_s):
        calls.append((item.name, timeout_s))
        return outcomes[item.name]

    return run, calls


def test_failures_are_recorded_and_the_rest_still_runs() -> None:
    items = [
        acc.Item("a", ["a"], 60),
        acc.Item("b", ["b"], 60),
        acc.Item("hang", ["h"], 60),
        acc.Item("c", ["c"], 60),
    ]
    run, calls = _runner(
        {
            "a": (0, "ok"),
            "b": (3, "Traceback...\nRuntimeError: CUDA error: bad\n"),
            "hang": (None, ""),
            "c": (0, ""),
        }
    )
    results = acc.run_items(items, budget_s=3600, gpus=1, missing={}, runner=run)
    assert [r.status for r in results] == ["passed", "failed", "failed", "passed"]
    assert (
        results[1].reason == "exit 3: RuntimeError: CUDA error: bad"
        and "Traceback" in results[1].tail
    )
    assert results[2].reason.startswith("timed out")
    assert [c[0] for c in calls] == ["a", "b", "hang", "c"]


def test_items_are_skipped_with_their_reason() -> None:
    items = [
        acc.Item("ingest", ["i"], 60, needs=("decord",)),
        acc.Item("nccl", ["n"], 60, min_gpus=2),
        acc.Item("runs", ["r"], 60),
    ]
    run, calls = _runner({"runs": (0, "")})
    results = acc.run_items(
        items, 3600, gpus=1, missing={"decord": "pip install decord"}, runner=run
    )
    assert [r.status for r in results] == ["skipped", "skipped", "passed"]
    assert results[0].reason == "decord not installed (pip install decord)"
    assert results[1].reason == "needs 2+ GPUs, 1 visible"
    assert calls == [("runs", 60)]


def test_only_selects_items_by_name() -> None:
    items = acc.default_items(Path("/tmp/x"), gpus=2)
    acc.select(items, "demo, nccl")
    chosen = [i.name for i in items if i.skip is None]
    assert chosen == ["lvx demo (bf16 on GPU)", "nccl lv_xattn + decode_xattn"]
    run, calls = _runner({name: (0, "") for name in chosen})
    results = acc.run_items(items, 3600, gpus=2, missing={}, runner=run)
    assert [c[0] for c in calls] == chosen
    assert {r.reason for r in results if r.status == "skipped"} == {
        "not selected (--only demo, nccl)"
    }


def test_the_time_budget_caps_each_item_and_skips_the_rest() -> None:
    items = [acc.Item("first", ["f"], 600), acc.Item("second", ["s"], 600)]
    seen = []

    def run(item, timeout_s):
        seen.append(timeout_s)
        return 0, ""

    results = acc.run_items(items, budget_s=20, gpus=1, missing={}, runner=run)
    assert seen == [] and [r.reason for r in results] == ["time budget spent (0 min)"] * 2
    acc.run_items(items[:1], budget_s=100, gpus=1, missing={}, runner=run)
    assert seen == [100]


def test_report_json_schema_and_markdown(tmp_path: Path) -> None:
    chat = tmp_path / "bench_chat_10min.json"
    chat.write_text(
        json.dumps(
            {"rows": [{"minutes": 10.0, "ttft_s": 0.05, "tokens_per_s": 70.0, "peak_gib": 40.0}]}
        )
    )
    results = [
        acc.Result("a", "passed", "", 1.0, "x"),
        acc.Result("b", "failed", "exit 1: boom | bang", 2.0, "y", "boom"),
    ]
    report = acc.Report(
        acc.SCHEMA,
        "2026-11-24T00:00:00+00:00",
        {"gpus": ["H100"]},
        2700,
        {"flash_attn": "pip ..."},
        results,
        acc.compare_chat(tmp_path),
    )
    js, md = acc.write_report(report, tmp_path / "out")
    data = json.loads(js.read_text())
    assert set(data) == {
        "schema",
        "started",
        "machine",
        "budget_s",
        "missing",
        "results",
        "comparison",
    }
    assert data["schema"] == 1
    for r in data["results"]:
        assert set(r) == {"name", "status", "reason", "seconds", "command", "tail"}
        assert r["status"] in ("passed", "failed", "skipped")
    row = data["comparison"][0]
    assert (
        row["TTFT s measured"] == 0.05
        and row["TTFT s projected"] > 0
        and row["peak GiB projected"] > 16
    )
    text = md.read_text()
    assert (
        "| b | failed | 2 | exit 1: boom / bang |" in text
        and "flash_attn" in text
        and "Measured vs projected" in text
    )


def test_default_items_cover_the_issue() -> None:
    names = " ".join(i.name for i in acc.default_items(Path("/tmp/x"), gpus=1))
    for word in (
        "cuda tests",
        "bench_xattn",
        "bench_chat",
        "bench_ingest",
        "bench_finetune",
        "nccl",
        "demo",
    ):
        assert word in names


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_one_line_and_exit_0(capsys, tmp_path: Path) -> None:
    assert acc.main(["--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0]
    assert not (tmp_path / "r").exists()


def test_real_commands_pass_fail_and_time_out() -> None:
    py = sys.executable
    items = [
        acc.Item("ok", [py, "-c", "print('fine')"], 60),
        acc.Item(
            "bad", [py, "-c", "raise SystemExit('CUDA error: no kernel image is available')"], 60
        ),
        acc.Item("slow", [py, "-c", "import time; time.sleep(30)"], 2),
        acc.Item("no such program", ["/nonexistent/lvx-tool"], 60),
    ]
    results = acc.run_items(items, 3600, gpus=1, missing={})
    assert [r.status for r in results] == ["passed", "failed", "failed", "failed"]
    assert results[1].reason == "exit 1: CUDA error: no kernel image is available"
    assert results[2].reason.startswith("timed out after") and results[2].seconds < 20
    assert results[3].reason.startswith("exit 1: [Errno 2]")


def _nccl_check_rank(rank: int, world: int, dtype: str) -> dict:
    spec = importlib.util.spec_from_file_location("nccl_check", ROOT / "scripts" / "nccl_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.check(getattr(torch, dtype), rank, world, torch.device("cpu"))


def test_the_nccl_check_passes_over_gloo() -> None:
    """The acceptance's NCCL item, run over gloo on 2 CPU ranks: the same comparison with one
    process."""
    from lvx_app.parallel.testing import run_ranks

    for result in run_ranks(_nccl_check_rank, 2, "float32"):
        assert (
            result["ok"]
            and result["lv_xattn_max_err"] < 1e-5
            and result["decode_xattn_max_err"] < 1e-5
        )
