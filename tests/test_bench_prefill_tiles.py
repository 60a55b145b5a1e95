"""The prefill-tiles benchmark compares equal outputs on both layouts."""

from scripts import bench_prefill_tiles as bench


def test_both_layouts_give_the_dense_calls_outputs(tmp_path):
    out = str(tmp_path / "r.json")
    rows = bench.main(["--frames", "3", "--keys-per-frame", "8", "--rounds", "1", "--json", out])
    assert [r["layout"] for r in rows] == ["prompt", "all keys"]
    assert rows[0]["visible"] < 1 and rows[1]["visible"] == 1
    assert all(r["max_abs_diff"] < 1e-5 and r["tiles_s"] > 0 for r in rows)
    assert (tmp_path / "r.json").exists()
