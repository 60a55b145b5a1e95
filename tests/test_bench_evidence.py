"""The evidence benchmark's figures from its answers: speeds and CPU per round, on over off beside
two answers without evidence, and the evidence's own time against the same answer's decode, on the
rank where each is worst."""

from __future__ import annotations

import pytest

from scripts.bench_evidence import summarize


def _answer(round_: int, arm: str, tokens_per_s: float, cpu_s: float, evidence_s: float = 0.0):
    return dict(
        round=round_,
        arm=arm,
        text="same",
        new_tokens=9,
        tokens_per_s=tokens_per_s,
        decode_s=0.5,
        cpu_s=cpu_s,
        evidence_s=evidence_s,
    )


def test_summary_pairs_the_answers_of_each_round_and_takes_the_worst_rank():
    rank0 = [
        _answer(0, "on", 90.0, 1.0, 0.010),
        _answer(0, "off", 100.0, 1.0),
        _answer(0, "again", 110.0, 1.0),
        _answer(1, "off", 50.0, 2.0),
        _answer(1, "again", 45.0, 2.0),
        _answer(1, "on", 60.0, 2.2, 0.020),
        _answer(2, "again", 100.0, 1.0),
        _answer(2, "on", 80.0, 1.0, 0.005),
        _answer(2, "off", 100.0, 1.0),
    ]
    rank1 = [dict(a, cpu_s=a["cpu_s"] * (1.5 if a["arm"] == "on" else 1), text="") for a in rank0]
    rank1[0]["evidence_s"] = 0.050  # the slower rank sets the evidence's share
    got = summarize([rank0, rank1])
    assert got["pair_ratios"] == [0.9, 1.2, 0.8] and got["pair_ratio_median"] == pytest.approx(0.9)
    assert (got["pair_ratio_min"], got["pair_ratio_max"]) == (pytest.approx(0.8), 1.2)
    assert got["noise_ratios"] == [1.1, 0.9, 1.0] and got["noise_ratio_median"] == 1.0
    assert got["tok_s_on"] == 80.0 and got["tok_s_off"] == 100.0
    assert got["best_on_over_off"] == pytest.approx(90 / 110)
    assert got["cpu_ratios"] == [1.5, 1.65, 1.5] and got["cpu_ratio_median"] == 1.5  # rank 1
    assert got["evidence_of_decode"] == pytest.approx(0.04)  # 0.1, 0.04, 0.01 over 0.5 s
    assert got["evidence_ms"] == pytest.approx(20.0) and got["rounds"] == 3


def test_answers_that_differ_with_evidence_stop_the_benchmark():
    answers = [
        _answer(0, "on", 90.0, 1.0, 0.01),
        _answer(0, "off", 100.0, 1.0),
        dict(_answer(0, "again", 100.0, 1.0), text="x"),
    ]
    with pytest.raises(SystemExit, match="differ"):
        summarize([answers])
