"""This machine's ring-or-gather crossovers: the calibration file `bench_schedule.py --calibrate`
writes, read once over the built-in table, a bad file ignored with one warning, and the ranks of an
engine agreeing on one crossover."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lvx_app.attention import schedule
from lvx_app.attention.schedule import (
    GATHER_MAX_ROWS,
    CalibrationWarning,
    calibration_path,
    choose_schedule,
    crossovers,
    gather_limit,
    read_calibration,
)
from lvx_app.config import ParallelConfig
from scripts.bench_schedule import write_calibration
from scripts.gloo_ranks import run_ranks


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A cache folder of the test's own, and the crossovers read afresh from it."""
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "cache"))
    crossovers.cache_clear()
    yield tmp_path / "cache"
    crossovers.cache_clear()


def test_without_a_calibration_the_built_in_table_applies():
    assert not calibration_path().exists()
    assert crossovers() == GATHER_MAX_ROWS
    assert choose_schedule(GATHER_MAX_ROWS[2], 2) == "gather"
    assert choose_schedule(GATHER_MAX_ROWS[2] + 1, 2) == "ring"


def test_a_calibration_replaces_the_ranks_it_measured(cache_dir):
    path = write_calibration({2: 96}, {"device": "test"}, "bench_schedule.py --calibrate")
    assert path == cache_dir / "calibration.json"
    assert crossovers() == {**GATHER_MAX_ROWS, 2: 96}
    assert choose_schedule(96, 2) == "gather" and choose_schedule(97, 2) == "ring"
    assert gather_limit(4) == GATHER_MAX_ROWS[4]  # 4 ranks were not measured: the table's
    assert gather_limit(3) == 96  # the most ranks measured not above 3
    assert choose_schedule(97, 2, limit=200) == "gather"  # the limit the ranks agreed on


def test_the_file_is_read_once(cache_dir):
    write_calibration({2: 96}, {}, "")
    assert gather_limit(2) == 96
    write_calibration({2: 8}, {}, "")
    assert gather_limit(2) == 96


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"version": 1}),
        json.dumps({"version": 1, "gather_max_rows": {"2": -5}}),
        json.dumps({"version": 99, "gather_max_rows": {"2": 64}}),
    ],
)
def test_a_bad_calibration_is_named_once_and_ignored(cache_dir, text):
    cache_dir.mkdir(parents=True)
    (cache_dir / "calibration.json").write_text(text)
    with pytest.warns(CalibrationWarning, match="calibration.json"):
        assert read_calibration(cache_dir / "calibration.json") == {}
    with pytest.warns(CalibrationWarning):
        assert crossovers() == GATHER_MAX_ROWS


def _agreed(rank: int, world: int, folders: list[str]) -> tuple[int, bool]:
    import os

    from lvx_app.engine.parallelize import parallelize
    from lvx_app.parallel.group import DistInfo

    os.environ["LVX_CACHE_DIR"] = folders[rank]
    schedule.crossovers.cache_clear()
    model = SimpleNamespace(hooks=SimpleNamespace())
    info = DistInfo(rank, world, rank, torch.device("cpu"), "gloo")
    attn = parallelize(model, info, ParallelConfig())
    return attn.gather_rows, attn.replicate_queries(100)


def test_the_ranks_agree_on_the_smallest_crossover(tmp_path, monkeypatch):
    folders = []
    for rank, rows in enumerate((64, 512)):
        monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / f"node{rank}"))
        write_calibration({2: rows}, {}, "")
        folders.append(str(tmp_path / f"node{rank}"))
    # 100 rows: rank 1's machine alone would gather them, rank 0's would not
    assert run_ranks(_agreed, 2, folders) == [(64, False), (64, False)]
