"""`lvx demo --examples`' Video-MME folder is in the official format: values harnesses key on (a
real domain, sub-category and task type) and subtitle files in the official font tag, which
lmms-eval's parser reads and lvx strips."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pyarrow.parquet as pq

from lvx_app.cli.examples import write_examples
from lvx_app.eval.dataset import DOMAINS, DURATIONS, SUB_CATEGORIES, TASK_TYPES
from lvx_app.subtitles import load_srt

# lmms-eval's videomme task: the subtitle text it takes, and the keys its scoring counts by
LMMS_FONT = re.compile(r'<font color="white" size=".72c">(.*?)</font>')


def test_the_videomme_folder_has_official_values_and_subtitles(tmp_path):
    root = write_examples(tmp_path)["videomme"]
    rows = pq.read_table(root / "videomme" / "test-00000-of-00001.parquet").to_pylist()
    assert len(rows) == 4
    keys = {
        f"{d}_{m}_{s}_{t}"
        for d in DURATIONS
        for m in DOMAINS
        for s in SUB_CATEGORIES
        for t in TASK_TYPES
    }
    for row in rows:
        key = f"{row['duration']}_{row['domain']}_{row['sub_category']}_{row['task_type']}"
        assert key in keys, key
    srt = (root / "subtitle" / "exampleClip.srt").read_text()
    texts = LMMS_FONT.findall(srt)
    assert texts == [
        "A red square moves to the right.",
        "Now it turns blue.",
        "The square stops in the corner.",
    ]
    assert [c.text for c in load_srt(root / "subtitle" / "exampleClip.srt")] == texts


def test_the_serve_line_the_demo_prints_opens_its_files_on_the_demos_ranks(tmp_path):
    from test_readme import _command

    from lvx_app.cli.examples import CPU_RANKS, ready_lines
    from lvx_ui.openai_request import allowed_path

    files = write_examples(tmp_path / "examples")
    video = tmp_path / "demo" / "demo.mp4"
    (serve,) = [
        shlex.split(line)
        for line in ready_lines(tmp_path / "ckpt", video, files)
        if line.startswith("lvx serve")
    ]
    command, args = _command(serve[1:])
    options = command.make_context(command.name, args).params  # the real options parse it
    assert (options["gpus"], options["ranks"]) == (0, CPU_RANKS), "the demo's ranks"
    roots = [Path(p) for p in options["allow_paths"]]
    clip = next((files["videomme"] / "data").glob("*.mp4"))
    for path in (video, files["example"], clip):
        assert allowed_path(str(path), roots) == path.resolve()


def test_the_demo_prints_a_report_line_and_the_other_familys_demo_and_each_parses(tmp_path):
    """Beside chat, serve, eval and finetune: `lvx eval report` on the eval line's results and the
    demo of the other family, by the name its help shows; every line parses with the real options
    (the family's name through the demo's own check)."""
    from test_readme import _command

    from lvx_app.cli.examples import ready_lines
    from lvx_models.api import family_named

    files = write_examples(tmp_path / "examples")
    lines = ready_lines(
        tmp_path / "ckpt", tmp_path / "demo.mp4", files, others=["Llama-3.2-Vision"]
    )
    (evaluate,) = [shlex.split(x) for x in lines if x.startswith("lvx eval videomme")]
    (report,) = [shlex.split(x, comments=True) for x in lines if x.startswith("lvx eval report")]
    assert report[3] == evaluate[evaluate.index("--out") + 1]
    (demo,) = [shlex.split(x, comments=True) for x in lines if x.startswith("lvx demo")]
    assert demo[1:] == ["demo", "--model-family", "Llama-3.2-Vision"]
    assert family_named(demo[-1]).name == "mllama"
    for line in lines:
        words = shlex.split(line, comments=True)
        if words:
            command, args = _command(words[1:])
            command.make_context(command.name, args)
