"""`lvx eval videomme` end to end with a tiny checkpoint: answers, report files, and resume."""

from __future__ import annotations

import json

from typer.testing import CliRunner
from videomme_fixtures import make_mini_videomme

from lvx_app.cli import app


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if '"question_id"' in line]


def test_eval_runs_and_resumes(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "cache"))
    mini = make_mini_videomme(tmp_path / "videomme")
    out = tmp_path / "results.jsonl"
    args = ["eval", "videomme", "--data", str(mini.root), "--model", tiny_checkpoints["g2"], "--gpus", "0",
            "--out", str(out), "--max-new-tokens", "4"]  # fmt: skip
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    records = _records(out)
    answerable = [r for r in mini.rows if r["videoID"] not in mini.missing]
    assert sorted(r["question_id"] for r in records) == sorted(r["question_id"] for r in answerable)
    assert all("response" in r or "raw" in r or "output" in r for r in records)
    assert out.with_suffix(".summary.json").exists() and out.with_suffix(".png").exists()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert len(_records(out)) == len(records), "a rerun must not answer anything twice"
