"""bench_scale's arithmetic: growth exponents between lengths, the costs that grew faster than their
law, the fastest of repeated rows, its subtitle sidecar and the CPU seconds of a process tree."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from lvx_app.subtitles import load_srt
from scripts.bench_scale import METRICS, TIMES, exponents, fastest, too_fast, tree_cpu_s, write_cues


def _row(minutes: float, ranks: int, scale: float, prefill_power: float = 2.0) -> dict:
    """A row whose every cost is linear in the minutes but the prefill (minutes ** power)."""
    row = {m: scale * minutes for m in (*METRICS, *TIMES)}
    row.update(minutes=minutes, ranks=ranks, prefill_s=minutes**prefill_power)
    row["plan_7b"] = {"prefill_s": minutes**2}
    return row


def test_exponents_between_consecutive_lengths():
    rows = [_row(m, 1, 0.5) for m in (60, 10, 180)]  # any order
    growth = exponents(rows)
    assert [(g["from_min"], g["to_min"]) for g in growth] == [(10, 60), (60, 180)]
    for g in growth:
        assert g["ingest_s"] == pytest.approx(1.0) and g["prefill_s"] == pytest.approx(2.0)
        assert g["plan_7b_prefill_s"] == pytest.approx(2.0)
    assert too_fast(growth) == []


def test_a_cost_faster_than_its_law_is_named():
    rows = [_row(m, 2, 1.0, prefill_power=2.5) for m in (1, 10, 60)]
    rows[2]["cache_mb"] = rows[1]["cache_mb"] * 6**1.5
    rows[1]["ttft_s"] = rows[0]["ttft_s"] * 100  # 1 -> 10 minutes: start-up, not judged
    named = too_fast(exponents(rows))
    assert named == [
        "cache_mb on 2 rank(s), 10->60 min: 1.50",
        "prefill_s on 2 rank(s), 10->60 min: 2.50",
    ]


def test_fastest_of_repeats_takes_each_time_on_its_own():
    a = {**_row(10, 1, 1.0), "tok_per_s": 100.0, "load_avg": [5.0, 5.0, 5.0]}
    b = {**_row(10, 1, 1.0), "tok_per_s": 150.0, "load_avg": [1.0, 1.0, 1.0]}
    a["ingest_s"], b["prefill_s"], b["cache_mb"] = 3.0, 4.0, 99.0
    row = fastest([a, b])
    assert row["ingest_s"] == 3.0 and row["prefill_s"] == 4.0 and row["tok_per_s"] == 150.0
    assert row["cache_mb"] == a["cache_mb"] and row["repeats"] == 2
    assert row["load_avg"] == [[5.0, 5.0, 5.0], [1.0, 1.0, 1.0]]


def test_the_sidecar_has_one_cue_every_five_seconds(tmp_path):
    cues = load_srt(write_cues(tmp_path / "v.srt", 3600.0))
    assert len(cues) == 720 and len({c.text for c in cues}) == 720
    assert cues[1].start == 5.0 and cues[-1].start == 3595.0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_tree_cpu_counts_children_and_what_they_reaped():
    before = tree_cpu_s(os.getpid())
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    # a child that itself runs a burning grandchild and reaps it
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert tree_cpu_s(os.getpid()) - before >= 0.3
    assert math.isfinite(before)
