"""The acceptance command on CPU: items skipped with their reason, failures, hangs and crashes
recorded without stopping, the report rewritten after every item, the parts, and the rehearsal (the
same harness on CPU in an environment that mimics a bare GPU image), killed or run to the end."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scripts import gpu_acceptance as acc

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.py"
CUDA_TESTS = 11  # the CUDA-marked tests of tests/test_attention_kernels.py


def _runner(outcomes: dict):
    calls = []

    def run(item, timeout_s):
        calls.append((item.name, timeout_s))
        outcome = outcomes[item.name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return run, calls


def test_failures_are_recorded_and_the_rest_still_runs() -> None:
    items = [
        acc.Item("a", ["a"], 60),
        acc.Item("b", ["b"], 60),
        acc.Item("hang", ["h"], 60),
        acc.Item("crash", ["x"], 60),
        acc.Item("c", ["c"], 60),
    ]
    run, calls = _runner(
        {
            "a": (0, "ok"),
            "b": (3, "Traceback...\nRuntimeError: CUDA error: bad\n"),
            "hang": (None, ""),
            "crash": ValueError("a bug in the harness"),
            "c": (0, "fine\n"),
        }
    )
    results = acc.run_items(items, budget_s=3600, gpus=1, missing={}, runner=run)
    assert [r.status for r in results] == ["passed", "failed", "failed", "failed", "passed"]
    assert (
        results[1].reason == "exit 3: RuntimeError: CUDA error: bad"
        and "Traceback" in results[1].tail
    )
    assert results[2].reason.startswith("timed out")
    assert results[3].reason == (
        "exit 1: the harness failed running this item: ValueError: a bug in the harness"
    )
    assert results[4].tail == "fine", "passed items keep their output's tail too"
    assert [c[0] for c in calls] == ["a", "b", "hang", "crash", "c"]


def test_the_report_is_saved_at_every_change_and_a_signal_stops_the_run() -> None:
    """Pending, running, finished: every change reaches `on_change` (the report on disk), and a
    signal to the harness fails the running item, leaves the rest pending and is raised."""
    items = [acc.Item(n, [n], 60) for n in ("first", "second", "third")]
    run, _ = _runner({"first": (0, ""), "second": acc.Stopped(signal.SIGTERM)})
    seen = []
    with pytest.raises(acc.Stopped):
        acc.run_items(
            items, 3600, 1, {}, run, on_change=lambda rs: seen.append([r.status for r in rs])
        )
    assert seen == [
        ["pending", "pending", "pending"],
        ["running", "pending", "pending"],
        ["passed", "pending", "pending"],
        ["passed", "running", "pending"],
        ["passed", "failed", "pending"],
    ]


def test_items_are_skipped_with_their_reason() -> None:
    items = [
        acc.Item("ingest", ["i"], 60, needs=("decord", "av")),
        acc.Item("nccl", ["n"], 60, min_gpus=2),
        acc.Item("runs", ["r"], 60),
    ]
    run, calls = _runner({"runs": (0, "")})
    how = "bring the wheel"
    results = acc.run_items(items, 3600, gpus=1, missing={"decord": how, "av": how}, runner=run)
    assert [r.status for r in results] == ["skipped", "skipped", "passed"]
    assert results[0].reason == "decord, av not installed (bring the wheel)"
    assert results[1].reason == "needs 2+ GPUs, 1 visible"
    assert calls == [("runs", 60)]


def test_only_selects_items_by_name(tmp_path: Path) -> None:
    items = acc.default_items(tmp_path / "out", tmp_path / "scratch", gpus=2)
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


@pytest.mark.parametrize("rehearse", [False, True], ids=["gpu", "rehearsal"])
def test_each_part_fits_one_command_and_one_kept_folder(tmp_path: Path, rehearse: bool) -> None:
    """Four presets cover every item; each writes its figures under --out only, at most 8 files
    (with the report's three), and the default budget is 9 minutes."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    items = acc.default_items(out, scratch, gpus=2, rehearse=rehearse)
    names = {p: [i.name for i in acc.of_part(items, p)] for p in ("1", "2", "3", "4")}
    assert names["1"][:2] == ["cuda tests", "adapter checks (fake CUDA tensors, CPU stand-ins)"]
    assert names["1"][2:] == ["bench_xattn kernels", "bench_chat --mode model 10 min"]
    assert names["2"] == ["bench_chat --mode model 30 min", "bench_chat --mode model 60 min"]
    assert [n.split(" ")[0] for n in names["3"]] == [
        "bench_finetune",
        "lvx",
        "bench_ingest",
        "nccl",
        "ring/gather",
    ]
    assert names["4"] == ["bench_decode syncs, launches, tok/s"]
    assert sum(map(len, names.values())) == len(items)
    for part in names:
        writes = [w for i in acc.of_part(items, part) for w in i.writes]
        assert len(writes) + 3 <= 8 and len(set(writes)) == len(writes)
        for item in acc.of_part(items, part):
            paths = [a for a in item.command if a.startswith(str(tmp_path))]
            assert all(a.startswith((str(out), str(scratch))) for a in paths), item.command
            assert all(str(out / w) in item.command for w in item.writes)
            if "--device" in item.command:
                device = item.command[item.command.index("--device") + 1]
                assert device == ("cpu" if rehearse else "cuda"), item.command
    assert acc.parse_args(["--out", "x"]).budget_min == 9
    assert acc.default_items(out, scratch, 1)[0].command[-1] == "tests/test_attention_kernels.py"


def test_report_json_schema_and_markdown(tmp_path: Path) -> None:
    (tmp_path / "bench_chat_10min.json").write_text(
        json.dumps(
            {"rows": [{"minutes": 10.0, "ttft_s": 0.05, "tokens_per_s": 70.0, "peak_gib": 40.0}]}
        )
    )
    small = {"shape": "small", "minutes": 0.3, "ttft_s": 0.1, "tokens_per_s": 9.0, "peak_gib": 0}
    (tmp_path / "bench_chat_30min.json").write_text(json.dumps({"rows": [small]}))
    results = [
        acc.Result("a", "passed", "", 1.0, "x", "ok", {"skipped": 11, "deselected": 78}),
        acc.Result("b", "failed", "exit 1: boom | bang", 2.0, "y", "boom"),
        acc.Result("c", "passed", "1 fallback", 3.0, "z", fallbacks=["cudnn attn_fwd: ..."]),
        acc.Result("d", "pending", "", 0.0, "w"),
    ]
    report = acc.Report(
        acc.SCHEMA, "2026-11-24T00:00:00+00:00", "gpu", "1", {"gpus": ["H100"]}, 540,
        {"flash_attn": "optional"}, "installed", results, acc.compare_chat(tmp_path),
    )  # fmt: skip
    js, md = acc.write_report(report, tmp_path / "out")
    data = json.loads(js.read_text())
    assert set(data) == {
        "schema", "started", "mode", "part", "machine", "budget_s", "missing", "checkout",
        "results", "comparison", "notes", "updated", "finished",
    }  # fmt: skip
    assert data["schema"] == 2 and data["finished"] is False
    for r in data["results"]:
        assert set(r) == {
            "name", "status", "reason", "seconds", "command", "tail", "counts", "fallbacks",
        }  # fmt: skip
    assert len(data["comparison"]) == 1, "small-shape rows have no projection"
    row = data["comparison"][0]
    assert row["TTFT s measured"] == 0.05 and row["peak GiB projected"] > 16
    text = md.read_text()
    assert "NOT FINISHED" in text and "| a | passed | 1 | 11 skipped, 78 deselected |" in text
    assert "| b | failed | 2 | exit 1: boom / bang |" in text and "flash_attn" in text
    assert "- c: cudnn attn_fwd: ..." in text and "Measured vs projected" in text
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "acceptance.json",
        "acceptance.md",
    ]


def test_pytest_counts_and_benchmark_fallbacks_reach_the_result(tmp_path: Path) -> None:
    assert acc.pytest_counts("...\n11 skipped, 78 deselected, 1 warning in 0.06s\n") == {
        "skipped": 11,
        "deselected": 78,
        "warnings": 1,
    }
    assert acc.pytest_counts("== 1 failed, 2 passed, 1 error in 3.1s ==") == {
        "failed": 1,
        "passed": 2,
        "errors": 1,
    }
    (tmp_path / "bench.json").write_text(json.dumps({"fallbacks": ["cudnn attn_fwd: x (3 calls)"]}))
    item = acc.Item("bench", ["b"], 60, writes=("bench.json",))
    run, _ = _runner({"bench": (0, "done")})
    (result,) = acc.run_items([item], 3600, 1, {}, run, out=tmp_path)
    assert result.status == "passed" and result.fallbacks == ["cudnn attn_fwd: x (3 calls)"]
    assert result.reason == "1 attention-kernel fallback(s): cudnn attn_fwd: x (3 calls)"


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
    assert results[0].tail.endswith("fine")
    assert results[1].reason == "exit 1: CUDA error: no kernel image is available"
    assert results[2].reason.startswith("timed out after") and results[2].seconds < 20
    assert results[3].reason.startswith("exit 1: [Errno 2]")


def test_a_stopped_item_takes_its_whole_process_group_along() -> None:
    """What a timed-out item gets: its children (torchrun's ranks, pytest's workers) die with it."""
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(p.pid, flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    grandchild = int(proc.stdout.readline())
    acc._kill_group(proc)
    assert proc.returncode == -signal.SIGTERM
    while True:  # killed with its group: gone once its new parent reaps it
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    proc.stdout.close()


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_chat_model_rows_build_in_the_target_dtype_and_take_medians(monkeypatch) -> None:
    """The weights are cast on meta, before any storage exists (no float32 7B on the GPU); each row
    has a warm-up question, three timed ones and the kernels every phase ran."""
    bench = _script("bench_chat")
    seen = []
    real = torch.nn.Module.to_empty

    def to_empty(module, *args, **kwargs):
        seen.append({p.dtype for p in module.parameters()})
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)
    model = bench._random_model("small", torch.device("cpu"), torch.bfloat16)
    assert seen == [{torch.bfloat16}] and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    (row,) = bench.bench_model([0.05], 1.0, 2, torch.device("cpu"), "small")
    assert row["shape"] == "small" and row["frames"] == 3 and len(row["ttft_s_all"]) == 3
    assert row["ttft_s"] == sorted(row["ttft_s_all"])[1] and row["fallbacks"] == []
    assert set(row["kernels"]) == {
        "visual K/V", "video prompt prefill", "warm-up question", "question (TTFT)", "decode",
    }  # fmt: skip
    calls = {phase: seen.get("fwd cpu", 0) for phase, seen in row["kernels"].items()}
    # the warm-up is one question plus as many decoded tokens as the timed decode
    assert calls["question (TTFT)"] == 3 * (calls["warm-up question"] - calls["decode"]) > 0


def _nccl_check_rank(rank: int, world: int, dtype: str) -> dict:
    spec = importlib.util.spec_from_file_location("nccl_check", ROOT / "scripts" / "nccl_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.check(getattr(torch, dtype), rank, world, torch.device("cpu"))


def test_the_nccl_check_passes_over_gloo() -> None:
    """The acceptance's NCCL item, run over gloo on 2 CPU ranks: the same comparison with one
    process."""
    from scripts.gloo_ranks import run_ranks

    for result in run_ranks(_nccl_check_rank, 2, "float32"):
        assert (
            result["ok"]
            and result["lv_xattn_max_err"] < 1e-5
            and result["decode_xattn_max_err"] < 1e-5
        )


# ----------------------------------------------------------------------------- the rehearsal


@pytest.fixture
def bare_image(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """The rehearsal's child environment: packages a bare GPU image lacks hidden, lvx not installed
    (and linked back in by the harness)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # `importable` extends this process's path
    env, how, found = acc.importable(acc.child_env(True, tmp_path), tmp_path)
    assert how.startswith("not installed") and found == {
        "decord": False, "av": False, "flash_attn": False,
        "lvx_app": True, "lvx_models": True, "lvx_ui": True,
    }  # fmt: skip
    return env


def test_the_bare_image_hides_packages_and_distributions(bare_image, tmp_path: Path) -> None:
    code = (
        "import importlib.metadata as m, importlib.util as u\n"
        "for name in ('av', 'gradio_client', 'decord', 'playwright'):\n"
        "    assert u.find_spec(name) is None, name\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "names = {(d.metadata['Name'] or '').lower() for d in m.distributions()}\n"
        "assert 'torch' in names and 'pytest' in names and not names & {'av', 'gradio'}, names\n"
        "import lvx_models, lvx_ui\n"
        "print(lvx_models.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=bare_image, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path / "site" / "lvx_models"))


@pytest.mark.slow
def test_every_test_file_collects_on_a_bare_image(bare_image) -> None:
    """`pytest -m cuda tests/` where gradio, gradio_client, playwright and PyAV are missing: the
    files that need them skip, and the CUDA tests are collected (skipped without a GPU)."""
    done = subprocess.run(
        acc._pytest("-m", "cuda", "tests/"), cwd=ROOT, env=bare_image, capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"SKIPPED [{CUDA_TESTS - 1}] tests/test_attention_kernels.py" in done.stdout
    assert "could not import 'av'" in done.stdout and "gradio_client" in done.stdout
    assert "error" not in acc.pytest_counts(done.stdout)


TAG = "LVX_ACCEPTANCE_TEST"  # marks the processes a test's harness started


def _kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment holds `tag` (what a killed harness left running)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if tag.encode() + b"\0" in (proc / "environ").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def _report(out: Path) -> dict | None:
    try:
        return json.loads((out / "acceptance.json").read_text())
    except FileNotFoundError:
        return None


@pytest.mark.slow
def test_a_rehearsal_killed_after_its_first_item_leaves_a_valid_report(tmp_path: Path) -> None:
    """SIGKILL (nothing to catch) right after the first item: acceptance.json is whole and lists it,
    with the CUDA tests collected on the mimicked GPU image and counted."""
    out, tag = tmp_path / "out", f"{TAG}={tmp_path}"
    with open(tmp_path / "stdout", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--rehearse", "--part", "1", "--out", str(out)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, TAG: str(tmp_path), "TMPDIR": str(tmp_path)},  # its scratch too
        )  # fmt: skip
    try:
        while proc.poll() is None:
            report = _report(out)
            if report and report["results"][0]["status"] not in ("pending", "running"):
                break
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):  # it may have ended on its own: see below
            os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        _kill_tagged(tag)  # the item it had started runs in a session of its own
    report = json.loads((out / "acceptance.json").read_text())
    first, rest = report["results"][0], report["results"][1:]
    assert report["mode"] == "rehearsal" and report["finished"] is False, report
    assert first["name"] == "cuda tests" and first["status"] == "passed", first
    assert first["counts"] == {"skipped": CUDA_TESTS, "deselected": first["counts"]["deselected"]}
    assert len(rest) == 3 and {r["status"] for r in rest} <= {"pending", "running"}
    assert report["checkout"].startswith("not installed") and set(report["missing"]) == {
        "decord", "av", "flash_attn",
    }  # fmt: skip
    assert "NOT FINISHED" in (out / "acceptance.md").read_text()


@pytest.mark.slow
def test_the_whole_rehearsal_runs_every_part(tmp_path: Path) -> None:
    """Every item of every part on CPU in the mimicked GPU image: the ones that decode video are
    skipped (no decord or PyAV there), every other one passes and leaves its JSON."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rehearse", "--out", str(out)], cwd=ROOT,
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "acceptance.json").read_text())
    status = {r["name"]: r["status"] for r in report["results"]}
    assert report["finished"] and len(status) == 12
    assert {n for n, s in status.items() if s == "skipped"} == {"lvx demo", "bench_ingest"}
    assert {n for n, s in status.items() if s != "skipped"} == {
        n for n, s in status.items() if s == "passed"
    }
    for name in (
        "bench_xattn",
        "bench_chat_10min",
        "bench_chat_60min",
        "bench_finetune",
        "bench_decode",
    ):
        data = json.loads((out / f"{name}.json").read_text())
        assert data.get("fallbacks", []) == []
    chat = json.loads((out / "bench_chat_30min.json").read_text())["rows"][0]
    assert len(chat["ttft_s_all"]) == 3 and chat["kernels"]["question (TTFT)"]
    assert (
        "[10/12] nccl" in done.stdout and "===== cuda tests" in (out / "acceptance.log").read_text()
    )
    calibration = json.loads((out / "calibration.json").read_text())
    assert set(calibration["gather_max_rows"]) == {"2"}  # the rehearsal's two ranks, under --out
