"""Video-MME data: question file, validation errors, video lookup, selection and shards, subtitles,
prompt."""

import json

import pytest
from videomme_fixtures import SRT, make_mini_videomme, question_rows, write_parquet

from lvx_app.eval.dataset import (
    DatasetError,
    load_dataset,
    parse_durations,
    parse_shard,
    select_questions,
)
from lvx_app.eval.prompt import build_prompt
from lvx_app.subtitles import Cue, load_srt, parse_srt, select_lines


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    return make_mini_videomme(tmp_path_factory.mktemp("videomme"))


def test_loads_official_layout(mini):
    ds = load_dataset(mini.root)
    assert ds.question_file == mini.question_file
    assert len(ds.questions) == len(mini.rows) == 15
    q = ds.questions[0]
    assert (q.question_id, q.video_id, q.videoID, q.duration) == (
        "001-1",
        "001",
        "vidShortAAA",
        "short",
    )
    assert q.options[0].startswith("A. ") and len(q.options) == 4
    assert {p.suffix for p in ds.video_paths.values()} == {".mp4", ".MP4", ".mkv"}
    assert ds.missing_videos == mini.missing == ["vidMissingE"]
    assert ds.subtitle_path(q).name == "vidShortAAA.srt"
    assert ds.subtitle_path(ds.questions[3]) is None
    assert len(ds.sha256) == 64


def test_json_forms_load_the_same(mini, tmp_path):
    rows = question_rows()
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(rows))
    videos = {}
    for r in rows:  # the official results shape: videos with their questions
        v = videos.setdefault(
            r["video_id"],
            {k: r[k] for k in ("video_id", "duration", "domain", "sub_category", "url", "videoID")},
        )
        v.setdefault("questions", []).append(
            {k: r[k] for k in ("question_id", "task_type", "question", "options", "answer")}
        )
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps(list(videos.values())))
    base = load_dataset(mini.root).questions
    assert load_dataset(mini.root, flat).questions == base
    assert load_dataset(mini.root, nested).questions == base


def test_missing_video_reported_once_and_run_continues(mini, capsys):
    from engine_configs import eval_config
    from videomme_fixtures import LookupSession, answers_for

    from lvx_app.eval.videomme import run_videomme

    session = LookupSession(answers_for(mini.rows))
    config = eval_config(mini.root, mini.root / "runs" / "r.jsonl")
    run = run_videomme(config, lambda: session, show_progress=False)
    out = capsys.readouterr().out
    assert out.count("vidMissingE") == 1 and "1 video(s) missing, 3 question(s) skipped" in out
    assert run.missing_videos == ["vidMissingE"]
    assert run.stats.answered == 12 and run.summary["overall"]["asked"] == 12


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(options=[]), "'options' must be a list of 4"),
        (lambda r: r.update(options=["A. x", "B. y", "C. z"]), "'options' must be a list of 4"),
        (
            lambda r: r.update(options=["A. x", "B. ", "C. z", "D. w"]),
            "option B must read 'B. <text>'",
        ),
        (lambda r: r.update(options=["x", "y", "z", "w"]), "option A must read"),
        (lambda r: r.update(answer="E"), "'answer' must be one of A, B, C, D"),
        (lambda r: r.update(duration="huge"), "'duration' must be one of short, medium, long"),
        (lambda r: r.update(question="  "), "field 'question' must be a non-empty string"),
        (lambda r: r.pop("videoID"), "field 'videoID' must be a non-empty string, got None"),
        (lambda r: r.update(videoID="../../x"), "'videoID' must name a file in the data folder"),
        (lambda r: r.update(videoID="/etc/x"), "'videoID' must name a file in the data folder"),
        (lambda r: r.update(videoID=".."), "'videoID' must name a file in the data folder"),
    ],
)
def test_malformed_rows_give_clear_errors(tmp_path, mutate, message):
    rows = question_rows()
    mutate(rows[4])
    write_parquet(rows, tmp_path / "videomme" / "test-00000-of-00001.parquet")
    with pytest.raises(DatasetError) as err:
        load_dataset(tmp_path)
    assert message in str(err.value) and "row 4" in str(err.value) and "002-2" in str(err.value)


def test_unreadable_or_absent_question_file(tmp_path):
    with pytest.raises(DatasetError, match="not a folder"):
        load_dataset(tmp_path / "nope")
    with pytest.raises(DatasetError, match="no Video-MME question file.*--questions"):
        load_dataset(tmp_path)
    bad = tmp_path / "videomme" / "test-00000-of-00001.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"this is not parquet")
    with pytest.raises(DatasetError, match="cannot read question file"):
        load_dataset(tmp_path)
    bad.unlink()
    (tmp_path / "q.json").write_text("[]")
    with pytest.raises(DatasetError, match="holds no questions"):
        load_dataset(tmp_path)
    (tmp_path / "q.json").write_text('{"truncated": ')
    with pytest.raises(DatasetError, match="cannot read question file"):
        load_dataset(tmp_path)
    rows = question_rows()
    del rows[2]["answer"], rows[2]["task_type"]
    (tmp_path / "q.json").write_text(json.dumps(rows))
    with pytest.raises(DatasetError, match=r"row 2: missing field\(s\) task_type, answer"):
        load_dataset(tmp_path)
    rows = question_rows()
    rows[1]["question_id"] = rows[0]["question_id"]
    (tmp_path / "q.json").write_text(json.dumps(rows))
    with pytest.raises(DatasetError, match="duplicate question_id.*001-1"):
        load_dataset(tmp_path)


def test_selection_durations_limit_and_disjoint_shards(mini):
    qs = load_dataset(mini.root).questions
    assert [q.duration for q in select_questions(qs, ("long",))] == ["long"] * 6
    assert [
        q.question_id for q in select_questions(qs, parse_durations("short,medium"), limit=4)
    ] == ["001-1", "001-2", "001-3", "002-1"]
    for k in (1, 2, 3, 7):
        for limit in (None, 8):
            whole = select_questions(qs, None, limit)
            shards = [select_questions(qs, None, limit, (i, k)) for i in range(k)]
            ids = [q.question_id for s in shards for q in s]
            assert sorted(ids) == sorted(q.question_id for q in whole) and len(set(ids)) == len(ids)
            videos = [{q.videoID for q in s} for s in shards]
            # a video lives in one shard only
            assert sum(map(len, videos)) == len(set().union(*videos))
            # deterministic
            assert shards == [select_questions(qs, None, limit, (i, k)) for i in range(k)]
    assert parse_shard("1/4") == (1, 4) and parse_shard(None) is None
    for bad in ("4/4", "-1/2", "a/b", "1", "0/0"):
        with pytest.raises(DatasetError, match="--shard"):
            parse_shard(bad)
    with pytest.raises(DatasetError, match="--durations"):
        parse_durations("short,tiny")


def test_srt_parsing_overlaps_tags_crlf(mini):
    cues = load_srt(mini.root / "subtitle" / "vidShortAAA.srt")
    assert cues == parse_srt(SRT)
    assert [c.text for c in cues] == [
        "hello and welcome",
        "to the tiny test video",
        "never sampled",
    ]
    assert cues[1].start == 0.8 and cues[0].end == 1.2  # overlapping rolling cues
    assert load_srt(None) == []
    assert parse_srt("garbage\n\n1\n00:00:01.5 --> 00:00:02,000\n\n") == []  # no text: skipped


def test_subtitle_lines_follow_the_sampled_frames():
    cues = [
        Cue(0.0, 1.2, "one"),
        Cue(0.8, 2.0, "two"),
        Cue(1.0, 10.0, "long"),
        Cue(5.0, 6.0, "five"),
    ]
    assert select_lines(cues, [0.0]) == ["one"]
    assert select_lines(cues, [1.0]) == ["long"]  # overlap: the cue that started last
    assert select_lines(cues, [0.0, 0.9, 1.1, 3.0]) == ["one", "two", "long"]
    assert select_lines(cues, [20.0]) == []  # a gap: no line
    assert select_lines([Cue(0, 1, "same"), Cue(2, 3, "same")], [0.5, 2.5]) == ["same"]
    ts = [i * 0.25 for i in range(40)]
    assert len(select_lines(cues, ts)) <= len(ts)


def test_official_prompt_exact():
    opts = ["A. Black.", "B. White.", "C. Red.", "D. Blue."]
    assert build_prompt("What colour is the cat?", opts) == (
        "Select the best answer to the following multiple-choice question based on the video. "
        "Respond with only the letter (A, B, C, or D) of the correct option.\n"
        "What colour is the cat?\nA. Black.\nB. White.\nC. Red.\nD. Blue.\nThe best answer is:"
    )
    with_subs = build_prompt("What colour is the cat?", opts, ["hi there", "a black cat"])
    assert with_subs.startswith(
        "This video's subtitles are listed below:\nhi there\na black cat\nSelect the best"
    )
    assert with_subs.endswith(build_prompt("What colour is the cat?", opts))
    assert build_prompt("Q?", opts, []) == build_prompt("Q?", opts)
