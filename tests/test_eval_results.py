"""Results files: runs, resume after an interruption, torn last lines, merge; the eval loop and
CLI."""

import json

import pytest
from engine_configs import eval_config
from typer.testing import CliRunner
from videomme_fixtures import LookupSession, answers_for, make_mini_videomme

from lvx_app.cli.evaluate import eval_app
from lvx_app.engine.records import QuestionTooLong
from lvx_app.eval.results import ResultsError, merge_results, read_results
from lvx_app.eval.videomme import run_videomme
from lvx_app.runtime.engine_handle import Engine


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    return make_mini_videomme(tmp_path_factory.mktemp("videomme"))


def _run(mini, out, session, **kw):
    return run_videomme(eval_config(mini.root, out, **kw), lambda: session, show_progress=False)


def _answer_ids(path):
    items = [json.loads(line) for line in path.read_text().splitlines()]
    return [item["question_id"] for item in items if item["type"] == "answer"]


def test_end_to_end_writes_records_and_reports(mini, tmp_path):
    session = LookupSession(answers_for(mini.rows, right={"001-1", "001-2", "002-1", "003-3"}))
    out = tmp_path / "run.jsonl"
    run = _run(mini, out, session, subtitles=True, fps=2.0)
    res = read_results(out)
    assert len(res.headers) == 1 and len(res.records) == 12
    h = res.headers[0]
    assert h["model"] and h["fps"] == 2.0 and h["subtitles"] == "official" and h["prompt_version"]
    assert h["scoring"] == "official" and len(h["dataset_sha256"]) == 64 and h["lvx_version"]
    r = res.records[0]
    right = mini.rows[0]["answer"]
    assert (
        r["response"] == right + "."
        and r["pred"] == right
        and r["correct"] is True
        and r["frames"] == 4
    )
    assert r["ask_s"] >= 0 and r["video_load_s"] >= 0 and r["engine"] == {"test": True}
    # Subtitles: only the lines at the sampled frames (0, 0.5, 1, 1.5 s), never the unsampled cue.
    assert r["prompt"].startswith(
        "This video's subtitles are listed below:\nhello and welcome\nto the tiny test video\n"
    )
    assert "never sampled" not in r["prompt"] and r["subtitle_lines"] == 2
    assert not res.records[3]["prompt"].startswith("This video's")  # no .srt for that video
    # Each video loaded once, all its questions asked against it, reset after.
    kinds = [c[0] for c in session.calls]
    assert kinds == ["load_video", "ask", "ask", "ask", "reset"] * 4
    assert run.summary["overall"]["correct"] == 4 and run.summary["overall"][
        "accuracy"
    ] == pytest.approx(100 * 4 / 12)
    for suffix in (".summary.json", ".png", ".official.json"):
        assert (tmp_path / f"run{suffix}").stat().st_size > 0
    official = json.loads((tmp_path / "run.official.json").read_text())
    assert [v["video_id"] for v in official] == ["001", "002", "003", "004"]
    assert (
        official[0]["questions"][0]["response"] == right + "."
        and len(official[0]["questions"]) == 3
    )


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_resume_after_interruption_answers_each_question_once(mini, tmp_path, exc):
    out = tmp_path / "run.jsonl"
    table = answers_for(mini.rows)
    first = LookupSession(table, fail_after=5, fail_with=exc)
    with pytest.raises(exc):
        _run(mini, out, first)
    assert len(read_results(out).records) == 5
    second = LookupSession(table)
    run = _run(mini, out, second)
    ids = _answer_ids(out)
    assert len(ids) == len(set(ids)) == 12
    assert len(second.asked) == 7 and not set(second.asked) & set(first.asked)
    assert [c[1] for c in second.calls if c[0] == "load_video"] == [
        "vidShortBBB.MP4",
        "vidMediumCC.mkv",
        "vidLongDDDD.mp4",
    ]
    assert run.summary["overall"]["accuracy"] == 100.0
    third = LookupSession(table)
    _run(mini, out, third)  # nothing left: the engine is not even asked
    assert third.calls == [] and len(read_results(out).headers) == 2


def test_truncated_last_line_is_ignored_then_repaired(mini, tmp_path):
    out = tmp_path / "run.jsonl"
    table = answers_for(mini.rows)
    with pytest.raises(RuntimeError):
        _run(mini, out, LookupSession(table, fail_after=4))
    with open(out, "a") as f:
        f.write('{"type": "answer", "question_id": "002-2", "resp')  # a crash mid-write
    res = read_results(out)
    assert res.torn_tail and len(res.records) == 4
    _run(mini, out, LookupSession(table))
    lines = out.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # the torn line was cut, nothing glued to it
    assert sorted(_answer_ids(out)) == sorted(
        r["question_id"] for r in mini.rows if r["videoID"] != "vidMissingE"
    )
    out.write_text(lines[0] + "\nnot json\n" + "\n".join(lines[1:]) + "\n")
    with pytest.raises(ResultsError, match="line 2 is not a JSON record"):
        read_results(out)


def test_an_out_that_is_a_folder_or_unwritable_is_one_line(mini, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    with pytest.raises(ResultsError, match="is a folder; --out names a results file") as e:
        _run(mini, folder, LookupSession({}), limit=1)
    assert "\n" not in str(e.value)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ResultsError, match="cannot be written"):
        _run(mini, blocker / "run.jsonl", LookupSession({}), limit=1)


def test_resume_with_other_settings_is_refused(mini, tmp_path):
    out = tmp_path / "run.jsonl"
    _run(mini, out, LookupSession({}), limit=3)
    with pytest.raises(ResultsError, match="fps: 1.0 vs 2.0.*another --out"):
        _run(mini, out, LookupSession({}), fps=2.0)
    # a larger limit and other scoring resume
    _run(mini, out, LookupSession({}), limit=6, scoring="strict")
    assert len(read_results(out).records) == 6


def test_failed_video_is_skipped_and_retried(mini, tmp_path):
    class Flaky(LookupSession):
        def load_video(self, request):
            if request.path.endswith(".mkv"):
                raise OSError("cannot decode")
            return super().load_video(request)

    out = tmp_path / "run.jsonl"
    run = _run(mini, out, Flaky(answers_for(mini.rows)))
    assert (
        run.stats.failed_videos == {"vidMediumCC": "OSError: cannot decode"}
        and run.stats.answered == 9
    )
    assert len(_run(mini, out, LookupSession(answers_for(mini.rows))).stats.failed_videos) == 0
    assert len(read_results(out).records) == 12


def test_shards_merge_to_the_whole_run(mini, tmp_path):
    table = answers_for(mini.rows, right={"001-1", "003-2", "004-3"})
    whole = _run(mini, tmp_path / "whole.jsonl", LookupSession(table))
    parts = [tmp_path / f"s{i}.jsonl" for i in range(3)]
    for i, p in enumerate(parts):
        _run(mini, p, LookupSession(table), shard=f"{i}/3")
    merged = merge_results(parts, tmp_path / "merged.jsonl")
    assert merged.records == 12 and merged.duplicates == []
    res = read_results(tmp_path / "merged.jsonl")
    assert [r["question_id"] for r in res.records] == sorted(r["question_id"] for r in res.records)
    assert res.headers[0]["merged_from"][0]["path"].endswith("s0.jsonl")
    from lvx_app.eval.report import summarize

    assert summarize(res.records) == whole.summary
    with pytest.raises(ResultsError, match="already exists"):
        merge_results(parts, tmp_path / "merged.jsonl")
    with pytest.raises(ResultsError, match="answered more than once.*--keep-first"):
        merge_results([parts[0], tmp_path / "whole.jsonl"], tmp_path / "dup.jsonl")
    kept = merge_results(
        [parts[0], tmp_path / "whole.jsonl"], tmp_path / "dup.jsonl", keep_first=True
    )
    assert kept.records == 12 and kept.duplicates
    _run(mini, tmp_path / "subs.jsonl", LookupSession(table), subtitles=True, limit=3)
    with pytest.raises(ResultsError, match="subtitles: 'none' vs 'official'"):
        merge_results([parts[0], tmp_path / "subs.jsonl"], tmp_path / "bad.jsonl")


def test_cli_merge_and_report(mini, tmp_path):
    table = answers_for(mini.rows)
    parts = [tmp_path / f"s{i}.jsonl" for i in range(2)]
    for i, p in enumerate(parts):
        _run(mini, p, LookupSession(table), shard=f"{i}/2")
    result = CliRunner().invoke(eval_app, ["merge", str(tmp_path / "all.jsonl"), *map(str, parts)])
    assert result.exit_code == 0, result.output
    assert "merged 12 answers" in result.output and (tmp_path / "all.png").exists()
    result = CliRunner().invoke(
        eval_app, ["report", str(tmp_path / "all.jsonl"), "--scoring", "strict"]
    )
    assert result.exit_code == 0 and "scoring: strict" in result.output
    result = CliRunner().invoke(eval_app, ["merge", str(tmp_path / "all.jsonl"), *map(str, parts)])
    assert (
        result.exit_code == 2
        and "already exists" in result.output
        and "Traceback" not in result.output
    )


def test_engine_adapter_fresh_conversation_per_question(mini, tmp_path):
    from types import SimpleNamespace

    from lvx_app.eval.runner import EngineEvalSession

    class Stats:
        tokens = [7, 8]

        def to_dict(self):
            return {"new_tokens": 2, "truncated": False}

    class FakeEngine(Engine):  # lvx_app's Engine: streaming ask, reset keeps the video
        def __init__(self):
            self.history, self.closed, self.last_answer, self.params = [], False, None, []

        def describe(self):
            return {"world size": 2, "dtype": "float32"}

        def load_video(self, request, *, progress=None):
            assert request.video.subtitles == "none", "the eval's prompt carries its subtitles"
            self.held = request
            return SimpleNamespace(
                path=request.path,
                frames=2,
                fps=request.video.fps,
                duration_s=2.0,
                visual_tokens=1458,
                from_cache=False,
                seconds=0.1,
                transcript=[],
                timestamps=[0.0, 1.0],
            )

        def ask(self, question, **generation):
            assert not self.history, "history carried between questions"
            self.history.append(question)
            self.params.append(generation)
            self.last_answer = Stats()
            yield from ["The answer", " is B."]

        def reset(self):
            self.history.clear()

        def close(self):
            self.closed = True

    engine = FakeEngine()
    out = tmp_path / "run.jsonl"
    config = eval_config(mini.root, out, max_new_tokens=8)
    run_videomme(config, lambda: EngineEvalSession(engine), show_progress=False)
    r = read_results(out).records[0]
    assert read_results(out).headers[0]["engine"] == {"world size": 2, "dtype": "float32"}
    assert r["response"] == "The answer is B." and r["pred"] == "B" and r["frames"] == 2
    assert r["engine"]["visual_tokens"] == 1458 and r["answer_info"] == {
        "new_tokens": 2,
        "truncated": False,
    }
    assert engine.closed
    assert engine.params == [{"max_new_tokens": 8, "temperature": 0.0}] * 12


def test_engine_that_cannot_load_anything_stops_the_run(mini, tmp_path):
    class Broken(LookupSession):
        def load_video(self, request):
            raise RuntimeError("workers gone")

    session = Broken({})
    with pytest.raises(RuntimeError, match="workers gone"):
        _run(mini, tmp_path / "run.jsonl", session)
    assert [c[0] for c in session.calls] == ["reset"] * 3 and not (tmp_path / "run.jsonl").exists()


def test_cli_videomme_builds_the_session_through_the_engine(mini, tmp_path, monkeypatch):
    import lvx_app.cli.evaluate

    made = []

    def open_engine_session(config):
        made.append(config)
        return LookupSession(answers_for(mini.rows))

    monkeypatch.setattr(lvx_app.cli.evaluate, "open_engine_session", open_engine_session)
    out = tmp_path / "r.jsonl"
    args = [
        "videomme",
        "--data",
        str(mini.root),
        "--out",
        str(out),
        "--gpus",
        "0",
        "--ranks",
        "2",
        "--model",
        "tiny",
        "--durations",
        "short",
        "--scoring",
        "strict",
    ]
    result = CliRunner().invoke(eval_app, args)
    assert result.exit_code == 0, result.output
    (config,) = made
    assert (config.model.path, config.model.revision) == ("tiny", None)
    assert (config.parallel.gpus, config.parallel.ranks, config.parallel.timeout_s) == (0, 2, 300.0)
    assert config.video.decode_timeout_s == 120.0 and config.generation.max_new_tokens == 16
    assert len(read_results(out).records) == 6 and "scoring: strict" in result.output
    result = CliRunner().invoke(eval_app, [*args, "--fps", "3"])
    assert (
        result.exit_code == 2
        and "different settings" in result.output
        and "Traceback" not in result.output
    )


def test_a_question_refused_as_too_long_is_recorded_and_the_run_goes_on(mini, tmp_path):
    long_question = mini.rows[1]["question"]

    class Capped(LookupSession):
        def ask(self, prompt, max_new_tokens):
            if long_question in prompt:
                raise QuestionTooLong(
                    "the question is 99,999 tokens, over the 32,768 tokens a question may have here"
                )
            return super().ask(prompt, max_new_tokens)

    out = tmp_path / "run.jsonl"
    run = _run(mini, out, Capped(answers_for(mini.rows)))
    records = {r["question_id"]: r for r in read_results(out).records}
    refused = records[mini.rows[1]["question_id"]]
    assert run.stats.refused == 1 and len(records) == 12
    assert (
        refused["refused"].startswith("the question is 99,999 tokens") and refused["response"] == ""
    )
    assert not refused["correct"] and sum(r["correct"] for r in records.values()) == 11
    again = LookupSession(answers_for(mini.rows))
    assert _run(mini, out, again).stats.refused == 0 and again.asked == [], (
        "a refused question is not asked again"
    )
