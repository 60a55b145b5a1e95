"""Host planning of media-mask tiles: with keys sorted by frame (every layout's) a search per tile
bounds it, and it plans exactly what a scan of every key plans."""

from __future__ import annotations

import pytest
import torch

from lvx_kernels import masks
from lvx_kernels.masks import Indices


def _case(seed: int, batch: int, tokens: int, keys: int, frames: int):
    g = torch.Generator().manual_seed(seed)
    k_frame = torch.sort(torch.randint(0, frames, (batch, keys), generator=g), dim=1).values
    q_vis = torch.sort(torch.randint(0, frames + 2, (batch, tokens), generator=g), dim=1).values
    return q_vis, k_frame


@pytest.mark.parametrize("seed", range(40))
def test_the_search_bounds_a_tile_as_the_scan_does(seed):
    batch = 1 + seed % 2
    q_vis, k_frame = _case(seed, batch, 3 + seed % 17, 1 + seed % 23, 1 + seed % 7)
    if seed % 3 == 0:  # unsorted rows of a tile (a sharded prompt's zigzag runs)
        q_vis = q_vis[:, torch.randperm(q_vis.shape[1], generator=torch.Generator().manual_seed(1))]
    assert masks._ordered(k_frame)
    for t0 in range(0, q_vis.shape[1], 5):
        tile = q_vis[:, t0 : t0 + 5]
        assert masks._sorted_bounds(tile, k_frame) == masks._scanned_bounds(tile, k_frame)


def _plans(q_vis, k_frame, rows):
    q = torch.empty(1, rows, 2, 8, device="meta")
    k = torch.empty(1, k_frame.shape[1], 2, 8, device="meta")
    plans = masks.tile_plans(
        q, k, False, Indices.of_host(q_vis, "cpu"), Indices.of_host(k_frame, "cpu"), min_tokens=4
    )
    return [(p.q0, p.q1, p.k0, p.k1, p.mask is not None, p.dead is not None) for p in plans]


def test_sorted_keys_are_planned_without_a_scan_and_as_a_scan_plans(monkeypatch):
    q_vis, k_frame = _case(7, 1, 300, 900, 60)
    scanned = masks._scanned_bounds
    monkeypatch.setattr(masks, "_ordered", lambda kf: False)
    want = _plans(q_vis, k_frame, 300)
    monkeypatch.undo()

    def refused(*args):
        raise AssertionError("sorted keys were scanned")

    monkeypatch.setattr(masks, "_scanned_bounds", refused)
    assert _plans(q_vis, k_frame, 300) == want and any(w[4] for w in want)
    assert scanned is not refused


def test_unsorted_keys_are_still_planned_by_a_scan():
    k_frame = torch.tensor([[3, 0, 2, 1, 0]])
    assert not masks._ordered(k_frame)
    assert masks._scanned_bounds(torch.tensor([[1, 2]]), k_frame) == (0, 2, 1, 2, 5, False)


def test_bench_host_plan_times_both_planners_on_the_same_plans(tmp_path):
    import json

    from scripts.bench_host_plan import main

    out = tmp_path / "plan.json"
    assert main(["--minutes", "0.5", "--layers", "1", "--scan", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["planner"] for r in rows] == ["search", "scan"]
    assert rows[0]["plans"] == rows[1]["plans"] > 1 and rows[0]["local_keys"] == 30 * 729
