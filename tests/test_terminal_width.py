"""What lvx prints fits an 80-column terminal and a pipe: tables wrap names between words and never
cut a number or a figure's name with an ellipsis; progress lines stay on one line."""

from __future__ import annotations

import io
import re

from rich.console import Console

WIDTH = 80


def _render(*renderables) -> str:
    out = io.StringIO()
    console = Console(file=out, width=WIDTH, highlight=False, color_system=None)
    for r in renderables:
        console.print(r)
    return out.getvalue()


def _fits(text: str) -> None:
    lines = text.splitlines()
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    assert "…" not in text, text


def test_stats_per_rank_fit_80_columns_for_1_to_8_ranks():
    from lvx_app.cli.chat import rank_tables

    row = {
        "device": "cuda:7",
        "frames": 450,
        "visual K/V": "1234.5 MiB",
        "visual K/V compute s": 0.1234,
        "video prompt prefill s": 12.3456,
        "text tokens": 18_456,
        "attention bytes sent": 152_152_000,
        "peak GPU memory": "56.61 GiB",
        "free GPU memory": "21.43 GiB",
    }
    for ranks in (1, 2, 8):
        text = _render(*rank_tables([{"rank": r, **row} for r in range(ranks)]))
        _fits(text)
        for value in ("152152000", "1234.5 MiB", "56.61 GiB", "attention bytes sent"):
            assert text.count(value) >= 1, value  # whole, on one line
        assert text.count("rank 7") == (1 if ranks == 8 else 0)


def test_the_eval_report_fits_80_columns():
    from lvx_app.eval.report import report_table

    def s(asked):
        return {"asked": asked, "unparsed": 3, "correct": 7, "accuracy": 63.6,
                "accuracy_asked": 58.3, "accuracy_answered": 63.6}  # fmt: skip

    summary = {
        "scoring": "official",
        "overall": s(1200),
        "by_duration": {"short": s(400), "medium": s(400), "long": s(400)},
        "by_domain": {"Film & Television": s(300), "Sports Competition": s(300)},
        "by_sub_category": {"Humanity & History": s(100), "Multilingual": s(100)},
        "by_task_type": {"Temporal Reasoning": s(100), "Object Recognition": s(100)},
    }
    text = _render(report_table(summary))
    _fits(text)
    assert "subcategory" in text and "task type" in text and "58.3" in text


def test_a_finetuning_step_is_one_line_under_80_columns(capsys):
    from lvx_app.train.loop import StepStats, _Reporter

    report = _Reporter(total=1000, start=0, live=False)
    report(StepStats(step=999, loss=6.4538, tokens=90_000, frames=3600, seconds=0.5,
                     grad_norm=1234.567, lr=1.0e-4, peak_mem=[2**36] * 8))  # fmt: skip
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and len(line.rstrip("\n")) <= WIDTH, line
    assert re.search(r"step 999/1000  loss 6\.4538  \|g\| 1235  lr 1\.0e-04  180k tok/s", line)
