"""`scripts/bench_families.py` reads the families from the registry: a family registered later
(a stub titled OpenFlamingo, at tiny sizes) appears in its table with the paper's numbers for it,
with no edit of the script."""

from __future__ import annotations

import json
from dataclasses import replace

import lvx_models.api as api
from lvx_models.api import FAMILIES
from lvx_models.mplug_owl3.tiny import tiny_config
from scripts import bench_families


def test_a_registered_family_appears_with_the_papers_numbers(tmp_path, monkeypatch):
    tiny = {"tiny": tiny_config("g2")}
    stub = replace(FAMILIES["mplug_owl3"], name="stub", title="OpenFlamingo", published=tiny)
    monkeypatch.setitem(api.FAMILIES, "stub", stub)
    out = tmp_path / "families.json"
    argv = ["--families", "stub", "--frames", "2", "--iters", "1", "--warmup", "0"]
    bench_families.main([*argv, "--minutes", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["family"] == "OpenFlamingo" and row["release"] == "tiny"
    assert row["paper: end to end"] == "1.16–1.92×" and row["paper: CA speed-up"] == "1.47–2.14×"
    cfg = tiny_config("g2")
    assert row["prompt positions"] == cfg.prompt_header_tokens + 60 * cfg.prompt_positions_per_frame
    assert 0 < row["cross share, prefill"] < 1 and 0 < row["cross share, decoded token"] < 1
    assert row["max abs diff"] < 1e-5 and row["speed-up over Ring"] > 0


def test_every_family_with_published_sizes_is_listed_and_shares_follow_the_keys():
    names = [f.name for f in FAMILIES.values() if f.published]
    assert names and set(names) <= set(FAMILIES)
    cfg = next(iter(FAMILIES["mplug_owl3"].published.values()))
    short, long = bench_families.cross_shares(cfg, 60), bench_families.cross_shares(cfg, 3600)
    assert short[0] < long[0] and short[1] < long[1]  # more frames: more of the work on them
    assert bench_families.paper_speedups(FAMILIES["mllama"]) == ("–", "–")


def test_the_gpu_acceptance_checks_every_registered_familys_published_shapes(tmp_path, monkeypatch):
    """`scripts/check_family_shapes.py` (a second-command item of the GPU acceptance) takes the
    shapes from `Family.published`: a family registered later is checked, under both masks."""
    from scripts import check_family_shapes

    cfg = tiny_config("g2")
    stub = replace(FAMILIES["mplug_owl3"], name="stub", title="Stub", published={"tiny": cfg})
    monkeypatch.setattr(check_family_shapes, "FAMILIES", {"stub": stub})
    out = tmp_path / "shapes.json"
    argv = ["--device", "cpu", "--frames", "2", "--rows", "8", "--out", str(out)]
    assert check_family_shapes.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["call"] for r in rows] == [
        "every key visible", "media mask", "latest frame", "decoded token",
    ]  # fmt: skip
    heads = f"{cfg.cross_attention_heads}/{cfg.cross_kv_heads} x {cfg.cross_head_dim}"
    assert all(r["ok"] and r["releases"] == "tiny" and r["heads"] == heads for r in rows)
    assert rows[0]["keys"] == 2 * cfg.visual_tokens_per_frame
