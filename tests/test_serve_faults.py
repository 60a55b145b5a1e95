"""`lvx serve` under faults, on 2 CPU ranks driven with gradio_client: browser tabs stay apart (each
is answered about its own video, in its own conversation, a tab without a video is asked to load
one, Stop stops only its own answer), and a dead rank is healed by the next request (the workers
restart and the asking tab's video comes back from the feature cache); a rank death mid-answer
keeps the partial answer."""

from __future__ import annotations

import os
import re
import shutil
import signal

import pytest
from test_engine import PARAMS, QUESTIONS, _reference
from test_serve import ask, client, last_answer, start_server, stop_server

from lvx_app.config import Config, VideoConfig
from lvx_app.engine.describe import printable
from lvx_app.engine.records import VideoRequest, VideoSummary
from lvx_app.runtime.engine_handle import Engine
from lvx_app.runtime.service import EngineService
from lvx_app.video.synthetic import make_video
from lvx_ui.app import ChatApp, _progress_reporter, link_timestamps, message_text

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
    expected, follow_ups = {}, {}
    for name in ("a.mp4", "b.mp4"):
        first, second = _reference(checkpoint, str(videos / name))
        expected[name] = link_timestamps(printable(first), 10.0)
        follow_ups[name] = link_timestamps(printable(second), 10.0)
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
        "Served",
        (),
        dict(
            url=url,
            videos=videos,
            root=root,
            log=log,
            auth=None,
            expected=expected,
            follow_ups=follow_ups,
        ),
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
    # (test_a_reload_shows_its_progress_to_the_tab_that_asked): with the saved video prompt it
    # lasts milliseconds, too short for polling the client's latest status to see
    result = a.predict(QUESTIONS[0], [], TOKENS, api_name="/chat")
    answer, footer = last_answer(result[0])
    assert answer == served.expected["a.mp4"], (
        "A's question must be answered about A's video, not B's"
    )
    assert (
        "about a.mp4" in footer and "reloaded your video a.mp4 from the feature cache" in footer
    ), footer
    assert "a.mp4" in result[-1], "the status shows the tab's own video"

    history, _ = ask(b, QUESTIONS[0], [], TOKENS)
    answer, footer = last_answer(history)
    assert (
        answer == served.expected["b.mp4"]
        and "about b.mp4" in footer
        and "reloaded your video b.mp4" in footer
    ), footer
    history, _ = ask(b, QUESTIONS[0], [], TOKENS)
    answer, footer = last_answer(history)
    assert (
        answer == served.expected["b.mp4"] and "about b.mp4" in footer and "reloaded" not in footer
    ), footer


def test_health_is_503_once_a_rank_died_before_any_request_finds_it(served):
    """A rank killed between requests: /health says so (503) on its own, no request needed to
    find it, and 200 again once the next request healed the group."""
    import time
    import urllib.error
    import urllib.request

    from timing import scaled

    def health() -> int:
        try:
            with urllib.request.urlopen(served.url + "health", timeout=60) as answer:
                return answer.status
        except urllib.error.HTTPError as exc:
            return exc.code

    c = client(served)
    _load(c, served, "a.mp4")
    assert health() == 200
    _kill_rank1(served)
    deadline, seen = time.monotonic() + scaled(60), []
    while time.monotonic() < deadline and (not seen or seen[-1] != 503):
        seen.append(health())
        time.sleep(0.2)
    assert seen[-1] == 503, seen
    for _ in range(3):  # the first request may meet the dying group; the one after heals
        history, _ = ask(c, QUESTIONS[0], [], TOKENS)
        if not message_text(history[-1]["content"]).startswith("⚠️"):
            break
    assert health() == 200


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
    assert "reloaded your video a.mp4 from the feature cache" in footer, footer
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
    status = c.predict(None, "", 1.0, 0, api_name="/load")[0]
    assert "a.mp4" in status, "the status shows the tab's own video, back on the restarted workers"


def test_a_tab_without_its_own_video_is_asked_to_load_one(served):
    """Never answered about another tab's video: not its content, not its name."""
    _load(client(served), served, "a.mp4")
    stranger = client(served)
    history, _ = ask(stranger, QUESTIONS[0], [], TOKENS)
    text = message_text(history[-1]["content"])
    assert text == (
        "⚠️ error: load a video in this browser tab first: each tab asks about its own video"
    ), text
    status = stranger.predict(None, "", 1.0, 0, api_name="/load")[0]
    stats = stranger.predict(api_name="/stats")
    assert "No video loaded in this browser tab yet" in status and "a.mp4" not in status, status
    assert "a.mp4" not in stats and "world size: 2" in stats, stats


def test_a_follow_up_keeps_its_own_conversation_when_another_tab_spoke(served):
    a, b = client(served), client(served)
    _load(a, served, "a.mp4")
    history, _ = ask(a, QUESTIONS[0], [], TOKENS)
    assert last_answer(history)[0] == served.expected["a.mp4"]
    _load(b, served, "b.mp4")
    theirs, _ = ask(b, QUESTIONS[0], [], TOKENS)
    history, _ = ask(a, QUESTIONS[1], history, TOKENS)
    answer, footer = last_answer(history)
    assert answer == served.follow_ups["a.mp4"], "A's follow-up is answered in A's conversation"
    assert "reloaded your video a.mp4" in footer, footer
    assert "your conversation was rebuilt from its 1 earlier turn" in footer, footer
    theirs, _ = ask(b, QUESTIONS[1], theirs, TOKENS)
    answer, footer = last_answer(theirs)
    assert answer == served.follow_ups["b.mp4"] and "rebuilt from its 1 earlier turn" in footer


def test_stop_stops_only_the_answer_of_its_own_tab(served):
    a, b = client(served), client(served)
    _load(a, served, "a.mp4")
    _load(b, served, "a.mp4")
    job = a.submit(QUESTIONS[0], [], 2000, api_name="/chat")
    for seen, _ in enumerate(job):
        if seen == 2:
            b.predict(api_name="/stop")  # another tab's Stop: A's answer goes on
            assert not job.done()
        if seen == 40:
            a.predict(api_name="/stop")
    answer, footer = last_answer(job.result()[0])
    tokens = int(re.search(r"(\d+) tokens", footer).group(1))
    assert "interrupted" in footer and 40 <= tokens < 2000, footer


class ReloadingEngine(Engine):
    """Just enough of an Engine for a reload: it reports decode progress as the real one does, then
    a summary; it records the conversations it is asked to rebuild."""

    def __init__(self) -> None:
        self.config = Config()
        self.loads: list[str] = []
        self.replays: list[list] = []

    def load_video(self, request, *, progress=None):
        self.loads.append(request.path)
        for done in (0, 5, 10) if progress else ():
            progress("frames", done, 10)
        self.held = request
        return VideoSummary(request.path, 10, request.video.fps, 10.0, 40, True, 0.01)

    def reset(self) -> None:
        pass

    def replay(self, turns) -> None:
        self.replays.append(list(turns))

    def describe(self) -> dict:
        return {}


def _request(path: str) -> VideoRequest:
    return VideoRequest(path, VideoConfig())


def test_a_reload_shows_its_progress_to_the_tab_that_asked():
    engine = ReloadingEngine()
    service = EngineService(engine)
    mine = service.client("tab A")
    mine.request, mine.turns = _request("a.mp4"), [("what?", [5, 6])]
    with service.lease("tab B") as theirs:  # another tab's video and conversation, now
        theirs.load(_request("b.mp4"))
    shown = []
    report = _progress_reporter(lambda value, desc=None, unit=None: shown.append(desc))
    with service.lease("tab A") as lease:
        notes = lease.ready(report)
    assert engine.loads == ["b.mp4", "a.mp4"] and engine.replays == [[("what?", [5, 6])]]
    assert notes == [
        "reloaded your video a.mp4 from the feature cache",
        "your conversation was rebuilt from its 1 earlier turn: another tab used the model in "
        "between",
    ]
    assert (
        len(shown) == 3
        and all(d.startswith("frames: ") for d in shown)
        and shown[-1].startswith("frames: 10/10")
    ), shown
    with service.lease("tab A") as lease:
        assert lease.ready(report) == [], "its own video and conversation: as is"


def test_forgotten_tabs_are_asked_to_load_again():
    """Past the number of tabs remembered, the one unused longest is forgotten: it gets no answer
    about whatever the engine holds."""
    service = EngineService(ReloadingEngine(), clients_kept=2)
    app = ChatApp(service, Config(), allow_paths=None)
    for owner, name in (("A", "a.mp4"), ("B", "b.mp4"), ("C", "c.mp4")):
        service.client(owner).request = _request(name)
    assert service.client("A").request is None and service.client("C").request is not None
    history = list(app.chat("what?", [], 5, "A"))[-1][0]
    assert message_text(history[-1]["content"]) == (
        "⚠️ error: load a video in this browser tab first: each tab asks about its own video"
    )


def test_a_pasted_book_is_refused_by_its_characters_before_any_rank(served):
    c = client(served)
    _load(c, served, "a.mp4")
    paste = "why? " * 1_999_999 + "why?!"  # 10,000,000 characters
    history, _ = ask(c, paste, [], TOKENS)
    question, answer = (message_text(m["content"]) for m in history[-2:])
    assert answer.startswith("⚠️ error: the question is 10,000,000 characters, more than"), answer
    assert len(question) < 300 and question.endswith("… (10,000,000 characters)"), question[:300]
    history, _ = ask(c, QUESTIONS[0], [], TOKENS)
    assert last_answer(history)[0] == served.expected["a.mp4"]
