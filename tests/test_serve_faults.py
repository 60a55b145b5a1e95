"""`lvx serve` under faults, on 2 CPU ranks driven with gradio_client: two browser sessions with
different videos never get answers about each other's video, and a dead rank is healed by the next
request (the workers restart and
the asking session's video comes back from the feature cache); a rank death mid-answer keeps the
partial answer."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from test_engine import PARAMS, QUESTIONS, _reference
from test_serve import ask, client, last_answer, start_server, stop_server

from lvx_app.config import Config
from lvx_app.engine.api import VideoSummary
from lvx_app.engine.describe import printable
from lvx_app.video.synthetic import make_video
from lvx_ui.app import ChatApp, link_timestamps, message_text

pytestmark = pytest.mark.slow
TOKENS = PARAMS.max_new_tokens  # the reference answers are this long


@pytest.fixture(scope="module")
def served(tiny_checkpoints, short_video, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-faults")
    videos = root / "videos"
    videos.mkdir()
    shutil.copy(short_video, videos / "a.mp4")
    make_video(
        videos / "b.mp4", num_frames=60, fps=10, width=64, height=96, start_index=500, noise=0.5
    )
    checkpoint = tiny_checkpoints["g2"]
    expected = {}
    for name in ("a.mp4", "b.mp4"):
        answer = _reference(checkpoint, str(videos / name))[0]
        expected[name] = link_timestamps(printable(answer), 10.0)
    log = root / "serve.log"
    args = [
        "--gpus",
        "0",
        "--ranks",
        "2",
        "--model",
        checkpoint,
        "--cache-dir",
        str(root / "cache"),
        "--allow-paths",
        str(videos),
        "--max-new-tokens",
        str(TOKENS),
    ]
    proc, url = start_server(args, log)
    server = type(
        "Served", (), dict(url=url, videos=videos, root=root, log=log, auth=None, expected=expected)
    )
    yield server
    stop_server(proc, log)
    assert "Traceback" not in log.read_text(errors="replace")


def _load(c, server, name: str) -> str:
    status, _, _ = c.predict(None, str(server.videos / name), 1.0, 0, api_name="/load")
    assert name in status, status
    return status


def _kill_rank1(server) -> None:
    newest = max(server.root.glob("lvx-run-*/pid-rank1.txt"), key=lambda p: p.stat().st_mtime)
    os.kill(int(newest.read_text()), signal.SIGKILL)


def test_two_sessions_each_get_answers_about_their_own_video(served):
    a, b = client(served), client(served)
    _load(a, served, "a.mp4")
    _load(b, served, "b.mp4")
    assert served.expected["a.mp4"] != served.expected["b.mp4"], (
        "the two videos must give different answers"
    )

    # the reload's progress is checked in-process
    # (test_a_reload_shows_its_progress_to_the_session_that_asked): with the saved video prompt it
    # lasts milliseconds, too short for polling the client's latest status to see
    result = a.predict(QUESTIONS[0], [], TOKENS, api_name="/chat")
    answer, footer = last_answer(result[0])
    assert answer == served.expected["a.mp4"], (
        "A's question must be answered about A's video, not B's"
    )
    assert (
        "about a.mp4" in footer
        and "reloaded a.mp4 for this session from the feature cache" in footer
    ), footer
    assert "a.mp4" in result[-1], "the status shows the video the engine holds now"

    history, _ = ask(b, QUESTIONS[0], [], TOKENS)
    answer, footer = last_answer(history)
    assert (
        answer == served.expected["b.mp4"]
        and "about b.mp4" in footer
        and "reloaded b.mp4" in footer
    ), footer
    history, _ = ask(b, QUESTIONS[0], [], TOKENS)
    answer, footer = last_answer(history)
    assert (
        answer == served.expected["b.mp4"] and "about b.mp4" in footer and "reloaded" not in footer
    ), footer


def test_a_dead_rank_is_healed_by_the_next_request(served):
    c = client(served)
    _load(c, served, "a.mp4")
    _kill_rank1(served)
    texts = []
    for _ in range(
        3
    ):  # the first request may meet the dying group: one line, and the one after heals
        history, _ = ask(c, QUESTIONS[0], [], TOKENS)
        texts.append(message_text(history[-1]["content"]))
        if not texts[-1].startswith("⚠️"):
            break
        assert (
            "rank 1 failed" in texts[-1] and "the workers restart on the next request" in texts[-1]
        ), texts
    answer, footer = last_answer(history)
    assert answer == served.expected["a.mp4"], texts
    assert "the workers restarted after: rank 1 failed" in "".join(texts), texts
    assert "reloaded a.mp4 for this session from the feature cache" in footer, footer
    stats = c.predict(api_name="/stats")
    assert "a.mp4" in stats and "world size: 2" in stats and "⚠️" not in stats, stats


def test_a_rank_death_mid_answer_keeps_the_partial_answer(served):
    c = client(served)
    _load(c, served, "a.mp4")
    job = c.submit(QUESTIONS[0], [], 2000, api_name="/chat")
    for seen, _ in enumerate(job):
        if seen == 3:
            _kill_rank1(served)
            break
    text = message_text(job.result()[0][-1]["content"])
    partial, _, line = text.rpartition("\n\n")
    assert (
        partial
        and line.startswith("⚠️ error: rank 1 failed")
        and "restart on the next request" in line
    ), text
    history, _ = ask(c, QUESTIONS[0], [], TOKENS)
    assert last_answer(history)[0] == served.expected["a.mp4"]
    status = client(served).predict(None, "", 1.0, 0, api_name="/load")[0]
    assert "a.mp4" in status, "the status shows the video the restarted workers hold"


class ReloadingEngine:
    """Just enough of an Engine for a reload: it reports decode progress as the real one does, then
    a summary."""

    def __init__(self) -> None:
        self.loads: list[str] = []

    def load_video(self, path, *, subtitles=None, progress=None, fps=1.0, max_frames=None):
        self.loads.append(path)
        for done in (0, 5, 10):
            progress("frames", done, 10)
        return VideoSummary(path, 10, fps, 10.0, 40, True, 0.01)


def test_a_reload_shows_its_progress_to_the_session_that_asked():
    engine = ReloadingEngine()
    app = ChatApp(engine, Config(), allow_paths=None)
    mine, theirs = ("a.mp4", 1.0, None, ()), ("b.mp4", 1.0, None, ())
    # another session's video is the one loaded now
    app.videos["session A"], app.loaded = (mine, theirs)
    shown = []
    note = app._ensure_video("session A", lambda value, desc=None, unit=None: shown.append(desc))
    assert (
        engine.loads == ["a.mp4"]
        and note == "reloaded a.mp4 for this session from the feature cache"
    )
    assert (
        len(shown) == 3
        and all(d.startswith("frames: ") for d in shown)
        and shown[-1].startswith("frames: 10/10")
    ), shown
    assert app._ensure_video("session A", shown.append) == "", (
        "its own video is loaded now: nothing to reload"
    )
