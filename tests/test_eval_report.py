"""Report numbers on a hand-checked set, both scoring modes; the JSON summary and the PNG plot."""

import json

import pytest
from rich.console import Console

from lvx_app.eval.report import (
    model_name,
    output_paths,
    plot_duration_domain,
    print_report,
    report_file,
    summarize,
    write_summary,
)


def rec(qid, duration, domain, sub, task, answer, response):
    return dict(
        question_id=qid,
        duration=duration,
        domain=domain,
        sub_category=sub,
        task_type=task,
        answer=answer,
        response=response,
    )


RECORDS = [
    rec("001-1", "short", "Knowledge", "Astronomy", "Counting Problem", "A", "A"),  # right
    rec("001-2", "short", "Knowledge", "Astronomy", "OCR Problems", "B", "C."),  # wrong
    rec(
        "002-1", "short", "Sports Competition", "Football", "Counting Problem", "C", "I don't know"
    ),  # unparsed
    rec(
        "003-1",
        "medium",
        "Film & Television",
        "Animation",
        "Counting Problem",
        "D",
        "Based on the video, D",
    ),
    rec("004-1", "long", "Knowledge", "Geography", "OCR Problems", "B", "The answer is B"),  # right
    rec("005-1", "long", "Life Record", "Travel", "Counting Problem", "A", "(A)"),  # right
]


def test_official_numbers_by_hand():
    s = summarize(RECORDS, "official")
    # "Based on the video, D" reads as B (first capital) and is wrong; "I don't know" is dropped.
    assert s["overall"] == {
        "asked": 6,
        "parsed": 5,
        "unparsed": 1,
        "correct": 3,
        "accuracy": 60.0,
        "accuracy_answered": 60.0,
        "accuracy_asked": 50.0,
    }
    assert list(s["by_duration"]) == ["short", "medium", "long"]
    assert s["by_duration"]["short"]["accuracy"] == 50.0 and s["by_duration"]["short"][
        "accuracy_asked"
    ] == pytest.approx(100 / 3)
    assert (
        s["by_duration"]["medium"]["accuracy"] == 0.0
        and s["by_duration"]["long"]["accuracy"] == 100.0
    )
    assert s["by_task_type"]["Counting Problem"]["accuracy"] == pytest.approx(200 / 3)
    assert s["by_task_type"]["OCR Problems"]["accuracy"] == 50.0
    assert list(s["by_domain"]) == [
        "Knowledge",
        "Film & Television",
        "Sports Competition",
        "Life Record",
    ]
    assert s["by_domain"]["Knowledge"]["accuracy"] == pytest.approx(200 / 3)
    assert s["by_domain"]["Sports Competition"]["accuracy"] is None  # nothing parsed: no number
    assert (
        s["by_sub_category"]["Astronomy"]["correct"] == 1
        and s["by_sub_category"]["Astronomy"]["asked"] == 2
    )
    assert s["by_duration_domain"]["short"]["Knowledge"]["accuracy"] == 50.0
    assert s["by_duration_domain"]["long"]["Life Record"]["accuracy"] == 100.0


def test_strict_numbers_by_hand():
    s = summarize(RECORDS, "strict")
    # Strict: "Based on the video, D" is unparsed too, and unparsed counts as wrong.
    assert s["overall"] == {
        "asked": 6,
        "parsed": 4,
        "unparsed": 2,
        "correct": 3,
        "accuracy": 50.0,
        "accuracy_answered": 75.0,
        "accuracy_asked": 50.0,
    }
    assert s["by_domain"]["Sports Competition"]["accuracy"] == 0.0
    assert s["by_duration"]["medium"]["unparsed"] == 1


def test_table_json_and_png(tmp_path):
    s = summarize(RECORDS, "official")
    console = Console(record=True, width=140)
    print_report(s, console)
    text = console.export_text()
    assert (
        "scoring: official" in text
        and "60.0" in text
        and "50.0" in text
        and "Counting Problem" in text
    )
    paths = output_paths(tmp_path / "run.jsonl")
    assert paths["summary"].name == "run.summary.json" and paths["plot"].name == "run.png"
    write_summary(s, paths["summary"], {"manifest": {"model": "m"}})
    assert json.loads(paths["summary"].read_text())["overall"]["accuracy"] == 60.0
    png = plot_duration_domain(s, paths["plot"])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_empty_report_does_not_crash(tmp_path):
    s = summarize([], "official")
    assert s["overall"]["asked"] == 0 and s["overall"]["accuracy"] is None
    plot_duration_domain(s, tmp_path / "empty.png")
    print_report(s, Console(record=True))


@pytest.mark.parametrize("scoring", ["official", "strict"])
def test_the_table_fits_80_columns_without_breaking_a_word(scoring):
    """Video-MME's longest names at 80 columns: lines fit, every word is whole on one line."""
    names = ("Multilingual", "Humanity & History", "Information Synopsis", "Sports Competition")
    records = [rec(f"{i}-1", "medium", n, n, n, "A", "A") for i, n in enumerate(names)]
    console = Console(record=True, width=80)
    print_report(summarize(records, scoring), console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    words = {w for line in lines for w in line.replace("│", " ").split()}
    for name in names:
        assert set(name.split()) <= words, (name, "\n".join(lines))


def _whole(record: dict) -> dict:
    """A record as `lvx eval` writes it: with its video, question and options."""
    video = record["question_id"].split("-")[0]
    return {"video_id": video, "question": "?", "options": ["A. a", "B. b"], **record}


@pytest.mark.parametrize(
    "model",
    [
        "/home/someone/.cache/lvx/demo/tiny-mplug_owl3-g2",
        "an-organisation-with-a-long-name/a-checkpoint-whose-name-goes-on-and-on-241101",
    ],
)
def test_the_png_title_stays_inside_the_image(tmp_path, model):
    """The title names the model (a local folder by its own name) and wraps: no dark pixel of it
    touches the image's left or right edge."""
    import matplotlib.image

    results = tmp_path / "run.jsonl"
    results.write_text(
        json.dumps({"type": "header", "model": model})
        + "\n"
        + "".join(json.dumps({"type": "answer", **_whole(r)}) + "\n" for r in RECORDS)
    )
    report_file(results, console=Console(record=True, width=120))
    image = matplotlib.image.imread(output_paths(results)["plot"])
    title_band = image[: image.shape[0] // 8, :, :3].mean(axis=2)  # above the axes
    assert (title_band < 0.5).any(), "the title is drawn"
    assert (title_band[:, :4] > 0.9).all() and (title_band[:, -4:] > 0.9).all()
    assert model_name(model) in {"tiny-mplug_owl3-g2", model}
