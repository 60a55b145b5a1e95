"""This machine's ring-or-gather crossovers: the calibration file `bench_schedule.py --calibrate`
writes in the run's cache folder, read once over the built-in table, a bad file ignored with one
warning, and the ranks of an engine agreeing on one crossover, each read from its `--cache-dir`."""

from __future__ import annotations

import json

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
    write_calibration,
)
from lvx_app.config import Config
from scripts.gloo_ranks import run_ranks


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A default cache folder of the test's own, and the crossovers read afresh from it."""
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "cache"))
    crossovers.cache_clear()
    yield tmp_path / "cache"
    crossovers.cache_clear()


def _write(rows: dict[int, int], cache_dir=None):
    return write_calibration(rows, {"device": "test"}, "", calibration_path(cache_dir))


def test_without_a_calibration_the_built_in_table_applies():
    assert not calibration_path().exists()
    assert crossovers() == GATHER_MAX_ROWS
    assert choose_schedule(GATHER_MAX_ROWS[2], 2) == "gather"
    assert choose_schedule(GATHER_MAX_ROWS[2] + 1, 2) == "ring"


def test_a_calibration_replaces_the_ranks_it_measured(cache_dir):
    path = _write({2: 96})
    assert path == cache_dir / "calibration.json"
    assert json.loads(path.read_text())["gather_max_rows"] == {"2": 96}
    assert crossovers() == {**GATHER_MAX_ROWS, 2: 96}
    assert choose_schedule(96, 2) == "gather" and choose_schedule(97, 2) == "ring"
    assert gather_limit(4) == GATHER_MAX_ROWS[4]  # 4 ranks were not measured: the table's
    assert gather_limit(3) == 96  # the most ranks measured not above 3
    assert choose_schedule(97, 2, limit=200) == "gather"  # the limit the ranks agreed on
    _write({4: 32})  # a later calibration of other ranks keeps the ones measured before
    assert read_calibration(path) == {2: 96, 4: 32}


def test_the_file_is_read_once(cache_dir):
    _write({2: 96})
    assert gather_limit(2) == 96
    _write({2: 8})
    assert gather_limit(2) == 96


def test_a_run_reads_the_calibration_in_its_own_cache_folder(tmp_path, cache_dir):
    """`--cache-dir DIR` moves the calibration with the caches: DIR's file, not the default
    folder's, and the default folder's for a run without one."""
    _write({2: 96})  # the default folder's
    own = tmp_path / "elsewhere"
    assert crossovers(str(own)) == GATHER_MAX_ROWS, "the default folder's file was read"
    crossovers.cache_clear()
    assert _write({2: 40}, own) == own / "calibration.json"
    assert crossovers(str(own)) == {**GATHER_MAX_ROWS, 2: 40}
    assert crossovers() == {**GATHER_MAX_ROWS, 2: 96}
    assert gather_limit(2, crossovers(str(own))) == 40


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"version": 2}),
        json.dumps({"version": 2, "gather_max_rows": {"2": -5}}),
        json.dumps({"version": 99, "gather_max_rows": {"2": 64}}),
        # an older version, which timed another kernel: measured again
        json.dumps({"version": 1, "gather_max_rows": {"2": 64}}),
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
    from lvx_app.engine.parallelize import parallelize
    from lvx_app.parallel.group import DistInfo

    schedule.crossovers.cache_clear()
    info = DistInfo(rank, world, rank, torch.device("cpu"), "gloo")
    config = Config.from_options(cache_dir=folders[rank])  # each node's run has its own folder
    attn = parallelize(info, config)
    return attn.gather_rows, attn.replicate_queries(100)


def test_the_ranks_agree_on_the_smallest_crossover(tmp_path):
    folders = []
    for rank, rows in enumerate((64, 512)):
        _write({2: rows}, tmp_path / f"node{rank}")
        folders.append(str(tmp_path / f"node{rank}"))
    # 100 rows: rank 1's machine alone would gather them, rank 0's would not
    assert run_ranks(_agreed, 2, folders) == [(64, False), (64, False)]
